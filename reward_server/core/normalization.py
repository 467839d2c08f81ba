"""Batch normalization, weighted aggregation and group advantages (SPEC §5, paper App. A).

These functions are shared by the server and by the trainer client, which normalizes over a whole
batch after scoring shards of it on several replicas: the same code gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from reward_server.core.params import RewardParams


@dataclass(frozen=True)
class Aggregate:
    """The batch-level outputs of SPEC §5 for one request."""

    rewards: list[float]
    normalized: dict[str, list[float]]
    mean: dict[str, float]
    std: dict[str, float]
    advantages: list[float] | None


def zscore(values: Sequence[float], eps: float) -> tuple[list[float], float, float]:
    """``(R − μ)/(σ + eps)`` if ``σ > eps`` else ``R − μ``, with population ``σ``.

    Returns the normalized values with ``μ`` and ``σ``.

    >>> zscore([1.0, 3.0], 1e-6)[0]
    [-0.9999990000010001, 0.9999990000010001]
    >>> zscore([2.0, 2.0], 1e-6)
    ([0.0, 0.0], 2.0, 0.0)
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return [], 0.0, 0.0
    mu = float(np.mean(x))
    sigma = float(np.std(x))
    centered = x - mu
    out = centered / (sigma + eps) if sigma > eps else centered
    return out.tolist(), mu, sigma


def group_advantages(rewards: Sequence[float], groups: Sequence[str], eps: float) -> list[float]:
    """GRPO advantages ``Â = (R − μ_b)/(σ_b + eps)`` within each group (population ``σ``).

    >>> group_advantages([1.0, 0.0, 5.0], ["a", "a", "b"], 1e-6)
    [0.999998000004, -0.999998000004, 0.0]
    """
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    for members in index.values():
        values = r[members]
        out[members] = (values - values.mean()) / (values.std() + eps)
    return out.tolist()


def aggregate(
    components: Mapping[str, Sequence[float]],
    params: RewardParams,
    *,
    normalize: bool,
    groups: Sequence[str] | None,
) -> Aggregate:
    """``R_final = Σ_k w_k · R̃_k`` (or ``Σ_k w_k · R_k`` without normalization), per item.

    ``components`` maps each component of the recipe to its values in item order; ``groups``
    (one id per item, or ``None``) adds group-relative advantages.
    """
    n = len(next(iter(components.values()), []))
    total = np.zeros(n, dtype=np.float64)
    normalized: dict[str, list[float]] = {}
    mean: dict[str, float] = {}
    std: dict[str, float] = {}
    for key, values in components.items():
        z, mean[key], std[key] = zscore(values, params.eps)
        normalized[key] = z
        chosen = z if normalize else values
        total += params.weights.of(key) * np.asarray(chosen, dtype=np.float64)  # type: ignore[arg-type]
    rewards = total.tolist()
    advantages = group_advantages(rewards, groups, params.eps) if groups is not None else None
    return Aggregate(rewards, normalized, mean, std, advantages)
