"""The numeric matcher's shortcuts (a whole-number prediction, a batch of them) against the
canonical comparison of SPEC §2."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.answers import _same, canonical_numeric, make_matcher, math_equivalent
from reward_server.core.parsing import ParsedCompletion, Strategy
from reward_server.core.scoring import ScoreItem, analyze_items, preprocessed_golds

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


_GROUPED = st.sampled_from([0, 7, 1000, 1200, 850000, 1000000]).map(lambda n: f"{n:,}")
_PREDICTION = st.one_of(
    st.integers(0, 400).map(str),
    _GROUPED,
    st.sampled_from(["0", "00", "012", "7.0", "-7", "1,000", "1 2", "٣", "12 apples", "x", ""]),
    st.sampled_from(["1,,000", "1,", ",5", "0,5", "12,3", "1,000\n", "1\n000", "01,000"]),
)
_GOLD = st.one_of(
    st.integers(0, 400).map(str),
    _GROUPED,
    st.sampled_from(["-7", "0.5", "#### 1,000", "3/1", "Paris", "012", "1e3", "12,3"]),
)


@settings(max_examples=400, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_GOLD, st.lists(_PREDICTION, max_size=4), st.one_of(st.none(), _PREDICTION)),
        min_size=1,
        max_size=6,
    ),
    needs_encoder=st.booleans(),
    diagnostics=st.booleans(),
)
def test_batch_verdicts_are_the_matchers(
    rows: list[tuple[str, list[str], str | None]], needs_encoder: bool, diagnostics: bool
) -> None:
    """``analyze_items`` (string comparisons when every gold is whole and every prediction is
    in plain digits, else the matchers) against each item's matcher called on each answer."""
    items = [ScoreItem(completion=f"c{k}", answer=gold) for k, (gold, _, _) in enumerate(rows)]
    parsed = [
        ParsedCompletion(tuple(Strategy(f"r{j}", o) for j, o in enumerate(outcomes)), final)
        for _, outcomes, final in rows
    ]
    golds = preprocessed_golds(items)
    analyses = analyze_items(
        items, parsed, golds, "numeric", math_equivalent, needs_encoder, diagnostics
    )
    for item, p, analysis in zip(items, parsed, analyses, strict=True):
        matches = make_matcher("numeric", item.answer)
        chi = any(matches(s.outcome) for s in p.strategies)
        assert analysis.correct is (p.final_answer is not None and matches(p.final_answer))
        assert analysis.strategy_correct is chi
        assert analysis.needs_geometry is (
            len(p.strategies) >= 2 and (diagnostics or (needs_encoder and not chi))
        )
        assert analysis.parsed is p and analysis.completion == item.completion
