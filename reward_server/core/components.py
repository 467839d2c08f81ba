"""The per-completion reward components of SPEC §4 (the paper's Sec. 3 and App. B–C).

Each function is one row of the SPEC's table; they take plain numbers so that a reader can hold
them against the equations, and take a batch's columns (numpy arrays, one entry per item) the
same way, so that scoring a batch is one expression per component rather than a Python call per
item. :data:`COMPONENTS` is that table as data: per component, how it is computed from a batch's
columns, whether it needs the encoder, its formula and its inputs (for explanations). Scoring,
explanations and the recipe registry read only the table, so adding a component is a function,
a row, and its parameters (a weight in :class:`Weights`, any constant in :class:`RewardParams`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from reward_server.core.params import ComponentKey, RewardParams
from reward_server.core.parsing import ParsedCompletion

#: A batch's values of a component (float64, one per item).
Values = npt.NDArray[np.float64]
#: Each SPEC function takes one item's numbers or a batch's columns (numpy arrays) alike, and
#: gives a number or a column back: the same expression, so both agree bit for bit.
Flag = Any  # bool | npt.NDArray[np.bool_]
Count = Any  # int | npt.NDArray[np.int64]
Number = Any  # float | Values


def outcome_correctness(correct: Flag, p: RewardParams) -> Number:
    """``R_oc = λ_oc · correct(a)``.

    >>> outcome_correctness(True, RewardParams(lambda_oc=2.0))
    2.0
    >>> outcome_correctness(np.array([True, False]), RewardParams()).tolist()
    [1.0, 0.0]
    """
    return p.lambda_oc * correct


def reasoning_exploitation(strategy_correct: Flag, p: RewardParams) -> Number:
    """``R_re = λ_re · χ(a)``: some strategy outcome is correct (SPEC §7, first point)."""
    return p.lambda_re * strategy_correct


def format_adherence(n_strat: Count, has_final: Flag, p: RewardParams) -> Number:
    """``R_fa = min(1, γ_s · n_strat) + γ_a · final + γ_c · complete``.

    >>> round(float(format_adherence(3, True, RewardParams())), 10)
    1.0
    >>> format_adherence(np.array([0, 1]), np.array([True, False]), RewardParams()).tolist()
    [0.3, 0.2]
    """
    complete = (n_strat > 0) & has_final
    return (
        np.minimum(1.0, p.gamma_strategies * n_strat)
        + p.gamma_answer * has_final
        + p.gamma_complete * complete
    )


def _explore_or_collapse(strategy_correct: Flag, exploration: Number, p: RewardParams) -> Number:
    """``α · χ + (1 − χ) · min(β, ρ · exploration)``: explore until a strategy is right. An
    item with ``χ = 1`` takes ``α`` whatever its ``exploration`` (NaN where it was not
    computed)."""
    explored = np.minimum(p.explore_cap, p.explore_rate * exploration)
    return _scalar_if_0d(np.where(strategy_correct, p.collapse_bonus, explored))


def semantic_exploration(strategy_correct: Flag, gain: Number, p: RewardParams) -> Number:
    """``R_sd = α · χ + (1 − χ) · min(β, ρ · g(H))`` with ``g = Uniq · Div``.

    >>> p = RewardParams()
    >>> float(semantic_exploration(False, 2.0, p)), float(semantic_exploration(True, 0.0, p))
    (0.2, 1.0)
    """
    return _explore_or_collapse(strategy_correct, gain, p)


def count_exploration(strategy_correct: Flag, n_strat: Count, p: RewardParams) -> Number:
    """``R_rd = α · χ + (1 − χ) · min(β, ρ · n_strat)`` (GRPO-CFEE).

    >>> float(count_exploration(False, 9, RewardParams()))
    0.5
    """
    return _explore_or_collapse(strategy_correct, n_strat, p)


def length_penalty(length: int, p: RewardParams) -> float:
    """``R_len = −min(1, max(0, ℓ − target) / target)`` (GRPO-CFL).

    One item at a time, on Python integers: they may be arbitrarily large (JSON allows it),
    so the cap is decided on the exact integers before any division could overflow a float.

    >>> length_penalty(768, RewardParams()), length_penalty(100, RewardParams())
    (-0.5, 0.0)
    >>> length_penalty(10**400, RewardParams())
    -1.0
    """
    excess = max(0, length - p.length_target)
    if excess >= p.length_target:
        return -1.0
    return 0.0 - excess / p.length_target  # no penalty is 0.0, not the -0.0 JSON would show


def _scalar_if_0d(values: Values) -> Number:
    """``np.where`` of plain numbers gives a 0-d array: the number itself instead."""
    return values if values.ndim else values[()]


class ItemFacts(Protocol):
    """What a component's explanation reads of one analysed item (``scoring.ItemAnalysis``)."""

    @property
    def parsed(self) -> ParsedCompletion:
        """The parsed completion: its kept strategies and its final answer."""

    @property
    def correct(self) -> bool:
        """``correct(a)``: the final answer matches the gold."""

    @property
    def strategy_correct(self) -> bool:
        """``χ(a)``: some strategy outcome matches the gold."""

    @property
    def length(self) -> int:
        """``ℓ``: the completion's length in tokens (or words)."""


class BatchFacts(Protocol):
    """What a component reads of a batch, one entry per item (``scoring.BatchColumns``)."""

    @property
    def n_strat(self) -> npt.NDArray[np.int64]:
        """``n_strat(a)``."""

    @property
    def final(self) -> npt.NDArray[np.bool_]:
        """``final(a)``: a final answer was found."""

    @property
    def correct(self) -> npt.NDArray[np.bool_]:
        """``correct(a)``."""

    @property
    def strategy_correct(self) -> npt.NDArray[np.bool_]:
        """``χ(a)``."""

    @property
    def gain(self) -> Values:
        """``g(H)``; NaN where it was not needed (only a component that does not need
        embeddings, or an item with ``χ = 1``, may meet one)."""

    @property
    def lengths(self) -> Sequence[int]:
        """``ℓ`` per item (counted on first use: only the ``len`` component needs it)."""


@dataclass(frozen=True)
class Component:
    """One row of SPEC §4's table."""

    key: ComponentKey
    #: What it rewards, in words.
    title: str
    #: Whether it reads ``g(H)``: a recipe with such a component needs the encoder (SPEC §3).
    needs_embeddings: bool
    #: SPEC §4's formula, as explanations show it next to the inputs.
    formula: str
    #: The values of a batch (one per item, in order) from its columns and the parameters.
    value: Callable[[BatchFacts, RewardParams], Values]
    #: What an item's value was computed from, by parameter or quantity name (for
    #: explanations), from the analysed item, ``g(H)`` and the parameters.
    inputs: Callable[[ItemFacts, float, RewardParams], dict[str, Any]]


def _explore_inputs(a: ItemFacts, p: RewardParams) -> dict[str, Any]:
    return {
        "collapse_bonus": p.collapse_bonus,
        "explore_cap": p.explore_cap,
        "explore_rate": p.explore_rate,
        "chi": a.strategy_correct,
    }


def _fa_inputs(a: ItemFacts, p: RewardParams) -> dict[str, Any]:
    m = a.parsed.n_strat
    final = a.parsed.final_answer is not None
    return {
        "gamma_strategies": p.gamma_strategies,
        "n_strat": m,
        "gamma_answer": p.gamma_answer,
        "final": final,
        "gamma_complete": p.gamma_complete,
        "complete": m > 0 and final,
    }


#: SPEC §4's components by wire key, in the order of :class:`~reward_server.core.params.Weights`.
COMPONENTS: dict[ComponentKey, Component] = {
    c.key: c
    for c in (
        Component(
            "oc",
            "outcome correctness",
            False,
            "lambda_oc · correct",
            lambda f, p: outcome_correctness(f.correct, p),
            lambda a, g, p: {"lambda_oc": p.lambda_oc, "correct": a.correct},
        ),
        Component(
            "re",
            "reasoning exploitation",
            False,
            "lambda_re · chi",
            lambda f, p: reasoning_exploitation(f.strategy_correct, p),
            lambda a, g, p: {"lambda_re": p.lambda_re, "chi": a.strategy_correct},
        ),
        Component(
            "fa",
            "format adherence",
            False,
            "min(1, gamma_strategies · n_strat) + gamma_answer · final + gamma_complete · complete",
            lambda f, p: format_adherence(f.n_strat, f.final, p),
            lambda a, g, p: _fa_inputs(a, p),
        ),
        Component(
            "sd",
            "semantic exploration",
            True,
            "collapse_bonus · chi + (1 − chi) · min(explore_cap, explore_rate · g)",
            lambda f, p: semantic_exploration(f.strategy_correct, f.gain, p),
            lambda a, g, p: {
                **_explore_inputs(a, p),
                "g": g,
                "capped": not a.strategy_correct and p.explore_rate * g > p.explore_cap,
            },
        ),
        Component(
            "rd",
            "count exploration",
            False,
            "collapse_bonus · chi + (1 − chi) · min(explore_cap, explore_rate · n_strat)",
            lambda f, p: count_exploration(f.strategy_correct, f.n_strat, p),
            lambda a, g, p: {
                **_explore_inputs(a, p),
                "n_strat": a.parsed.n_strat,
                "capped": not a.strategy_correct
                and p.explore_rate * a.parsed.n_strat > p.explore_cap,
            },
        ),
        Component(
            "len",
            "length",
            False,
            "−min(1, max(0, length − length_target) / length_target)",
            lambda f, p: np.array([length_penalty(n, p) for n in f.lengths], np.float64),
            lambda a, g, p: {"length": a.length, "length_target": p.length_target},
        ),
    )
}
