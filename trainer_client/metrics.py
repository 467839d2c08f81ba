"""The paper's evaluation metrics (Sec. 4.4, Table 1) from scored completions.

Kept free of torch and of I/O so it is easy to test and reuse: ACC with its 95% interval
(normal, as the paper's tables, or Wilson), S-ACC, #STR (mean valid strategies), #TOK (mean
completion tokens under the policy's tokenizer), Words, and the mean number of semantically
distinct strategies (Uniq at the server's δ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trainer_client.results import ItemDiagnostics

Z95 = 1.959963984540054


def normal_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The normal (Wald) interval for a binomial proportion (fractions in [0, 1]): the paper's
    Table 1 intervals are these (SD-E² on Qwen, 1082 of 1319: [79.96, 84.10]).

    >>> [round(100 * x, 2) for x in normal_interval(1082, 1319)]
    [79.96, 84.1]
    """
    if n <= 0:
        return (0.0, 0.0)
    p = successes / n
    half = z * math.sqrt(p * (1 - p) / n)
    return (max(0.0, p - half), min(1.0, p + half))


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (as fractions in [0, 1]).

    Better than the normal interval for small evaluation sets and accuracies near 0 or 1
    (``sde2-eval --ci wilson``); the paper's tables use the normal one.

    >>> [round(x, 4) for x in wilson_interval(8, 10)]
    [0.4902, 0.9433]
    """
    if n <= 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, center - half), min(1.0, center + half))


@dataclass(frozen=True)
class RunMetrics:
    """One row of Table 1 (percentages in 0..100)."""

    method: str
    n: int
    correct: int
    acc: float
    ci_low: float
    ci_high: float
    s_acc: float
    n_str: float
    tokens: float | None
    words: float
    uniq: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def distinct_strategies(item: ItemDiagnostics) -> int:
    """Uniq of one completion: the server's value, exact 0/1 without strategies to compare."""
    if item.uniq is not None:
        return item.uniq
    if item.n_strat <= 1:
        return item.n_strat
    raise ValueError(
        "uniq missing for a completion with several strategies: score with diagnostics"
    )


#: ACC's 95% interval by name (``sde2-eval --ci``): the paper's, first, is the default.
INTERVALS: dict[str, Callable[[int, int], tuple[float, float]]] = {
    "normal": normal_interval,
    "wilson": wilson_interval,
}


def summarize(
    method: str,
    items: Sequence[ItemDiagnostics],
    completions: Sequence[str],
    token_counts: Sequence[int] | None,
    interval: str = "normal",
) -> RunMetrics:
    """Table 1 metrics of one run from per-item diagnostics (scored with ``diagnostics=true``),
    ACC's 95% interval of the kind ``interval`` names (:data:`INTERVALS`)."""
    n = len(items)
    if n == 0 or len(completions) != n or (token_counts is not None and len(token_counts) != n):
        raise ValueError("need one completion (and token count) per scored item")
    correct = sum(it.correct for it in items)
    low, high = INTERVALS[interval](correct, n)
    return RunMetrics(
        method=method,
        n=n,
        correct=correct,
        acc=100.0 * correct / n,
        ci_low=100.0 * low,
        ci_high=100.0 * high,
        s_acc=100.0 * sum(it.strategy_correct for it in items) / n,
        n_str=sum(it.n_strat for it in items) / n,
        tokens=None if token_counts is None else sum(token_counts) / n,
        words=sum(len(c.split()) for c in completions) / n,
        uniq=sum(distinct_strategies(it) for it in items) / n,
    )


def markdown_table(rows: Sequence[RunMetrics]) -> str:
    """Table 1's columns as a Markdown table."""
    head = "| Method | N | ACC (%) | 95% CI | S-ACC (%) | #STR | #TOK | Words | Uniq |"
    sep = "|---|---:|---:|---|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        tokens = "-" if r.tokens is None else f"{r.tokens:.2f}"
        lines.append(
            f"| {r.method} | {r.n} | {r.acc:.2f} | [{r.ci_low:.2f}, {r.ci_high:.2f}] | "
            f"{r.s_acc:.2f} | {r.n_str:.2f} | {tokens} | {r.words:.2f} | {r.uniq:.2f} |"
        )
    return "\n".join(lines)
