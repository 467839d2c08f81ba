"""``POST /v1/explain`` and the inspector page (``GET /inspect``) of the HTTP front end.

``/v1/explain`` goes through exactly the path ``/v1/score`` takes (the same body model, limits,
auth, admission and error statuses: ``run_scoring`` of
:func:`~reward_server.service.http_app.create_app`) with the explanation switched on, so its
numbers are those of ``/v1/score``.

The inspector is three static files shipped inside the package (no CDN, no network: the page's
Content-Security-Policy allows only this server) that call ``/v1/explain`` from the browser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from reward_server.service.metrics import Metrics
from reward_server.service.pipeline import Scored
from reward_server.service.schemas import ExplainResponse, ScoreRequest

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

RunScoring = Callable[..., Awaitable[tuple[Scored | None, Response | None]]]


def inspector_file(name: str) -> bytes:
    """One of the inspector's static files, read from the installed package."""
    return (resources.files("reward_server.service") / "inspector" / name).read_bytes()


def install_explain_routes(
    app: FastAPI,
    *,
    run_scoring: RunScoring,
    timing_headers: Callable[[Scored], dict[str, str]],
    parse_score: Callable[[bytes], ScoreRequest],
    metrics: Metrics,
    doc: dict[str, Any],
) -> None:
    """Add ``POST /v1/explain``, ``GET /inspect`` (+ its two assets) and ``GET /`` to ``app``.

    ``doc`` is ``/v1/score``'s route description (its auth dependency, errors, body schema).
    """

    @app.post(
        "/v1/explain",
        operation_id="explain",
        **{
            **doc,
            "response_model": ExplainResponse,
            "summary": "Why each completion got its reward (same body and auth as /v1/score)",
        },
    )
    async def explain(request: Request) -> Response:
        """Why each item got its reward (same body, limits and auth as ``/v1/score``)."""
        route = request.url.path
        scored, failure = await run_scoring(request, route, parse_score, explain=True)
        if failure is not None:
            return failure
        assert scored is not None
        metrics.requests.labels(route, "200").inc()
        body = {**scored.as_dict(), "explanation": scored.explanation}
        return JSONResponse(body, headers=timing_headers(scored))

    @app.get("/inspect", include_in_schema=False)
    async def inspect() -> Response:
        return _static("index.html")

    @app.get("/inspect/{name}", include_in_schema=False)
    async def inspect_asset(name: str) -> Response:
        if name not in INSPECTOR_FILES or name == "index.html":
            return JSONResponse({"detail": "not found"}, status_code=404)
        return _static(name)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/inspect", status_code=307)


def _static(name: str) -> Response:
    return Response(
        inspector_file(name),
        media_type=INSPECTOR_FILES[name],
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )
