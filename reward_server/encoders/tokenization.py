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
import string
import unicodedata
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import NamedTuple

from tokenizers import Encoding, Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from reward_server.encoders.base import MAX_SEQ_LENGTH
from reward_server.encoders.model_store import EXPORT_AGAIN, ModelLoadError
from reward_server.field_names import unencodable_at

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
#: prefix of ``max_length × PREFIX_CHARS_PER_TOKEN`` characters (:func:`cut_rule`) when that
#: prefix already fills the budget. English averages ~4 characters a token.
PREFIX_CHARS_PER_TOKEN = 32
#: Where a prefix may be cut, the cut character left out: whitespace, where any tokenizer
#: reading words splits (BERT's normalizer deletes other control characters, which would join
#: the words on both sides of a cut made there).
_WHITESPACE_CHARS = " \n\t\r"
_WHITESPACE = re.compile(f"[{_WHITESPACE_CHARS}]")
#: The CJK ideographs BERT's normalizer (``handle_chinese_chars``) spaces, as code point ranges
#: (``tests/test_hostile_limits.py`` reads them back from the tokenizer).
CJK_RANGES = (
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B81F),
    (0x2B920, 0x2CEAF),
    (0x2F800, 0x2FA1F),
)


@cache
def bert_splits() -> re.Pattern[str]:
    """Where BERT's tokenizer (all-MiniLM-L6-v2's) splits too, whatever surrounds: whitespace,
    before a punctuation character (its pre-tokenizer's token of its own: ASCII's, and every
    character of a punctuation category, here those that were punctuation in Unicode 3.2 and
    still are, so in whichever Unicode release the tokenizer was built with) and before a CJK
    ideograph (:data:`CJK_RANGES`). Texts of ideographs or of punctuation hold no whitespace
    to cut at, and were tokenized whole: half a second a 200k-character text.

    Built once, on the first long text (a pass over the Basic Multilingual Plane, ~25 ms).

    >>> [bool(bert_splits().match(c)) for c in " ]。中\U00020000a\u00e9"]
    [True, True, True, True, True, False, False]
    """
    then, now = unicodedata.ucd_3_2_0, unicodedata
    punctuation = [
        c
        for c in map(chr, range(0x80, 0x10000))
        if then.category(c).startswith("P") and now.category(c).startswith("P")
    ]
    cjk = "".join(f"{chr(a)}-{chr(b)}" for a, b in CJK_RANGES)
    ascii_punctuation = re.escape(string.punctuation)
    others = re.escape("".join(punctuation))
    return re.compile(f"[{_WHITESPACE_CHARS}{ascii_punctuation}{others}{cjk}]")


class CutRule(NamedTuple):
    """Where a long text's prefix may end for one tokenizer (:func:`cut_rule`)."""

    #: The characters a prefix may end before.
    points: re.Pattern[str]
    #: The tokenizer's added tokens (``[SEP]``...), matched in the text before it splits: a cut
    #: inside one (before the ``]`` of ``[SEP]``) would read it as ``[``, ``sep``.
    literals: tuple[str, ...]
    #: A run of ASCII letters and digits longer than the longest word the tokenizer splits
    #: into pieces, its first such characters as group 1 (:func:`_long_words`); None where
    #: the tokenizer has no such bound.
    long_words: re.Pattern[str] | None = None


#: ASCII letters and digits: BERT's normalizer keeps each as it is (lower-cased) and its
#: pre-tokenizer never splits between two, so a run of them lies inside one word.
_ALNUM = "A-Za-z0-9"


def cut_rule(tokenizer: Tokenizer) -> CutRule:
    """The :class:`CutRule` of ``tokenizer``: BERT's splits when it is BERT's (its
    pre-tokenizer, its normalizer spacing CJK, its added tokens matched as written), else
    whitespace."""
    normalizer = tokenizer.normalizer
    added = list(tokenizer.get_added_tokens_decoder().values())
    literals = tuple(sorted({token.content for token in added if len(token.content) > 1}))
    if (
        isinstance(tokenizer.pre_tokenizer, BertPreTokenizer)
        and isinstance(normalizer, BertNormalizer)
        and normalizer.handle_chinese_chars
        and not any(token.normalized or token.single_word for token in added)
    ):
        contents = [token.content for token in added]
        return CutRule(bert_splits(), literals, _long_words(tokenizer.model, contents))
    return CutRule(_WHITESPACE, literals)


def _long_words(model: object, added: list[str]) -> re.Pattern[str] | None:
    r"""For a WordPiece ``model`` under BERT's splits: a run of ASCII letters and digits
    longer than ``max_input_chars_per_word``, its first ``max_input_chars_per_word + 1``
    characters as group 1. The word holding such a run is longer than that bound whatever
    else it holds, so it is one ``[UNK]``, as it is with the run cut to group 1: a text read
    whole reads the same ids with its runs so cut (:func:`_whole`). None when an ``added``
    token begins or ends with such a character: matched in the text before it splits, it
    could take a character from a run's edge (``[x`` before ``x`` × 101 leaves 100 ``x``, a
    word split into pieces).

    >>> from tokenizers.models import WordPiece
    >>> _long_words(WordPiece({"[UNK]": 0}, max_input_chars_per_word=3), []).sub(r"\1", "ab abcdef")
    'ab abcd'
    >>> _long_words(WordPiece({"[UNK]": 0}), ["[SEP]", "x"]) is None
    True
    """
    edges = "".join(token[:1] + token[-1:] for token in added)
    if not isinstance(model, WordPiece) or re.search(f"[{_ALNUM}]", edges):
        return None
    n = model.max_input_chars_per_word + 1
    return re.compile(f"(?<![{_ALNUM}])([{_ALNUM}]{{{n}}})[{_ALNUM}]+")


def _whole(text: str, rule: CutRule, longer_than: int) -> str:
    """What ``text`` is read from when it is read whole: its runs of letters and digits over
    the tokenizer's word bound cut to it (:attr:`CutRule.long_words`) when it is over
    ``longer_than`` characters. A text with no cut point (one word of 200,000 letters, a
    number of a million digits) was tokenized whole, every character of it; a shorter text
    is not worth the pass that looks for runs (measurements: benchmarks/README.md, the
    thirty-second pass)."""
    if rule.long_words is None or len(text) <= longer_than:
        return text
    return rule.long_words.sub(r"\1", text)


def _prefix(text: str, chars: int, rule: CutRule) -> str | None:
    """``text`` cut before the last of ``rule``'s points before ``chars`` characters, and
    before any added token the cut would fall inside; None when not longer (or no such point).

    >>> rule = CutRule(_WHITESPACE, ("[SEP]",))
    >>> _prefix("ab cd!ef", 7, rule), _prefix("ab cd!ef", 7, rule._replace(points=bert_splits()))
    ('ab', 'ab cd')
    >>> _prefix("a [SEP]b", 7, rule._replace(points=bert_splits()))  # not before its "]"
    'a '
    >>> _prefix("中文数学", 3, rule._replace(points=bert_splits())), _prefix("abcdef", 3, rule)
    ('中文', None)
    """
    if len(text) <= chars:
        return None
    found = rule.points.search(text[chars - 1 :: -1])  # the first one reading back from `chars`
    cut = chars - 1 - found.start() if found else 0
    moved = True
    while moved and cut > 0:  # an added token's start is a split too: cut there
        moved = False
        for literal in rule.literals:
            at = text.find(literal, max(0, cut - len(literal) + 1), cut + len(literal) - 1)
            if 0 <= at < cut:
                cut, moved = at, True
    return text[:cut] if cut > 0 else None


def encode_ids(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids per text (``[CLS] ... [SEP]``, at most the configured budget), unpadded.

    Long texts are tokenized from a prefix, never whole: a 200 kB completion (or a short one
    that Unicode NFKC expanded 18×, e.g. U+FDFA) would otherwise be tokenized entirely to keep
    its first 256 tokens. The ids are exactly those of the whole text: the prefix ends where
    the tokenizer splits anyway (:func:`cut_rule`), so its words tokenize as in the whole
    text; a prefix whose tokens overflow the budget therefore gives the same first tokens. A
    prefix that does not fill the budget (words averaging over 32 characters: a long word is
    one ``[UNK]``) is tried again, twice as long as its tokens say the budget needs (four times
    as long at least), until one fills it or the text is whole: a text costs about what its
    first 256 tokens take to read, a text of few tokens little more than itself read whole,
    with its runs of letters too long to be more than an ``[UNK]`` cut short (:func:`_whole`).
    """
    texts = list(texts)
    truncation = tokenizer.truncation
    budget = 0 if truncation is None else int(truncation["max_length"])
    first = budget * PREFIX_CHARS_PER_TOKEN
    # Read whole: with nothing cut every character counts, and the usual call holds no text
    # long enough to cut.
    if truncation is None or all(len(t) <= first for t in texts):
        return [enc.ids for enc in _encoded(tokenizer, texts)]
    rule = cut_rule(tokenizer)
    ids: list[list[int]] = [[] for _ in texts]
    # The texts whose ids are not known yet, and the characters each is read from next.
    pending = dict.fromkeys(range(len(texts)), first)
    while pending:
        prefixes = [_prefix(texts[i], chars, rule) for i, chars in pending.items()]
        inputs = [
            _whole(texts[i], rule, first) if p is None else p
            for i, p in zip(pending, prefixes, strict=True)
        ]
        encodings = _encoded(tokenizer, inputs, [(i, texts[i]) for i in pending])
        short = {}
        for (i, chars), prefix, enc in zip(pending.items(), prefixes, encodings, strict=True):
            if prefix is not None and not enc.overflowing:  # the budget not filled: go on,
                # twice as far as its tokens so far say the budget needs, four times at least
                short[i] = max(4 * chars, 2 * chars * budget // len(enc.ids))
            else:
                ids[i] = enc.ids
        pending = short
    return ids


def _encoded(
    tokenizer: Tokenizer, texts: list[str], sources: Sequence[tuple[int, str]] | None = None
) -> list[Encoding]:
    """``tokenizer.encode_batch`` with special tokens; a text holding a lone surrogate (which
    no transport lets through, but a caller in Python may) is a :class:`ValueError` naming
    it: tokenizers refused the whole call with a ``TypeError`` about its input's type.
    ``sources``: the caller's index and text that each of ``texts`` was read from (a prefix,
    or the text with runs of letters cut: each holds the same first surrogate), so that the
    message counts in the caller's batch and text; by default ``texts`` themselves."""
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=True)
    except TypeError:
        for read, (i, text) in zip(texts, sources or list(enumerate(texts)), strict=True):
            if unencodable_at(read) is not None:
                at = unencodable_at(text)  # the same first one, counted in the caller's text
                raise ValueError(
                    f"text {i} of the batch ({text[:40]!r}...) holds a lone surrogate "
                    f"({text[at or 0]!r} at character {at}): not Unicode text an encoder "
                    "can read"
                ) from None
        raise
