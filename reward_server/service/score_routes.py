"""``POST /v1/score`` (SPEC §6) and its alias ``POST /score``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from reward_server.service.http_scoring import (
    SCORE_DOC,
    FastJSONResponse,
    parse_score,
    run_scoring,
    scored_response,
)
from reward_server.service.schemas import ScoreResponse

router = APIRouter()


async def score(request: Request) -> Response:
    """Score one batch of completions."""
    scored = await run_scoring(request, parse_score)
    return scored_response(request, scored, scored.as_dict(), FastJSONResponse)


_DOC = {**SCORE_DOC, "response_model": ScoreResponse}
_SUMMARY = "Score a batch of completions (SPEC §6)"
router.post("/v1/score", operation_id="score", summary=_SUMMARY, **_DOC)(score)
router.post("/score", operation_id="score_alias", summary=_SUMMARY, **_DOC)(score)
