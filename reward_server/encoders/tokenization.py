"""Word-piece tokenization that matches sentence-transformers exactly, without transformers.

The ``tokenizer.json`` shipped with all-MiniLM-L6-v2 has *fixed padding to 128 and truncation at
128* baked in. Used as is, every text is cut at 128 word pieces and padded, and the embeddings
silently drift from sentence-transformers (min cosine 0.57 measured over 320 texts). The model's
real budget is ``max_seq_length = 256`` tokens including ``[CLS]`` and ``[SEP]``, so we always
reconfigure the tokenizer after loading it: no padding (batching pads per batch, to the batch's
longest text) and truncation at 256.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Encoding, Tokenizer
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from reward_server.encoders.base import MAX_SEQ_LENGTH
from reward_server.encoders.model_store import EXPORT_AGAIN, ModelLoadError

#: The file name the tokenizer lives in, in both Hugging Face folders and our exports.
TOKENIZER_FILE = "tokenizer.json"


def configure_tokenizer(tokenizer: Tokenizer, max_length: int = MAX_SEQ_LENGTH) -> Tokenizer:
    """Disable padding and truncate at ``max_length`` tokens (special tokens included), in place.

    Returns the same object so that the call can be chained after loading.
    """
    tokenizer.no_padding()
    # "longest_first" is what transformers uses for single sequences; stride 0: no overflow windows.
    tokenizer.enable_truncation(max_length=max_length, stride=0, strategy="longest_first")
    return tokenizer


def load_tokenizer(model_dir: str | Path, max_length: int = MAX_SEQ_LENGTH) -> Tokenizer:
    """Load ``model_dir/tokenizer.json`` and configure it as sentence-transformers does."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        raise ModelLoadError(
            f"{path} is not a readable tokenizer ({exc}): {EXPORT_AGAIN}"
        ) from None
    return configure_tokenizer(tokenizer, max_length)


def save_configured_tokenizer(
    src_dir: str | Path, dst_dir: str | Path, max_length: int = MAX_SEQ_LENGTH
) -> Path:
    """Write ``dst_dir/tokenizer.json`` with padding off and truncation at ``max_length``.

    Exports carry a tokenizer file that is already right, so that any other consumer of the folder
    (a different runtime, a person poking at it) does not fall into the fixed-128 trap either.
    """
    tokenizer = load_tokenizer(src_dir, max_length)
    dst = Path(dst_dir) / TOKENIZER_FILE
    dst.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dst))
    # Round-trip check: a tokenizers version that dropped the settings on save would be caught here.
    saved = json.loads(dst.read_text(encoding="utf-8"))
    if (
        saved.get("padding") is not None
        or (saved.get("truncation") or {}).get("max_length") != max_length
    ):
        raise RuntimeError(f"{dst}: padding/truncation settings were not saved as configured")
    return dst


#: Characters per token above which a text's tail cannot matter: a text is tokenized from a
#: prefix of ``max_length × PREFIX_CHARS_PER_TOKEN`` characters (cut at a space) when that
#: prefix already fills the budget. English averages ~4 characters a token.
PREFIX_CHARS_PER_TOKEN = 32
#: Where a prefix may be cut, the cut character left out: whitespace, where any tokenizer
#: reading words splits (BERT's normalizer deletes other control characters, which would join
#: the words on both sides of a cut made there).
_WHITESPACE = re.compile("[ \n\t\r]")
#: Where BERT's tokenizer (all-MiniLM-L6-v2's) splits too, whatever surrounds: before an ASCII
#: punctuation character (its pre-tokenizer's token of its own) and before a CJK ideograph (its
#: normalizer's ``handle_chinese_chars`` spaces them). A text of 200k ideographs or of "!" has
#: no whitespace to cut at: it was tokenized whole, half a second a text.
_BERT_SPLITS = re.compile("[ \n\t\r!-/:-@\\[-`{-~\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def cut_points(tokenizer: Tokenizer) -> re.Pattern[str]:
    """The characters a prefix of a text may end before, for ``tokenizer``: BERT's splits when
    it is BERT's (its pre-tokenizer, and its normalizer spacing CJK), else whitespace."""
    normalizer = tokenizer.normalizer
    if (
        isinstance(tokenizer.pre_tokenizer, BertPreTokenizer)
        and isinstance(normalizer, BertNormalizer)
        and normalizer.handle_chinese_chars
    ):
        return _BERT_SPLITS
    return _WHITESPACE


def _prefix(text: str, chars: int, cuts: re.Pattern[str]) -> str | None:
    """``text`` cut before the last of ``cuts`` before ``chars`` characters; None when not
    longer (or no such character).

    >>> _prefix("ab cd!ef", 7, _BERT_SPLITS), _prefix("ab cd!ef", 7, _WHITESPACE)
    ('ab cd', 'ab')
    >>> _prefix("中文数学", 3, _BERT_SPLITS), _prefix("abcdef", 3, _BERT_SPLITS)
    ('中文', None)
    """
    if len(text) <= chars:
        return None
    found = cuts.search(text[chars - 1 :: -1])  # the first one reading back from `chars`
    cut = chars - 1 - found.start() if found else 0
    return text[:cut] if cut > 0 else None


def encode_ids(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids per text (``[CLS] ... [SEP]``, at most the configured budget), unpadded.

    Long texts are tokenized from a prefix, never whole: a 200 kB completion (or a short one
    that Unicode NFKC expanded 18×, e.g. U+FDFA) would otherwise be tokenized entirely to keep
    its first 256 tokens. The ids are exactly those of the whole text: the prefix ends where
    the tokenizer splits anyway (:func:`cut_points`), so its words tokenize as in the whole
    text; a prefix whose tokens overflow the budget therefore gives the same first tokens. A
    prefix that does not fill the budget (words averaging over 32 characters) is retried whole.
    """
    texts = list(texts)
    truncation = tokenizer.truncation
    if truncation is None:  # nothing is cut: every character counts
        return [enc.ids for enc in _encoded(tokenizer, texts)]
    chars = int(truncation["max_length"]) * PREFIX_CHARS_PER_TOKEN
    cuts = cut_points(tokenizer)
    prefixes = [_prefix(t, chars, cuts) for t in texts]
    inputs = [t if p is None else p for t, p in zip(texts, prefixes, strict=True)]
    encodings = _encoded(tokenizer, inputs)
    ids = [enc.ids for enc in encodings]
    retry = [i for i, p in enumerate(prefixes) if p is not None and not encodings[i].overflowing]
    if retry:
        whole = _encoded(tokenizer, [texts[i] for i in retry])
        for i, enc in zip(retry, whole, strict=True):
            ids[i] = enc.ids
    return ids


def _encoded(tokenizer: Tokenizer, texts: list[str]) -> list[Encoding]:
    """``tokenizer.encode_batch`` with special tokens; a text holding a lone surrogate (which
    no transport lets through, but a caller in Python may) is a :class:`ValueError` naming
    it: tokenizers refused the whole call with a ``TypeError`` about its input's type."""
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=True)
    except TypeError:
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"text {i} of the batch ({text[:40]!r}...) holds a lone surrogate "
                    f"({text[exc.start]!r} at character {exc.start}): not Unicode text an "
                    "encoder can read"
                ) from None
        raise
