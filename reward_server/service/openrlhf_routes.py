"""``POST /get_reward``: OpenRLHF's remote reward protocol over the same scoring path.

A request's samples become SPEC §6 items (:func:`openrlhf_items`), so limits, admission and
errors are those of ``/v1/score``; a path inside those items is mapped back to the OpenRLHF
field it came from (:func:`openrlhf_loc`), so a 422 names ``query.3`` rather than an ``items``
path the caller never sent.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from reward_server.core import AnswerType, Recipe, ScoreItem
from reward_server.core.answers import gold_text
from reward_server.service.errors import MAX_ISSUES, Loc, RequestInvalid, ServiceError, issue
from reward_server.service.http_scoring import (
    ERROR_RESPONSES,
    run_scoring,
    scored_response,
    validated,
)
from reward_server.service.schemas import (
    OpenRLHFRequest,
    OpenRLHFResponse,
    ScoreRequest,
)

log = logging.getLogger(__name__)
router = APIRouter()

#: How OpenRLHF 0.11.2 is told which dataset column holds the gold answer.
LABEL_FLAG = "--data.label_key (--label_key before OpenRLHF 0.10.2)"
#: Which OpenRLHF field each item text comes from (the OpenAPI limits are derived from it too).
ITEM_SOURCES = {"completion": "query", "answer": "labels", "prompt": "prompts"}


def openrlhf_loc(loc: Loc) -> Loc:
    """Map a path inside the derived ``items`` back to the OpenRLHF request's own fields.

    >>> openrlhf_loc(("items", 2, "answer")), openrlhf_loc(("items",))
    (('labels', 2), ('query',))
    """
    if loc[:1] != ("items",):
        return loc
    if len(loc) == 1:  # the batch as a whole (e.g. too many samples)
        return ("query",)
    if len(loc) >= 3 and isinstance(loc[1], int):
        field = ITEM_SOURCES.get(str(loc[2]))
        if field:
            return (field, loc[1])
    return loc


def openrlhf_items(request: OpenRLHFRequest) -> list[ScoreItem]:
    """One item per sample: completion = what follows the prompt in the query, answer = label.

    The prompt is looked for, not only at the start: OpenRLHF decodes the query with special
    tokens kept, so padding or a BOS token can precede it. A query that does not contain its
    prompt is refused (422 naming ``prompts.i``) rather than scored whole: the prompt's own
    schema example would count as a strategy and as the final answer, a silently wrong reward.
    Numeric labels become their decimal text (:func:`gold_text`); an empty label is refused
    (422 naming ``labels.i`` and the OpenRLHF flag that sets the label column), since every
    answer would otherwise be scored wrong.

    >>> req = OpenRLHFRequest(query=["<pad>Q: 2+2? A: 4"], prompts=["Q: 2+2?"], labels=[4])
    >>> item = openrlhf_items(req)[0]
    >>> item.completion, item.answer
    (' A: 4', '4')
    """
    items: list[ScoreItem] = []
    issues: list[dict[str, Any]] = []
    rows = zip(request.query, request.prompts, request.labels, strict=True)
    for i, (query, prompt, label) in enumerate(rows):
        if len(issues) >= MAX_ISSUES:  # the answer stays smaller than the request
            break
        answer = gold_text(label)  # the schema let only strings and finite numbers through
        if not answer.strip():
            msg = (
                "empty gold answer: OpenRLHF sends an empty label when no label column is set; "
                f"pass {LABEL_FLAG} with the dataset column holding the answers"
            )
            issues.append(issue(("labels", i), msg, "empty_label"))
        start = query.find(prompt)
        if start < 0:
            msg = (
                f"does not occur in query[{i}]: the response cannot be separated from its prompt "
                "(OpenRLHF cuts a prompt longer than --data.max_len minus "
                "--rollout.max_new_tokens from the left, and sends it whole: raise "
                "--data.max_len, --max_len before OpenRLHF 0.10.2, or shorten the prompts)"
            )
            issues.append(issue(("prompts", i), msg, "prompt_not_in_query"))
        if not issues:
            items.append(ScoreItem(query[start + len(prompt) :], answer, prompt, None, None))
    if issues:
        raise RequestInvalid(issues)
    return items


def score_request(
    body: bytes, recipe: Recipe, answer_type: AnswerType, normalize: bool
) -> ScoreRequest | None:
    """The scoring request of an OpenRLHF body; None for empty lists (valid: nothing to score)."""
    req = validated(OpenRLHFRequest, body)
    n = len(req.query)
    for name in ("prompts", "labels"):
        if len(getattr(req, name)) != n:
            msg = f"must have as many entries as query ({n})"
            raise RequestInvalid.one((name,), msg, "length")
    if n == 0:
        return None
    items = openrlhf_items(req)
    return ScoreRequest(items=items, recipe=recipe, answer_type=answer_type, normalize=normalize)


#: The query parameters ``/get_reward`` reads (any other is refused: see ``run_scoring``).
QUERY = ("recipe", "answer_type", "normalize")

NORMALIZE_DOC = (
    "z-score components over this request's samples. Off by default: OpenRLHF (>= 0.9.1) sends "
    "one sample per request, and over one sample every normalized component is 0, so the "
    "reward would always be 0"
)


@router.post(
    "/get_reward",
    response_model=OpenRLHFResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={"x-sde2-body": "OpenRLHFRequest"},
    summary="OpenRLHF remote reward protocol",
)
async def get_reward(
    request: Request,
    recipe: Annotated[Recipe, Query(description="reward recipe")] = "sde2",
    answer_type: Annotated[AnswerType, Query(description="answer matcher")] = "numeric",
    normalize: Annotated[bool, Query(description=NORMALIZE_DOC)] = False,
) -> Response:
    """``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``.

    The completion is what follows the prompt in the query; labels are the gold answers
    (strings, or numbers as an OpenRLHF dataset holds them). ``scores`` is correctness
    (0/1), what OpenRLHF's dynamic filtering expects.
    Normalization is off unless asked for (see the ``normalize`` parameter). Empty lists
    are valid and give empty lists.
    """
    try:
        scored = await run_scoring(
            request,
            lambda body: score_request(body, recipe, answer_type, normalize),
            loc_map=openrlhf_loc,
            query=QUERY,
        )
    except ServiceError as exc:
        # OpenRLHF logs a failed reward call at info level only and trains on without the
        # sample's reward: say it here, where an operator looks.
        detail = str(exc.detail)[:500]
        log.warning(
            "/get_reward answered %d; OpenRLHF drops this sample's reward: %s",
            exc.http_status,
            detail,
        )
        raise
    s = scored.score
    extra: dict[str, list[float]] = {}
    if s.items:  # per-sample columns; none without samples
        extra = {k: list(v) for k, v in s.components.items()}
        extra["correct"] = [float(it.correct) for it in s.items]
        extra["strategy_correct"] = [float(it.strategy_correct) for it in s.items]
        extra["n_strat"] = [float(it.n_strat) for it in s.items]
    scores = extra.get("correct", [])
    return scored_response(
        request, scored, {"rewards": s.rewards, "scores": scores, "extra_logs": extra}
    )
