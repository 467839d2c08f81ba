"""The per-completion reward components of SPEC §4 (the paper's Sec. 3 and App. B–C).

Each function is one row of the SPEC's table; they take plain numbers so that a reader can hold
them against the equations.
"""

from __future__ import annotations

from reward_server.core.params import RewardParams


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
