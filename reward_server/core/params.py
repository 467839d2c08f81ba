"""Reward parameters: one validated, typed object with the SPEC §4 defaults and ranges.

A pydantic model rather than a plain dataclass so that the HTTP schema, the OpenAPI document and
the core all share one definition of every constraint; a bad value is rejected with its name.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

#: Reward components, by their wire keys (SPEC §4); the rows of
#: :data:`reward_server.core.components.COMPONENTS` and the fields of :class:`Weights` (a test
#: checks all three agree). Recipes are in :mod:`reward_server.core.recipes`.
ComponentKey = Literal["oc", "re", "fa", "sd", "rd", "len"]
#: Answer matchers (SPEC §2).
AnswerType = Literal["numeric", "choice", "exact", "math"]
ANSWER_TYPES: tuple[AnswerType, ...] = get_args(AnswerType)


class Weights(BaseModel):
    """Aggregation weights ``w_k`` of SPEC §5 (ablations set some to 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    oc: float = Field(1.0, allow_inf_nan=False, description="weight of outcome correctness")
    re: float = Field(1.0, allow_inf_nan=False, description="weight of reasoning exploitation")
    fa: float = Field(1.0, allow_inf_nan=False, description="weight of format adherence")
    sd: float = Field(1.0, allow_inf_nan=False, description="weight of semantic exploration")
    rd: float = Field(1.0, allow_inf_nan=False, description="weight of count exploration")
    len: float = Field(1.0, allow_inf_nan=False, description="weight of the length term")

    def of(self, key: ComponentKey) -> float:
        """The weight of component ``key``."""
        return float(getattr(self, key))


class RewardParams(BaseModel):
    """Every tunable constant of the reward, with SPEC §4 defaults and ranges."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    lambda_oc: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="scale of outcome correctness R_oc"
    )
    lambda_re: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="scale of reasoning exploitation R_re"
    )
    gamma_strategies: float = Field(
        0.2,
        ge=0.0,
        allow_inf_nan=False,
        description="format reward per valid strategy (capped at 1)",
    )
    gamma_answer: float = Field(
        0.3, ge=0.0, allow_inf_nan=False, description="format reward for a final answer"
    )
    gamma_complete: float = Field(
        0.1,
        ge=0.0,
        allow_inf_nan=False,
        description="format reward for strategies and a final answer together",
    )
    collapse_bonus: float = Field(
        1.0,
        ge=0.0,
        allow_inf_nan=False,
        description="alpha: exploration reward once a strategy is correct",
    )
    explore_cap: float = Field(
        0.5, ge=0.0, allow_inf_nan=False, description="beta: cap of the exploration reward"
    )
    explore_rate: float = Field(
        0.1,
        ge=0.0,
        allow_inf_nan=False,
        description="rho: exploration reward per unit of g(H) or per strategy",
    )
    similarity_threshold: float = Field(
        0.80,
        gt=-1.0,
        lt=1.0,
        allow_inf_nan=False,
        description="delta: a strategy is unique iff its cosine to every kept one is <= delta",
    )
    length_target: int = Field(512, ge=1, description="token budget of the length term (GRPO-CFL)")
    weights: Weights = Field(default_factory=Weights, description="aggregation weights w_k")
    eps: float = Field(
        1e-6, gt=0.0, le=1.0, allow_inf_nan=False, description="normalization epsilon"
    )
    max_strategies: int = Field(32, ge=1, le=256, description="strategy blocks kept per completion")
