"""Batch forms of SPEC §5 give, bit for bit, the one-at-a-time figures: all components z-scored
at once against :func:`zscore` of each, and group advantages of groups stacked by size against
each group's own mean and std."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.normalization import _zscores, group_advantages, row_mean_std, zscore

_VALUE = st.one_of(
    st.floats(-10, 10, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, 0.2, 1e-7, 5e-324]),
)
#: Values that overflow the plain sums: the batch path must hand those to zscore.
_HUGE = st.sampled_from([1e300, -1e300, 1.7e308])


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 70),
    k=st.integers(1, 6),
    data=st.data(),
    eps=st.sampled_from([1e-6, 0.0, 0.5, 1e300]),
)
def test_components_together_equal_one_by_one(
    n: int, k: int, data: st.DataObject, eps: float
) -> None:
    value = _VALUE if data.draw(st.booleans()) else st.one_of(_VALUE, _HUGE)
    components = {f"c{i}": data.draw(st.lists(value, min_size=n, max_size=n)) for i in range(k)}
    together = _zscores(np.array(list(components.values()), np.float64), eps)
    if together is None:  # overflow: the one-by-one, rescaling path runs instead
        return
    rows, mus, sigmas = together
    for i, values in enumerate(components.values()):
        z, mu, sigma = zscore(values, eps)
        got = (rows[i].tolist(), float(mus[i]), float(sigmas[i]))
        assert (repr(got[0]), repr(got[1]), repr(got[2])) == (repr(z), repr(mu), repr(sigma))


def _advantages_group_by_group(rewards: list[float], groups: list[str], eps: float) -> list[float]:
    """The plain reading of App. A.2: each group's own 1-d mean and std."""
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    for g in dict.fromkeys(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        values = r[members]
        if values.max() == values.min():  # R − μ = 0 (sum/n may round off the value)
            out[members] = 0.0
        else:
            out[members] = (values - values.mean()) / (values.std() + eps)
    return out.tolist()


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 80),
    n_groups=st.integers(1, 12),
    eps=st.sampled_from([1e-6, 0.5]),
)
def test_group_advantages_equal_group_by_group(
    data: st.DataObject, n: int, n_groups: int, eps: float
) -> None:
    rewards = data.draw(st.lists(_VALUE, min_size=n, max_size=n))
    groups = data.draw(
        st.lists(st.sampled_from([str(g) for g in range(n_groups)]), min_size=n, max_size=n)
    )
    got = group_advantages(rewards, groups, eps)
    assert repr(got) == repr(_advantages_group_by_group(rewards, groups, eps))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), n=st.integers(1, 70))
def test_row_mean_std_is_numpys_mean_and_std_bit_for_bit(
    data: st.DataObject, rows: int, n: int
) -> None:
    """The one computation of means and deviations that zscore, the batch z-scores and the
    advantages share is numpy's own ``mean`` and ``std``, to the bit, but for a row of one
    value: its own mean, σ = 0 and zeros (sum/n may round off the value)."""
    x = np.array(data.draw(st.lists(st.lists(_VALUE, min_size=n, max_size=n), min_size=rows,
                                    max_size=rows)), np.float64)  # fmt: skip
    level = x.max(axis=1) == x.min(axis=1)
    mu, sigma, centered = row_mean_std(x)
    want_mu = np.where(level, x[:, 0], x.mean(axis=1))
    want_centered = np.where(level[:, None], 0.0, x - x.mean(axis=1, keepdims=True))
    assert repr(mu.tolist()) == repr(want_mu.tolist())
    assert repr(sigma.tolist()) == repr(np.where(level, 0.0, x.std(axis=1)).tolist())
    assert repr(centered.tolist()) == repr(want_centered.tolist())
    for row, m, s in zip(x[~level], mu[~level].tolist(), sigma[~level].tolist(), strict=True):
        assert repr((m, s)) == repr((float(np.mean(row)), float(np.std(row))))
