"""Batch normalization, weighted aggregation and group advantages (SPEC §5, paper App. A).

These functions are shared by the server and by the trainer client, which normalizes over a whole
batch after scoring shards of it on several replicas: the same code gives the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reward_server.core.params import RewardParams


class NonFiniteRewardError(ValueError):
    """Some reward, component or batch statistic is not finite: the parameters are to blame.

    Raised by :func:`aggregate`, the one place every scorer (server, offline scorer, the client's
    merge of shards) passes through, so that none of them can emit ``inf`` or ``NaN`` as a reward.
    """

    #: SPEC §4 allows any finite parameter, so weighted sums can overflow: the field to blame.
    field = "params"
    reason = "these parameters make a reward overflow to a non-finite value"

    def __init__(self) -> None:
        super().__init__(f"{self.field}: {self.reason}")


@dataclass(frozen=True)
class Aggregate:
    """The batch-level outputs of SPEC §5 for one request."""

    rewards: list[float]
    normalized: dict[str, list[float]]
    mean: dict[str, float]
    std: dict[str, float]
    advantages: list[float] | None


def _mean_std(x: npt.NDArray[np.float64]) -> tuple[float, float, npt.NDArray[np.float64]]:
    """``μ``, population ``σ`` and ``x − μ``, exact to the plain formulas, without overflow.

    Valid rewards can be as large as ``1.7e308`` (any finite parameter is allowed), where the
    plain sum or squares overflow. Only then are the values scaled by a power of two, which is
    exact, so ordinary batches get bit-for-bit the plain computation.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        mu, sigma, centered = _one_row(row_mean_std(x[None, :]))
    if math.isfinite(mu) and math.isfinite(sigma) and np.all(np.isfinite(centered)):
        return mu, sigma, centered
    e = math.frexp(float(np.max(np.abs(x))))[1]
    mu_s, sigma_s, centered_s = _one_row(row_mean_std(np.ldexp(x, -e)[None, :]))
    with np.errstate(over="ignore"):
        return math.ldexp(mu_s, e), math.ldexp(sigma_s, e), np.ldexp(centered_s, e)


def _one_row(
    stats: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]],
) -> tuple[float, float, npt.NDArray[np.float64]]:
    """:func:`row_mean_std` of a one-row array as ``(μ, σ, x − μ)`` of that row."""
    mu, sigma, centered = stats
    return float(mu[0]), float(sigma[0]), centered[0]


def zscore(values: Sequence[float], eps: float) -> tuple[list[float], float, float]:
    """``(R − μ)/(σ + eps)`` if ``σ > eps`` else ``R − μ``, with population ``σ``.

    Returns the normalized values with ``μ`` and ``σ``.

    >>> zscore([1.0, 3.0], 1e-6)[0]
    [-0.9999990000010001, 0.9999990000010001]
    >>> zscore([2.0, 2.0], 1e-6)
    ([0.0, 0.0], 2.0, 0.0)
    >>> [round(z, 6) for z in zscore([1e308, -1e308], 1e-6)[0]]
    [1.0, -1.0]
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return [], 0.0, 0.0
    mu, sigma, centered = _mean_std(x)
    if sigma > eps and not np.all(np.isfinite(centered)):
        # Centred values beyond float range (R − μ ≈ 2e308): divide before rescaling.
        e = math.frexp(sigma)[1]
        scaled = (np.ldexp(x, -e) - math.ldexp(mu, -e)) / (
            math.ldexp(sigma, -e) + math.ldexp(eps, -e)
        )
        return scaled.tolist(), mu, sigma
    out = centered / (sigma + eps) if sigma > eps else centered
    return out.tolist(), mu, sigma


def row_mean_std(
    x: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Each row's mean and population standard deviation, and ``x`` minus its row's mean.

    The ufunc calls that ``x.mean(axis=1)`` and ``x.std(axis=1)`` make (each row's pairwise
    sum divided by its length; the root of the mean squared deviation), so the figures are
    theirs bit for bit, with the centred values computed once for both and without numpy's
    Python wrappers, which cost more than the arithmetic on a batch's rows.

    >>> [a.tolist() for a in row_mean_std(np.array([[1.0, 3.0], [2.0, 2.0]]))]
    [[2.0, 2.0], [1.0, 0.0], [[-1.0, 1.0], [0.0, 0.0]]]
    >>> [a.tolist() for a in row_mean_std(np.array([[12345678903.834568] * 3]))]
    [[12345678903.834568], [0.0], [[0.0, 0.0, 0.0]]]
    """
    n = x.shape[1]
    mu = np.add.reduce(x, axis=1) / n
    centered = x - mu[:, None]
    sigma = np.sqrt(np.add.reduce(np.square(centered), axis=1) / n)
    # A row of one value has σ = 0 and R − μ = 0 exactly (SPEC §5), but sum/n can be that
    # value off by a rounding step, which past ~5e9 exceeds eps: each item then read about ±1
    # (the same sign for all) instead of 0.
    level = np.maximum.reduce(x, axis=1) == np.minimum.reduce(x, axis=1)
    if level.any():
        mu[level] = x[level, 0]
        centered[level] = 0.0
        sigma[level] = 0.0
    return mu, sigma, centered


def _zscores(
    x: npt.NDArray[np.float64], eps: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """:func:`zscore` of every row of ``x`` (one component per row) at once, as ``(z, μ, σ)``
    arrays, or ``None`` when some value or statistic is not finite (then :func:`zscore`'s
    overflow-safe path must run, row by row).

    ``x`` in C order: each component's row is reduced as one contiguous run, the pairwise sums
    ``np.mean`` and ``np.std`` take of the row alone, so every figure is bit for bit
    :func:`zscore`'s (checked in ``tests/test_normalization_batch.py``), with a dozen numpy
    calls a batch instead of a dozen a component.
    """
    if x.ndim != 2 or x.shape[1] == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mu, sigma, centered = row_mean_std(x)
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            return None
        if not np.isfinite(centered).all():
            return None
        spread = sigma > eps
        z: npt.NDArray[np.float64] = np.where(
            spread[:, None], centered / (sigma + eps)[:, None], centered
        )
    return z, mu, sigma


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float) -> list[float]:
    """GRPO advantages ``Â = (R − μ_b)/(σ_b + eps)`` within each group (population ``σ``).

    Groups of one size are stacked and reduced row by row (one ``mean`` and one ``std`` per
    size, not per group): each row's pairwise sum is the one ``np.mean`` takes of the group
    alone, so the figures are bit for bit the group-by-group ones.

    >>> group_advantages([1.0, 0.0, 5.0], ["a", "a", "b"], 1e-6)
    [0.999998000004, -0.999998000004, 0.0]

    A group whose rewards are so large that their squared deviations overflow (any finite
    weights are allowed) takes :func:`zscore`'s overflow-safe path: its ``σ`` is then far above
    ``eps`` (or 0, its rewards all equal), where ``zscore`` computes this same formula.

    >>> group_advantages([1e200, 0.0], ["a", "a"], 1e-6)
    [1.0, -1.0]
    """
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    by_size: dict[int, list[list[int]]] = {}
    for members in index.values():
        by_size.setdefault(len(members), []).append(members)
    for stacked in by_size.values():
        rows = np.array(stacked, dtype=np.intp)
        with np.errstate(over="ignore", invalid="ignore"):
            _, std, centered = row_mean_std(r[rows])
        if np.isfinite(std).all() and np.isfinite(centered).all():
            out[rows] = centered / (std + eps)[:, None]
            continue
        for members in stacked:  # some group overflowed: each group of this size on its own
            out[members] = zscore(r[members].tolist(), eps)[0]
    return out.tolist()


def aggregate(
    components: Mapping[str, Sequence[float] | npt.NDArray[np.float64]],
    params: RewardParams,
    *,
    normalize: bool,
    groups: Sequence[str] | None,
) -> Aggregate:
    """``R_final = Σ_k w_k · R̃_k`` (or ``Σ_k w_k · R_k`` without normalization), per item.

    ``components`` maps each component of the recipe to its values in item order (lists or
    arrays); ``groups`` (one id per item, or ``None``) adds group-relative advantages. Raises
    :class:`NonFiniteRewardError` rather than return a value that is not finite.
    """
    keys = list(components)
    x = np.array(list(components.values()), dtype=np.float64)
    n = x.shape[1] if x.ndim == 2 else 0
    z: npt.NDArray[np.float64]
    together = _zscores(x, params.eps)
    if together is None:  # some value or statistic is not finite: component by component
        rows = [zscore(values, params.eps) for values in x]
        z = np.array([r[0] for r in rows], np.float64).reshape(x.shape)
        mu = np.array([r[1] for r in rows], np.float64)
        sigma = np.array([r[2] for r in rows], np.float64)
    else:
        z, mu, sigma = together
    chosen = z if normalize else x
    total = np.zeros(n, dtype=np.float64)
    # Extreme weights may overflow to inf, rejected below with the parameters named; numpy's
    # warning would only be noise in the server log.
    with np.errstate(over="ignore", invalid="ignore"):
        for k, key in enumerate(keys):
            total += params.weights.of(key) * chosen[k]  # type: ignore[arg-type]
    rewards = total.tolist()
    advantages = group_advantages(rewards, groups, params.eps) if groups is not None else None
    finite = all(np.isfinite(a).all() for a in (total, x, z, mu, sigma))
    if not finite or (advantages is not None and not np.isfinite(advantages).all()):
        raise NonFiniteRewardError()
    return Aggregate(
        rewards,
        dict(zip(keys, z.tolist(), strict=True)),
        dict(zip(keys, mu.tolist(), strict=True)),
        dict(zip(keys, sigma.tolist(), strict=True)),
        advantages,
    )
