"""SPEC §1 preprocessing and field-text cleaning, rule by rule."""

import re
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.text import field_text, preprocess, preprocess_with_offsets


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\u2018a\u2019 \u201ab\u201b \u2032", "'a' 'b' '"),
        ("\u201cq\u201d \u201e \u201f \u2033", '"q" " " "'),
        ("1\u20102\u20113\u20124\u20135\u20146\u20157\u22128", "1-2-3-4-5-6-7-8"),
        ("\uff11\uff18", "18"),  # NFKC: full-width digits
        ("\u00bd", "1\u20442"),  # NFKC: vulgar fraction becomes 1⁄2 (fraction slash, not '/')
        ("x\u00a0y", "x y"),  # NFKC: no-break space
        ("\ufb01", "fi"),  # NFKC: ligature
    ],
)
def test_preprocess_maps_punctuation_then_nfkc(raw: str, expected: str) -> None:
    assert preprocess(raw) == expected


def test_preprocess_map_runs_before_nfkc() -> None:
    # U+2033 (double prime) is in the map -> '"'; NFKC alone would give two primes.
    assert preprocess("\u2033") == '"'


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  a \n\t b  ", "a b"),
        ("```python\nx = 1\n```", "x = 1"),
        ("~~~c++ code~~~", "code"),
        ("```\n18\n```", "18"),
        ("```1abc```", "1abc"),  # a language word must start with a letter
        ("**bold** and __under__", "bold and under"),
        ("***", "*"),
        ("**", ""),
        ("_ _", "_ _"),
        ("a\u2028b\u0085c", "a b c"),  # Unicode whitespace per str.isspace
        ("", ""),
    ],
)
def test_field_text_cleaning(raw: str, expected: str) -> None:
    assert field_text(raw) == expected


def test_field_text_order_fences_before_emphasis() -> None:
    # The fence is replaced first, so "```**x**" loses the fence then the emphasis.
    assert field_text("```**x**") == "x"
    # `**` removed before `__`: "*_*_" contains neither pair intact -> unchanged
    assert field_text("*_*_") == "*_*_"


_QUOTES, _DOUBLE_QUOTES = "\u2018\u2019\u201a\u201b\u2032", "\u201c\u201d\u201e\u201f\u2033"
_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"
_SPEC_MAP = str.maketrans(
    {
        **dict.fromkeys(_QUOTES, "'"),
        **dict.fromkeys(_DOUBLE_QUOTES, '"'),
        **dict.fromkeys(_DASHES, "-"),
    }
)
_TYPOGRAPHY = _QUOTES + _DOUBLE_QUOTES + _DASHES


@settings(max_examples=500)
@given(
    st.text(
        alphabet=st.one_of(
            st.characters(codec="ascii"),
            st.sampled_from(_TYPOGRAPHY + "\uff11\u00bd\ufb01"),
            st.characters(),
        )
    )
)
def test_preprocess_is_the_spec_map_then_nfkc(text: str) -> None:
    """The fast paths (ASCII returned as is, one ``str.replace`` per mapped character) give
    exactly SPEC §1's simultaneous map followed by NFKC, on any text."""
    assert preprocess(text) == unicodedata.normalize("NFKC", text.translate(_SPEC_MAP))


def test_every_whitespace_but_the_space_is_non_printable() -> None:
    """What ``field_text``'s already-folded check relies on, over all of Unicode."""
    spaces = [chr(i) for i in range(sys.maxunicode + 1) if chr(i).isspace()]
    assert len(spaces) > 20
    assert [c for c in spaces if c != " " and c.isprintable()] == []


_FIELD_ALPHABET = st.one_of(
    st.sampled_from(" \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u2028\u3000*_`~ab1"), st.characters()
)


@settings(max_examples=500)
@given(st.text(alphabet=_FIELD_ALPHABET))
def test_field_text_is_the_plain_cleaning(raw: str) -> None:
    """The fast paths (no fence scan without "`" or "~", no split of a folded text) give the
    plain definition: fences out, then ``**`` and ``__``, then whitespace folded."""
    plain = re.sub(r"(?:```|~~~)(?:[A-Za-z][A-Za-z0-9_+\-]*)?", " ", raw)
    plain = plain.replace("**", "").replace("__", "")
    assert field_text(raw) == " ".join(plain.split())


def test_offsets_segments_only_where_the_length_changes() -> None:
    """An explanation maps preprocessed offsets back: only pieces NFKC changes in length are
    segments (a full-width digit or an accent left as it was shifts nothing), and a later
    segment's preprocessed offset counts the growth of the earlier ones."""
    pre, offsets = preprocess_with_offsets("\ufb01 \uff11x\u0301\ufb01")
    assert pre == "fi 1x\u0301fi"
    assert offsets.segments == ((0, 2, 0, 1), (6, 8, 5, 6))
    assert [offsets.start(i) for i in range(len(pre))] == [0, 0, 1, 2, 3, 4, 5, 5]
