"""Request and response models of the wire contract (SPEC §6) and of the OpenRLHF route.

The item and the reward parameters are the core's own models (:class:`ScoreItem`,
:class:`RewardParams`), so every constraint has one definition shared by HTTP, gRPC, the offline
scorer and the OpenAPI document. Everything is strict and forbids unknown fields: a wrong type is
a 422 naming the field, never silently coerced (``"1"`` is not the number 1).

Requests are validated from the raw JSON bytes (``model_validate_json``), not from ``json.loads``
output: pydantic's JSON parser rejects lone surrogates (``"\\ud800"``) as invalid JSON, which
keeps unencodable strings out of the tokenizer and out of the response (the 422 names the
string's field: :func:`~reward_server.service.http_scoring.validated`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from reward_server.core import AnswerType, Recipe, RewardParams, ScoreItem

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class ScoreRequest(BaseModel):
    """``POST /v1/score``: one batch; normalization and advantages are computed over it."""

    model_config = _STRICT

    items: list[ScoreItem] = Field(
        description="completions to score with their gold answers; normalization (SPEC §5) "
        "runs over these items, so send a whole GRPO step per request"
    )
    # No description here: the Recipe type's schema lists the registered recipes and their
    # components when the document is made (reward_server.core.recipes).
    recipe: Recipe = "sde2"
    answer_type: AnswerType = Field(
        "numeric", description="answer matcher: numeric, choice (A-E), exact or math"
    )
    params: RewardParams = Field(
        default_factory=RewardParams,
        description="reward parameters; omitted ones take the SPEC §4 defaults",
    )
    normalize: bool = Field(
        True,
        description="z-score each component over the batch before weighting (SPEC §5); "
        "with one item every normalized value is 0",
    )
    diagnostics: bool = Field(
        False, description="fill uniq and div for every item with at least one strategy"
    )


class ItemOut(BaseModel):
    """Per-item diagnostics (SPEC §6 ``items[]``)."""

    n_strat: int = Field(description="number of kept valid strategy blocks")
    final_answer: str | None = Field(description="field text of the final answer, or null")
    correct: bool = Field(description="the final answer matches the gold answer")
    strategy_correct: bool = Field(description="chi: some strategy outcome matches the gold")
    uniq: int | None = Field(description="Uniq(H; delta), when computed")
    div: float | None = Field(description="Div(H), when computed")


class BatchStats(BaseModel):
    """Per-component batch statistics used by the normalization."""

    mean: dict[str, float] = Field(description="mean of each component over the batch")
    std: dict[str, float] = Field(description="population std of each component over the batch")


class ScoreResponse(BaseModel):
    """``POST /v1/score`` response; every array is in item order."""

    rewards: list[float] = Field(description="R_final per item")
    components: dict[str, list[float]] = Field(description="raw component values per item")
    normalized: dict[str, list[float]] = Field(description="normalized component values")
    advantages: list[float] | None = Field(
        description="group-relative advantages when every item carries a group, else null"
    )
    items: list[ItemOut] = Field(description="per-item diagnostics")
    batch: BatchStats = Field(description="batch mean and std per component")
    recipe: Recipe = Field(description="the recipe used")
    params: RewardParams = Field(description="every effective parameter")
    encoder: str = Field(description="the sentence encoder that produced the embeddings")


class ExplainResponse(ScoreResponse):
    """``POST /v1/explain``: the ``/v1/score`` response (as with ``diagnostics`` on) plus why
    each item got its reward; see :mod:`reward_server.core.explain` for every field."""

    explanation: dict[str, Any] = Field(
        description="per item: the parse with offsets into the completion as sent, what was "
        "ignored and why, answers and their canonical forms, the cosines of H and the Uniq walk, "
        "each component with its inputs, the normalization and the reward"
    )


#: About 3,900 decimal digits: under Python's limit on int-to-text conversion (4,300 digits).
_MAX_LABEL_BITS = 13_000


def _check_label(value: Any) -> str | int | float:
    """One error per bad label (a plain union would report one per branch)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"must be a string or a finite number, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, not {value}")
    if isinstance(value, int) and value.bit_length() > _MAX_LABEL_BITS:
        raise ValueError("integer too long for a gold answer")
    return value


#: A gold answer as OpenRLHF sends it: the dataset's value as is (an int or float column stays a
#: number). ``bool`` is no number here, and NaN or infinity is no answer.
OpenRLHFLabel = Annotated[
    str | int | float,
    PlainValidator(_check_label),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": "\\S"},  # not empty or blank (see openrlhf_items)
                {"type": "integer"},
                {"type": "number"},
            ]
        }
    ),
]


class OpenRLHFRequest(BaseModel):
    """OpenRLHF's remote reward protocol (``--reward.remote_url``).

    ``query[i]`` is the prompt followed by the response; ``prompts[i]`` is that prompt and
    ``labels[i]`` the gold answer, a string or a number as the dataset holds it (see
    :func:`~reward_server.core.answers.gold_text`). The completion scored is what follows
    ``prompts[i]`` in ``query[i]`` (special tokens such as padding may precede it); a query
    that does not contain its prompt is refused with a 422 naming ``prompts.i``, and so is an
    empty label (``labels.i``: OpenRLHF sends ``""`` when no label key is set).
    """

    model_config = _STRICT

    query: list[str] = Field(description="prompt + response, one per sample")
    prompts: list[str] = Field(description="the prompt of each sample (it must occur in its query)")
    labels: list[OpenRLHFLabel] = Field(
        description="the gold answer of each sample: a non-empty string, or a finite number "
        "(written in plain decimal, then canonicalized like any answer)"
    )


class OpenRLHFResponse(BaseModel):
    """OpenRLHF's expected reply: ``rewards`` drive training, ``scores`` filter groups."""

    rewards: list[float] = Field(description="R_final per sample (unnormalized by default)")
    scores: list[float] = Field(
        description="correctness per sample, 0 or 1: OpenRLHF's dynamic filtering keeps a "
        "prompt whose mean score lies strictly inside --algo.dynamic_filtering_range"
    )
    extra_logs: dict[str, list[float]] = Field(
        description="raw components per sample, plus correct, strategy_correct and n_strat"
    )


class ValidationIssue(BaseModel):
    """One validation problem, FastAPI-style."""

    loc: list[str | int] = Field(description="path of the offending field, e.g. items.3.answer")
    field: str = Field(description="the path as one dotted string (items.3.answer; body: the body)")
    msg: str = Field(description="what is wrong")
    type: str = Field(description="machine-readable error type")


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer."""

    detail: list[ValidationIssue] | str = Field(description="the problem(s)")


class InfoResponse(BaseModel):
    """``GET /v1/info``."""

    encoder: str = Field(description="encoder name as reported in score responses")
    variant: str = Field(description="model variant (fp32, fp16, int8)")
    provider: str = Field(description="onnxruntime provider (cpu or cuda)")
    model_path: str | None = Field(description="folder the model was loaded from")
    version: str = Field(description="sde2 package version")
    defaults: dict[str, Any] = Field(description="default request fields and reward parameters")
    limits: dict[str, Any] = Field(description="server limits (items, characters, queue, ...)")


#: The request bodies by name (a ``ValidationError``'s ``title``), for the hint that names the
#: field an unknown one likely meant.
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m for m in (ScoreRequest, OpenRLHFRequest)
}
