"""The HTTP front end (FastAPI): an app factory over one :class:`ScoringService`.

The routes live in modules by purpose: :mod:`~reward_server.service.score_routes` (SPEC §6),
:mod:`~reward_server.service.openrlhf_routes` (OpenRLHF's ``/get_reward``),
:mod:`~reward_server.service.explain_routes` (``/v1/explain`` and the inspector) and
:mod:`~reward_server.service.ops_routes` (health, readiness, info, metrics, OpenAPI). What they
share (bounded body read, the call into the service) is :mod:`~reward_server.service.http_scoring`.

Every failure is a :class:`~reward_server.service.errors.ServiceError` raised by the service (or
by the body read) and converted here once, by one exception handler: its status, ``{"detail":
...}`` and headers, counted under its reason. Status codes (matching text-embeddings-inference
where it has one): 401 missing/wrong key, 408 body not received within ``--body-timeout``, 413
body too large, 422 invalid input (with each field's path), 429 at capacity (Retry-After), 503
deadline passed or model not ready. Bad input never yields a 500. A client that disconnects
mid-upload is counted as status 499 (nginx's "client closed request"; nobody receives it)
instead of logging a traceback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from reward_server import __version__
from reward_server.service import explain_routes, openrlhf_routes, ops_routes, score_routes
from reward_server.service.credentials import one_credential
from reward_server.service.errors import RequestInvalid, ServiceError, Unauthorized, issue
from reward_server.service.http_scoring import answer_service_error, service_of
from reward_server.service.pipeline import ScoringService


async def _query_invalid(request: Request, exc: Exception) -> Response:
    """FastAPI's own validation (query parameters): the same 422 as the service's, after the
    key check as there (FastAPI validates before the route runs: without the key, a client
    learnt which values the server reads)."""
    assert isinstance(exc, RequestValidationError)
    issues = [
        issue(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
        for e in exc.errors()
    ]
    refusal: ServiceError = RequestInvalid(issues)
    try:
        service_of(request).authorize(one_credential(request.headers.getlist("authorization")))
    except Unauthorized as unauthorized:
        refusal = unauthorized
    return await answer_service_error(request, refusal)


def create_app(service: ScoringService) -> FastAPI:
    """The app for ``service``; the lifespan starts loading the model (the server drains on
    shutdown, see :mod:`~reward_server.service.serve`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield

    app = FastAPI(
        title="sde2 reward server",
        version=__version__,
        description="SD-E² rewards (semantic exploration) for GRPO training; see SPEC §6.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.add_exception_handler(ServiceError, answer_service_error)
    app.add_exception_handler(RequestValidationError, _query_invalid)
    for module in (score_routes, openrlhf_routes, explain_routes, ops_routes):
        app.include_router(module.router)
    ops_routes.install_openapi(app)
    return app


__all__ = ["create_app"]
