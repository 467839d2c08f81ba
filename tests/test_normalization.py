"""SPEC §5: z-scores with the sigma <= eps rule, aggregation and group advantages."""

from __future__ import annotations

import numpy as np
import pytest

from reward_server.core.normalization import (
    NonFiniteRewardError,
    _zscores,
    aggregate,
    group_advantages,
    zscore,
)
from reward_server.core.params import RewardParams


def test_zscore_population_std() -> None:
    z, mu, sigma = zscore([1.0, 2.0, 3.0, 4.0], 1e-6)
    assert mu == 2.5
    assert sigma == pytest.approx(np.sqrt(1.25))  # population, not sample
    assert z == pytest.approx([(x - 2.5) / (np.sqrt(1.25) + 1e-6) for x in [1, 2, 3, 4]])


def test_zscore_sigma_at_most_eps_only_centres() -> None:
    z, _, sigma = zscore([1.0, 1.0 + 1e-7], 1e-6)
    assert sigma <= 1e-6  # sigma = 5e-8 <= eps
    assert z == pytest.approx([-5e-8, 5e-8], abs=1e-15)
    z, _, _ = zscore([0.0, 0.5], 0.25)  # sigma = 0.25 exactly: not > eps
    assert z == [-0.25, 0.25]
    z, _, _ = zscore([0.0, 0.5], 0.2)
    assert z == pytest.approx([-0.25 / 0.45, 0.25 / 0.45])


def test_aggregate_weights_normalized_components() -> None:
    comps = {"oc": [1.0, 0.0], "sd": [0.5, 0.5]}
    p = RewardParams(weights={"oc": 2.0, "sd": 3.0})
    out = aggregate(comps, p, normalize=True, groups=None)
    z = 0.5 / (0.5 + 1e-6)
    assert out.rewards == pytest.approx([2 * z, -2 * z])  # sd has sigma 0: centred to 0
    assert out.normalized["sd"] == [0.0, 0.0]
    assert out.mean == {"oc": 0.5, "sd": 0.5}
    assert out.std == {"oc": 0.5, "sd": 0.0}
    assert out.advantages is None


def test_aggregate_without_normalization_is_weighted_raw_sum() -> None:
    comps = {"oc": [1.0, 0.0], "fa": [0.6, 0.2]}
    out = aggregate(comps, RewardParams(weights={"fa": 0.5}), normalize=False, groups=None)
    assert out.rewards == pytest.approx([1.3, 0.1])


@pytest.mark.parametrize("normalize", [True, False])
def test_aggregate_refuses_an_overflowing_reward(normalize: bool) -> None:
    """Values of about 1 and 0 (raw or z-scored): one weight of 1.7e308 is finite, two overflow."""
    comps = {"oc": [1.0, 0.0], "fa": [1.0, 0.0]}
    one = aggregate(
        comps, RewardParams(weights={"oc": 1.7e308, "fa": 0.0}), normalize=normalize, groups=None
    )
    assert one.rewards[0] == pytest.approx(1.7e308, rel=1e-5)  # z = 0.5 / (0.5 + eps)
    two = RewardParams(weights={"oc": 1.7e308, "fa": 1.7e308})
    with pytest.raises(NonFiniteRewardError, match=r"^params: .*non-finite"):
        aggregate(comps, two, normalize=normalize, groups=None)


def test_group_advantages_per_group() -> None:
    adv = group_advantages([1.0, 3.0, 10.0, 10.0, 4.0], ["a", "a", "b", "b", "c"], 1e-6)
    assert adv[:2] == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)])
    assert adv[2:] == [0.0, 0.0, 0.0]


def test_aggregate_with_groups_returns_advantages() -> None:
    out = aggregate(
        {"oc": [1.0, 0.0, 1.0, 1.0]}, RewardParams(), normalize=True, groups=["x", "x", "y", "y"]
    )
    assert out.advantages is not None
    assert out.advantages[0] > 0 > out.advantages[1]
    assert out.advantages[2:] == [0.0, 0.0]


def test_zscore_near_the_float_limit_matches_the_exact_values() -> None:
    z, mu, sigma = zscore([1e308, 1e308, 0.0], 1e-6)
    assert mu == pytest.approx(1e308 / 3 * 2)
    assert sigma == pytest.approx(np.sqrt(2) / 3 * 1e308)
    assert z == pytest.approx([1 / np.sqrt(2), 1 / np.sqrt(2), -np.sqrt(2)])
    z, mu, sigma = zscore([1.7e308, -1.7e308], 1e-6)
    assert (mu, sigma) == (0.0, 1.7e308)
    assert z == pytest.approx([1.0, -1.0])


def test_zscore_ordinary_values_are_the_plain_formula_bit_for_bit() -> None:
    values = [0.1, 0.7, 0.3, 1.9]
    x = np.asarray(values)
    z, mu, sigma = zscore(values, 1e-6)
    assert (mu, sigma) == (float(x.mean()), float(x.std()))
    assert z == ((x - x.mean()) / (x.std() + 1e-6)).tolist()


@pytest.mark.parametrize("scale", [1e150, 1e160, 1e200, 1e300, 1.7e308])
def test_group_advantages_of_huge_rewards_are_not_zeroed(scale: float) -> None:
    """Rewards whose squared deviations overflow (finite weights of 1e200, say) keep the
    advantages the formula gives, those of the same rewards scaled down; an ordinary group in
    the same batch is untouched."""
    rewards = [1.0 * scale, 0.0, 0.25 * scale, 1.0, 3.0]
    groups = ["big", "big", "big", "small", "small"]
    adv = group_advantages(rewards, groups, 1e-6)
    exact = np.array([1.0, 0.0, 0.25])
    want = (exact - exact.mean()) / exact.std()
    assert adv[:3] == pytest.approx(want.tolist(), rel=1e-12)
    assert adv[3:] == group_advantages([1.0, 3.0], ["small", "small"], 1e-6)


def test_huge_weights_give_the_advantages_of_ordinary_ones() -> None:
    """Through the aggregation (the reviewer's case: weight oc=1e200, one right, one wrong)."""
    big = RewardParams(weights={"oc": 1e200, "re": 0, "fa": 0, "sd": 0})
    for normalize in (False, True):
        out = aggregate({"oc": [1.0, 0.0]}, big, normalize=normalize, groups=["g", "g"])
        assert out.advantages == pytest.approx([1.0, -1.0], rel=1e-5)


@pytest.mark.parametrize("value", [12345678903.834568, 3.3e15, 1.7e308, -7.1e12])
def test_equal_values_normalize_to_zero_at_any_scale(value: float) -> None:
    """SPEC §5: equal values have σ = 0, so R − μ = 0. sum/n rounded the value off by a step,
    which past ~5e9 exceeds eps: every item read about ±1 (normalized and advantages alike)."""
    z, mu, sigma = zscore([value] * 3, 1e-6)
    assert (z, mu, sigma) == ([0.0, 0.0, 0.0], value, 0.0)
    assert group_advantages([value] * 3 + [1.0, 2.0], ["g"] * 3 + ["h"] * 2, 1e-6)[:3] == [0.0] * 3
    params = RewardParams(lambda_oc=value) if value > 0 else RewardParams()
    agg = aggregate({"oc": [value] * 3}, params, normalize=True, groups=["g"] * 3)
    assert agg.normalized["oc"] == [0.0] * 3 and agg.std["oc"] == 0.0 and agg.mean["oc"] == value
    assert agg.rewards == [0.0] * 3 and agg.advantages == [0.0] * 3


def test_aggregate_reports_sigma_of_a_component_too_large_to_square() -> None:
    """SPEC §5's ``σ_k`` is the population std even where the squares overflow (any finite
    ``lambda_oc`` is allowed): the batch statistics report it, not the mean."""
    top = 1.7e308
    agg = aggregate(
        {"oc": [top, 0.0, 0.0], "fa": [0.0, 1.0, 1.0]},
        RewardParams(),
        normalize=True,
        groups=None,
    )
    assert agg.mean["oc"] == pytest.approx(top / 3, rel=1e-12)
    assert agg.std["oc"] == pytest.approx(top / 3 * 2**0.5, rel=1e-12)
    assert agg.normalized["oc"] == pytest.approx([2**0.5, -(2**-0.5), -(2**-0.5)], rel=1e-9)


def test_zscore_of_centred_values_beyond_float_range() -> None:
    """SPEC §5 where ``R − μ`` itself overflows (the rescaled branch of :func:`zscore`).

    ``[M, −M, −M]`` with ``M = 1.5e308``: ``μ = −M/3``, the deviations are ``4M/3`` (2e308,
    past float range) and ``−2M/3``; ``σ = sqrt((16 + 4 + 4)/27)·M = (2√2/3)·M = √2·1e308``,
    so ``R̃ = [√2, −1/√2, −1/√2]`` (eps is nothing at this scale). The existing near-limit
    cases keep ``R − μ`` finite and never reach this branch; its numerator's sign and its
    exponent are pinned here.
    """
    z, mu, sigma = zscore([1.5e308, -1.5e308, -1.5e308], 1e-6)
    assert mu == pytest.approx(-5e307, rel=1e-12)
    assert sigma == pytest.approx(2**0.5 * 1e308, rel=1e-12)
    assert z == pytest.approx([2**0.5, -(2**-0.5), -(2**-0.5)], rel=1e-12)


def test_finite_components_take_the_batch_path_with_spec_figures() -> None:
    """:func:`_zscores` z-scores a finite batch itself (``None`` is only for overflow), with
    SPEC §5's figures: ``[1, 3]`` has ``μ = 2``, ``σ = 1``, so ``R̃ = ±1/(1 + eps)``; ``[2, 2]``
    has ``σ = 0 <= eps``, so ``R̃ = R − μ = 0``. The bit-for-bit batch test returns early on
    ``None``, so a batch path that always gave up would pass it unnoticed."""
    together = _zscores(np.array([[1.0, 3.0], [2.0, 2.0]]), 1e-6)
    assert together is not None
    z, mu, sigma = together
    assert z[0].tolist() == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)], rel=1e-12)
    assert z[1].tolist() == [0.0, 0.0]
    assert mu.tolist() == [2.0, 2.0]
    assert sigma.tolist() == [1.0, 0.0]
