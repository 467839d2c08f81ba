"""Properties of the core: the parser never raises and is linear; rewards are permutation
equivariant; normalized components have mean 0."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core import RewardParams, ScoreItem, score_batch
from reward_server.core.answers import canonical_choice, canonical_numeric
from reward_server.core.parsing import parse_completion
from reward_server.core.text import preprocess
from tests.doubles import HashEncoder
from tests.hostile import PIECES

tag_soup = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=60).map(
    "".join
)


@given(st.one_of(st.text(), tag_soup))
@settings(max_examples=400, deadline=None)
def test_parser_and_matchers_never_raise(text: str) -> None:
    parsed = parse_completion(preprocess(text), 32)
    assert parsed.n_strat <= 32
    assert all(s.reasoning and s.outcome for s in parsed.strategies)
    canonical_numeric(preprocess(text))
    canonical_choice(preprocess(text))


def _parse_seconds(text: str) -> float:
    """The best of three runs: a run the scheduler paused (a loaded 2-core machine) is not
    what the parser costs; a quadratic parser is slow on every run."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        parse_completion(preprocess(text), 32)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    "unit",
    [
        "<strategy>",
        "<strategy ",  # opening prefix whose attribute scan must stop at the next '<'
        "<strategy><reasoning>",
        "</strategy >",
        "<final_answer>",
        "<answer>x",
        "<strategy><reasoning>r</reasoning><strategy_outcome>o",
        "</strategy" + " " * 20,
    ],
)
def test_parser_is_linear_on_adversarial_megabytes(unit: str) -> None:
    small = unit * (100_000 // len(unit))
    big = unit * (1_000_000 // len(unit))
    t_small, t_big = _parse_seconds(small), _parse_seconds(big)
    assert t_big < 1.0, f"1 MB of {unit!r} took {t_big:.2f}s"
    # 10x the input may cost ~10x the time, never ~100x (generous margin for a noisy machine).
    assert t_big < 40 * t_small + 0.05


def test_hundred_thousand_unclosed_strategy_tags() -> None:
    text = "<strategy>" * 100_000  # 1 MB
    assert _parse_seconds(text) < 1.0


def test_many_valid_blocks_stop_at_the_cap() -> None:
    block = "<strategy><reasoning>r{}</reasoning><strategy_outcome>o</strategy_outcome></strategy>"
    text = "".join(block.format(i) for i in range(20_000))
    assert parse_completion(text, 256).n_strat == 256
    assert _parse_seconds(text) < 1.0


completions = st.lists(
    st.tuples(
        st.lists(
            st.sampled_from(["plan a", "plan b", "other idea", "count", "draw it"]), max_size=5
        ),
        st.lists(st.sampled_from(["3", "4", "7"]), min_size=5, max_size=5),
        st.sampled_from(["", "<final_answer>7</final_answer>", "<answer>4</answer>"]),
    ),
    min_size=1,
    max_size=12,
)


def _items(spec: list[tuple[list[str], list[str], str]]) -> list[ScoreItem]:
    items = []
    for reasonings, outcomes, tail in spec:
        body = "".join(
            f"<strategy><reasoning>{r}</reasoning><strategy_outcome>{o}</strategy_outcome></strategy>"
            for r, o in zip(reasonings, outcomes, strict=False)
        )
        items.append(ScoreItem(body + tail, "7"))
    return items


@given(completions, st.randoms(use_true_random=False), st.sampled_from(["sde2", "cfee", "cfl"]))
@settings(max_examples=60, deadline=None)
def test_rewards_are_permutation_equivariant(spec, rnd, recipe) -> None:  # type: ignore[no-untyped-def]
    items = _items(spec)
    order = list(range(len(items)))
    rnd.shuffle(order)
    enc = HashEncoder()
    base = score_batch(items, enc, recipe=recipe)
    shuffled = score_batch([items[i] for i in order], enc, recipe=recipe)
    np.testing.assert_allclose(
        shuffled.rewards, [base.rewards[i] for i in order], rtol=0, atol=1e-12
    )
    for key, values in base.components.items():
        assert shuffled.components[key] == [values[i] for i in order]


@given(completions, st.floats(min_value=1e-9, max_value=1.0))
@settings(max_examples=60, deadline=None)
def test_normalized_components_have_mean_zero(spec, eps) -> None:  # type: ignore[no-untyped-def]
    out = score_batch(_items(spec), HashEncoder(), params=RewardParams(eps=eps))
    for values in out.normalized.values():
        assert abs(float(np.mean(values))) < 1e-9
