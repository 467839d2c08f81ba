"""The pure SD-E² reward core: parsing, answers, geometry, components, recipes, normalization.

No I/O and no globals but one, the recipe registry (:mod:`reward_server.core.recipes` says why):
every function takes what it needs and returns a value. The encoder is passed in (see
:class:`reward_server.encoders.base.Encoder`).
"""

from reward_server.core.normalization import (
    Aggregate,
    NonFiniteRewardError,
    aggregate,
    group_advantages,
    zscore,
)
from reward_server.core.params import (
    ANSWER_TYPES,
    AnswerType,
    ComponentKey,
    RewardParams,
    Weights,
)
from reward_server.core.recipes import RECIPES, Recipe, RecipeSpec
from reward_server.core.scoring import (
    BatchScore,
    BatchWarning,
    InvalidBatch,
    ItemResult,
    PreparedBatch,
    ScoreItem,
    finish_batch,
    prepare_batch,
    score_batch,
)

__all__ = [
    "ANSWER_TYPES",
    "RECIPES",
    "Aggregate",
    "AnswerType",
    "BatchScore",
    "BatchWarning",
    "ComponentKey",
    "InvalidBatch",
    "ItemResult",
    "NonFiniteRewardError",
    "PreparedBatch",
    "Recipe",
    "RecipeSpec",
    "RewardParams",
    "ScoreItem",
    "Weights",
    "aggregate",
    "finish_batch",
    "group_advantages",
    "prepare_batch",
    "score_batch",
    "zscore",
]
