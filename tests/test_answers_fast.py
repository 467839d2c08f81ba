"""The numeric matcher's whole-number shortcut against the canonical comparison of SPEC §2."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.answers import _same, canonical_numeric, make_matcher

_NUMBER = st.one_of(
    st.integers(0, 10**6).map(str),
    st.integers(0, 999).map(lambda n: f"00{n}"),
    st.sampled_from(["7", "7.0", "07", "-7", "3/1", "6/2", "0", "-0", "1e3", "٣", "²", " 7", "7 "]),
    st.sampled_from(["9" * 1000, "9" * 1001, "1" + "0" * 999, "\\boxed{12}", "12 apples", "x"]),
)


@settings(max_examples=600, deadline=None)
@given(prediction=_NUMBER, gold=_NUMBER)
def test_numeric_matcher_is_the_canonical_comparison(prediction: str, gold: str) -> None:
    expected = _same(canonical_numeric(prediction), canonical_numeric(gold))
    assert make_matcher("numeric", gold)(prediction) is expected
