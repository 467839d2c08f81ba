"""The per-completion reward components of SPEC §4 (the paper's Sec. 3 and App. B–C).

Each function is one row of the SPEC's table; they take plain numbers so that a reader can hold
them against the equations. :data:`COMPONENTS` is that table as data: per component, how it is
computed from an analysed item, whether it needs the encoder, its formula and its inputs (for
explanations). Scoring, explanations and the recipe registry read only the table, so adding a
component is a function, a row, and its parameters (a weight in :class:`Weights`, any constant in
:class:`RewardParams`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from reward_server.core.params import ComponentKey, RewardParams
from reward_server.core.parsing import ParsedCompletion


def outcome_correctness(correct: bool, p: RewardParams) -> float:
    """``R_oc = λ_oc · correct(a)``.

    >>> outcome_correctness(True, RewardParams(lambda_oc=2.0))
    2.0
    """
    return p.lambda_oc * float(correct)


def reasoning_exploitation(strategy_correct: bool, p: RewardParams) -> float:
    """``R_re = λ_re · χ(a)``: some strategy outcome is correct (SPEC §7, first point)."""
    return p.lambda_re * float(strategy_correct)


def format_adherence(n_strat: int, has_final: bool, p: RewardParams) -> float:
    """``R_fa = min(1, γ_s · n_strat) + γ_a · final + γ_c · complete``.

    >>> round(format_adherence(3, True, RewardParams()), 10)
    1.0
    >>> format_adherence(0, True, RewardParams())
    0.3
    """
    complete = n_strat > 0 and has_final
    return (
        min(1.0, p.gamma_strategies * n_strat)
        + p.gamma_answer * float(has_final)
        + p.gamma_complete * float(complete)
    )


def _explore_or_collapse(strategy_correct: bool, exploration: float, p: RewardParams) -> float:
    """``α · χ + (1 − χ) · min(β, ρ · exploration)``: explore until a strategy is right."""
    if strategy_correct:
        return p.collapse_bonus
    return min(p.explore_cap, p.explore_rate * exploration)


def semantic_exploration(strategy_correct: bool, gain: float, p: RewardParams) -> float:
    """``R_sd = α · χ + (1 − χ) · min(β, ρ · g(H))`` with ``g = Uniq · Div``.

    >>> p = RewardParams()
    >>> semantic_exploration(False, 2.0, p), semantic_exploration(True, 0.0, p)
    (0.2, 1.0)
    """
    return _explore_or_collapse(strategy_correct, gain, p)


def count_exploration(strategy_correct: bool, n_strat: int, p: RewardParams) -> float:
    """``R_rd = α · χ + (1 − χ) · min(β, ρ · n_strat)`` (GRPO-CFEE).

    >>> count_exploration(False, 9, RewardParams())
    0.5
    """
    return _explore_or_collapse(strategy_correct, float(n_strat), p)


def length_penalty(length: int, p: RewardParams) -> float:
    """``R_len = −min(1, max(0, ℓ − target) / target)`` (GRPO-CFL).

    Integers may be arbitrarily large (JSON allows it), so the cap is decided on the exact
    integers before any division could overflow a float.

    >>> length_penalty(768, RewardParams()), length_penalty(100, RewardParams())
    (-0.5, -0.0)
    >>> length_penalty(10**400, RewardParams())
    -1.0
    """
    excess = max(0, length - p.length_target)
    if excess >= p.length_target:
        return -1.0
    return -(excess / p.length_target)


class ItemFacts(Protocol):
    """What a component reads of one analysed item (``scoring.ItemAnalysis`` provides it)."""

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
    #: The value from an analysed item, ``g(H)`` (NaN when the item's geometry was not needed,
    #: which only a component that does not need embeddings may see) and the parameters.
    value: Callable[[ItemFacts, float, RewardParams], float]
    #: What the value was computed from, by parameter or quantity name (for explanations).
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
            lambda a, g, p: outcome_correctness(a.correct, p),
            lambda a, g, p: {"lambda_oc": p.lambda_oc, "correct": a.correct},
        ),
        Component(
            "re",
            "reasoning exploitation",
            False,
            "lambda_re · chi",
            lambda a, g, p: reasoning_exploitation(a.strategy_correct, p),
            lambda a, g, p: {"lambda_re": p.lambda_re, "chi": a.strategy_correct},
        ),
        Component(
            "fa",
            "format adherence",
            False,
            "min(1, gamma_strategies · n_strat) + gamma_answer · final + gamma_complete · complete",
            lambda a, g, p: format_adherence(
                a.parsed.n_strat, a.parsed.final_answer is not None, p
            ),
            lambda a, g, p: _fa_inputs(a, p),
        ),
        Component(
            "sd",
            "semantic exploration",
            True,
            "collapse_bonus · chi + (1 − chi) · min(explore_cap, explore_rate · g)",
            lambda a, g, p: semantic_exploration(a.strategy_correct, g, p),
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
            lambda a, g, p: count_exploration(a.strategy_correct, a.parsed.n_strat, p),
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
            lambda a, g, p: length_penalty(a.length, p),
            lambda a, g, p: {"length": a.length, "length_target": p.length_target},
        ),
    )
}
