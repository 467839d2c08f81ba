"""``POST /v1/explain`` and the inspector page (``GET /inspect``) of the HTTP front end.

``/v1/explain`` goes through exactly the path ``/v1/score`` takes (the same body model, limits,
auth, admission and error statuses: :func:`~reward_server.service.http_scoring.run_scoring`)
with the explanation switched on, so its numbers are those of ``/v1/score`` with diagnostics on,
given the same embeddings. An embedding the cache does not hold is computed in whatever batch
the encoder makes of the moment's texts (the explanation embeds every item's strategies, the
reward only those of items with ``χ = 0``), and a text's embedding moves with its batch's
padding by a few 1e-8: two requests may then differ in the last digits (1e-9 on a reward here).

The inspector is three static files shipped inside the package (no CDN, no network: the page's
Content-Security-Policy allows only this server) that call ``/v1/explain`` from the browser.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from reward_server.service.http_scoring import (
    SCORE_DOC,
    FastJSONResponse,
    parse_score,
    run_scoring,
    scored_response,
)
from reward_server.service.schemas import ExplainResponse

router = APIRouter()
#: The inspector's files and their media types (nothing else is served from the folder).
INSPECTOR_FILES = {
    "index.html": "text/html; charset=utf-8",
    "inspector.css": "text/css; charset=utf-8",
    "inspector.js": "text/javascript; charset=utf-8",
}
#: Only this server, no inline script, no other origin: the page works offline by design.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def inspector_file(name: str) -> bytes:
    """One of the inspector's static files, read from the installed package."""
    return (resources.files("reward_server.service") / "inspector" / name).read_bytes()


@router.post(
    "/v1/explain",
    operation_id="explain",
    response_model=ExplainResponse,
    summary="Why each completion got its reward (same body and auth as /v1/score)",
    **SCORE_DOC,
)
async def explain(request: Request) -> Response:
    """Why each item got its reward (same body, limits and auth as ``/v1/score``)."""
    scored = await run_scoring(request, parse_score, explain=True)
    content = {**scored.as_dict(), "explanation": scored.explanation}
    return scored_response(request, scored, content, FastJSONResponse)


@router.get("/inspect", include_in_schema=False)
async def inspect() -> Response:
    return _static("index.html")


@router.get("/inspect/{name}", include_in_schema=False)
async def inspect_asset(name: str) -> Response:
    if name not in INSPECTOR_FILES or name == "index.html":
        return JSONResponse({"detail": "not found"}, status_code=404)
    return _static(name)


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    # Under the prefix a proxy mounts the app at (Ray's route_prefix), as the page's own links.
    return RedirectResponse(request.scope.get("root_path", "") + "/inspect", status_code=307)


def _static(name: str) -> Response:
    return Response(
        inspector_file(name),
        media_type=INSPECTOR_FILES[name],
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )
