"""The HTTP front end (FastAPI): SPEC §6 scoring, OpenRLHF's protocol, health, info, metrics.

Bodies are read and validated by hand (bounded read, then ``model_validate_json``) rather than by
FastAPI's body parameter, for three reasons: the size limit is enforced while reading (413 before
the whole body is buffered), pydantic's strict JSON parser rejects lone surrogates, and parsing
counts in the ``parse`` phase timing. The request models are still published in the OpenAPI
document (with the server's limits filled in), so clients and schemathesis see every field.

Status codes (matching text-embeddings-inference where it has one): 401 missing/wrong key,
408 body not received within ``--body-timeout``, 413 body too large, 422 invalid input (with each
field's path), 429 at capacity (Retry-After), 503 deadline passed or model not ready. Bad input
never yields a 500. A client that disconnects mid-upload is counted as status 499 (nginx's "client
closed request"; nobody receives it) instead of logging a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from reward_server import __version__
from reward_server.core import AnswerType, Recipe, ScoreItem
from reward_server.service.batcher import (
    DeadlineExceeded,
    EncoderFailed,
    Overloaded,
    ShuttingDown,
)
from reward_server.service.explain_routes import install_explain_routes
from reward_server.service.pipeline import (
    Loc,
    NotReady,
    RequestInvalid,
    Scored,
    ScoringService,
    issue,
)
from reward_server.service.schemas import (
    ErrorResponse,
    InfoResponse,
    OpenRLHFRequest,
    OpenRLHFResponse,
    ScoreRequest,
    ScoreResponse,
    label_text,
)

log = logging.getLogger(__name__)

TIMING_HEADERS = ("parse", "queue", "encode", "reward", "total")
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong bearer key"},
    408: {"model": ErrorResponse, "description": "body not received within the body timeout"},
    413: {"model": ErrorResponse, "description": "body larger than the server's limit"},
    422: {"model": ErrorResponse, "description": "invalid input; each issue names its field"},
    429: {"model": ErrorResponse, "description": "at capacity; retry after Retry-After seconds"},
    500: {"model": ErrorResponse, "description": "the encoder failed (never bad input)"},
    503: {"model": ErrorResponse, "description": "deadline passed, model loading or stopping"},
}


class BodyTooLarge(Exception):
    """The body exceeds ``max_body_bytes``."""


class BodyTimeout(Exception):
    """The body did not arrive within ``body_timeout`` seconds (a stalled or too slow upload)."""


class FastJSONResponse(JSONResponse):
    """A JSON response serialized by orjson: for a 64-completion step it takes a tenth of the
    standard library's time, a visible share of a step when the encoder costs little (GPU).
    Same compact JSON; scoring responses hold only finite floats (the scorer refuses others)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _error(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (before buffering it) anything over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _openrlhf_loc(loc: Loc) -> Loc:
    """Map a path inside the derived ``items`` back to the OpenRLHF request's own fields."""
    if loc[:1] != ("items",):
        return loc
    if len(loc) == 1:  # the batch as a whole (e.g. too many samples)
        return ("query",)
    if len(loc) >= 3 and isinstance(loc[1], int):
        field = {"completion": "query", "answer": "labels", "prompt": "prompts"}.get(str(loc[2]))
        if field:
            return (field, loc[1])
    return loc


#: How OpenRLHF 0.11.2 is told which dataset column holds the gold answer.
LABEL_FLAG = "--data.label_key (--label_key before OpenRLHF 0.10.2)"


def openrlhf_items(request: OpenRLHFRequest) -> list[ScoreItem]:
    """One item per sample: completion = what follows the prompt in the query, answer = label.

    The prompt is looked for, not only at the start: OpenRLHF decodes the query with special
    tokens kept, so padding or a BOS token can precede it. A query that does not contain its
    prompt is refused (422 naming ``prompts.i``) rather than scored whole: the prompt's own
    schema example would count as a strategy and as the final answer, a silently wrong reward.
    Numeric labels become their decimal text (:func:`label_text`); an empty label is refused
    (422 naming ``labels.i`` and the OpenRLHF flag that sets the label column), since every
    answer would otherwise be scored wrong.

    >>> req = OpenRLHFRequest(query=["<pad>Q: 2+2? A: 4"], prompts=["Q: 2+2?"], labels=[4])
    >>> item = openrlhf_items(req)[0]
    >>> item.completion, item.answer
    (' A: 4', '4')
    """
    items = []
    issues = []
    rows = zip(request.query, request.prompts, request.labels, strict=True)
    for i, (query, prompt, label) in enumerate(rows):
        answer = label_text(label)
        if not answer.strip():
            msg = (
                "empty gold answer: OpenRLHF sends an empty label when no label column is set; "
                f"pass {LABEL_FLAG} with the dataset column holding the answers"
            )
            issues.append(issue(("labels", i), msg, "empty_label"))
        start = query.find(prompt)
        if start < 0:
            msg = f"does not occur in query[{i}]: the response cannot be separated from its prompt"
            issues.append(issue(("prompts", i), msg, "prompt_not_in_query"))
        if not issues:
            items.append(ScoreItem(query[start + len(prompt) :], answer, prompt, None, None))
    if issues:
        raise RequestInvalid(issues)
    return items


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """``model``'s validation JSON schema, its ``$defs`` moved into OpenAPI components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    return schema


def create_app(service: ScoringService) -> FastAPI:
    """The app for ``service``; the lifespan starts loading the model and drains on shutdown."""
    settings = service.settings
    metrics = service.metrics

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

    def authorize(request: Request) -> None:
        """Bearer key check on scoring routes, in constant time (no timing oracle)."""
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"),
            settings.api_key.encode("utf-8", "surrogateescape"),
        )
        if not ok:
            raise _Unauthorized

    async def run_scoring(
        request: Request,
        route: str,
        parse_body: Callable[[bytes], Any],
        loc_map: Callable[[Loc], Loc] | None = None,
        explain: bool = False,
    ) -> tuple[Scored | None, Response | None]:
        """Read, score and translate failures to responses (one place for every status)."""
        body = b""
        resp: Response

        async def receive() -> None:  # only once admitted (see ScoringService.score)
            nonlocal body
            # Bounded in time too: a stalled upload holds its admission slot at most this long.
            try:
                body = await asyncio.wait_for(
                    read_body(request, settings.max_body_bytes), settings.body_timeout
                )
            except asyncio.TimeoutError:
                raise BodyTimeout from None

        try:
            scored = await service.score(
                lambda: parse_body(body), receive=receive, loc_map=loc_map, explain=explain
            )
            return scored, None
        except BodyTooLarge:
            reason, resp = (
                "body_too_large",
                _error(413, f"request body larger than {settings.max_body_bytes} bytes"),
            )
        except BodyTimeout:
            reason, resp = (
                "body_timeout",
                _error(
                    408,
                    f"request body not received within {settings.body_timeout:g} s "
                    "(--body-timeout)",
                    headers={"Connection": "close"},
                ),
            )
        except ClientDisconnect:  # gone mid-upload: nobody reads the answer, but count it
            reason, resp = "client_disconnect", Response(status_code=499)
        except RequestInvalid as exc:
            reason, resp = "invalid", _error(422, exc.issues)
        except Overloaded as exc:
            reason, resp = (
                "overloaded",
                _error(429, str(exc), headers={"Retry-After": str(exc.retry_after)}),
            )
        except DeadlineExceeded as exc:
            reason, resp = "deadline", _error(503, str(exc))
        except NotReady as exc:
            reason, resp = "not_ready", _error(503, f"not ready: {exc}")
        except ShuttingDown as exc:
            reason, resp = "shutting_down", _error(503, str(exc))
        except EncoderFailed as exc:  # our fault, not the input's: a 500 that says so
            reason, resp = "encoder", _error(500, f"encoder failed: {exc}")
        metrics.failures.labels(reason).inc()
        metrics.requests.labels(route, str(resp.status_code)).inc()
        return None, resp

    def timing_headers(scored: Scored) -> dict[str, str]:
        return {f"x-{k}-time": f"{scored.timings[k] * 1000:.3f}" for k in TIMING_HEADERS}

    def parse_score(body: bytes) -> ScoreRequest:
        return ScoreRequest.model_validate_json(body)

    async def score(request: Request) -> Response:
        route = request.url.path
        scored, failure = await run_scoring(request, route, parse_score)
        if failure is not None:
            return failure
        assert scored is not None
        metrics.requests.labels(route, "200").inc()
        return FastJSONResponse(scored.as_dict(), headers=timing_headers(scored))

    score_doc: dict[str, Any] = {
        "response_model": ScoreResponse,
        "responses": _ERRORS,
        "dependencies": [Depends(authorize)],
        "openapi_extra": {"x-sde2-body": "ScoreRequest"},
        "summary": "Score a batch of completions (SPEC §6)",
    }
    app.post("/v1/score", operation_id="score", **score_doc)(score)
    app.post("/score", operation_id="score_alias", **score_doc)(score)

    @app.post(
        "/get_reward",
        response_model=OpenRLHFResponse,
        responses=_ERRORS,
        dependencies=[Depends(authorize)],
        openapi_extra={"x-sde2-body": "OpenRLHFRequest"},
        summary="OpenRLHF remote reward protocol",
    )
    async def get_reward(
        request: Request,
        recipe: Annotated[Recipe, Query(description="reward recipe")] = "sde2",
        answer_type: Annotated[AnswerType, Query(description="answer matcher")] = "numeric",
        normalize: Annotated[
            bool,
            Query(
                description="z-score components over this request's samples. Off by default: "
                "OpenRLHF (>= 0.9.1) sends one sample per request, and over one sample every "
                "normalized component is 0, so the reward would always be 0"
            ),
        ] = False,
    ) -> Response:
        """``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``.

        The completion is what follows the prompt in the query; labels are the gold answers
        (strings, or numbers as an OpenRLHF dataset holds them). ``scores`` is correctness
        (0/1), what OpenRLHF's dynamic filtering expects.
        Normalization is off unless asked for (see the ``normalize`` parameter). Empty lists
        are valid and give empty lists.
        """
        holder: dict[str, int] = {}

        def parse(body: bytes) -> ScoreRequest:
            req = OpenRLHFRequest.model_validate_json(body)
            n = len(req.query)
            for name in ("prompts", "labels"):
                if len(getattr(req, name)) != n:
                    raise RequestInvalid(
                        [issue((name,), f"must have as many entries as query ({n})", "length")]
                    )
            holder["n"] = n
            if n == 0:
                raise _Empty
            return ScoreRequest(
                items=openrlhf_items(req),
                recipe=recipe,
                answer_type=answer_type,
                normalize=normalize,
            )

        try:
            scored, failure = await run_scoring(request, "/get_reward", parse, _openrlhf_loc)
        except _Empty:
            metrics.requests.labels("/get_reward", "200").inc()
            return JSONResponse({"rewards": [], "scores": [], "extra_logs": {}})
        if failure is not None:
            # OpenRLHF logs a failed reward call at info level only and trains on without the
            # sample's reward: say it here, where an operator looks.
            log.warning(
                "/get_reward answered %d; OpenRLHF drops this sample's reward: %s",
                failure.status_code,
                bytes(failure.body)[:500].decode("utf-8", "replace"),
            )
            return failure
        assert scored is not None
        s = scored.score
        extra: dict[str, list[float]] = {k: list(v) for k, v in s.components.items()}
        extra["correct"] = [float(it.correct) for it in s.items]
        extra["strategy_correct"] = [float(it.strategy_correct) for it in s.items]
        extra["n_strat"] = [float(it.n_strat) for it in s.items]
        metrics.requests.labels("/get_reward", "200").inc()
        return JSONResponse(
            {"rewards": s.rewards, "scores": extra["correct"], "extra_logs": extra},
            headers=timing_headers(scored),
        )

    @app.get("/healthz", summary="liveness: the process answers (no model work)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="readiness: model loaded and warm-up inference done",
        responses={503: {"model": ErrorResponse, "description": "not ready yet"}},
    )
    async def readyz() -> Response:
        if service.ready:
            return JSONResponse({"status": "ready", "encoder": service.encoder_name})
        detail = f"load failed: {service.load_error}" if service.load_error else "loading"
        return _error(503, detail)

    @app.get(
        "/v1/info",
        response_model=InfoResponse,
        summary="encoder, variant, provider, defaults, limits and version",
        responses={503: {"model": ErrorResponse, "description": "not ready yet"}},
    )
    async def info(request: Request) -> Response:
        """Open to all; the model's path only with the key, when one is set."""
        if not service.ready:
            return _error(503, "loading")
        try:
            authorize(request)
            reveal = True
        except _Unauthorized:
            reveal = False
        return JSONResponse(jsonable_encoder(service.info(reveal_paths=reveal)))

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> Response:
        metrics.failures.labels("unauthorized").inc()
        metrics.requests.labels(request.url.path, "401").inc()
        return _error(401, "missing or wrong bearer key", {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestInvalid)
    async def invalid(request: Request, exc: RequestInvalid) -> Response:
        metrics.failures.labels("invalid").inc()
        metrics.requests.labels(request.url.path, "422").inc()
        return _error(422, exc.issues)

    @app.exception_handler(RequestValidationError)
    async def query_invalid(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's own validation (query parameters): same 422 shape as ours."""
        issues = [
            issue(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
            for e in exc.errors()
        ]
        metrics.requests.labels(request.url.path, "422").inc()
        return _error(422, issues)

    install_explain_routes(
        app,
        run_scoring=run_scoring,
        timing_headers=timing_headers,
        parse_score=parse_score,
        metrics=metrics,
        doc=score_doc,
    )
    _install_openapi(app, service)
    return app


class _Unauthorized(Exception):
    """Raised by the auth dependency; answered with 401."""


class _Empty(Exception):
    """An OpenRLHF request with empty lists (valid: it gets empty lists back)."""


def _install_openapi(app: FastAPI, service: ScoringService) -> None:
    """Publish the hand-validated request bodies, with the server's limits, in OpenAPI."""
    bodies: dict[str, type[BaseModel]] = {
        "ScoreRequest": ScoreRequest,
        "OpenRLHFRequest": OpenRLHFRequest,
    }
    s = service.settings

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path_item in doc["paths"].values():
            for op in path_item.values():
                name = op.pop("x-sde2-body", None)
                if name is None:
                    continue
                schema = _model_schema(bodies[name], components)
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
        item = components.get("ScoreItem", {}).get("properties", {})
        for field, limit in (
            ("completion", s.max_completion_chars),
            ("prompt", s.max_completion_chars),
            ("answer", s.max_answer_chars),
            ("group", s.max_answer_chars),
        ):
            if field in item:
                _set_max_length(item[field], limit)
        for path in ("/v1/score", "/score", "/v1/explain"):
            for op in doc["paths"].get(path, {}).values():
                props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
                props["items"].update(minItems=1, maxItems=s.max_items)
        for op in doc["paths"].get("/get_reward", {}).values():
            props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
            for name in ("query", "prompts", "labels"):
                props[name]["maxItems"] = s.max_items
            props["query"]["items"]["maxLength"] = s.max_completion_chars
            _set_max_length(props["labels"]["items"], s.max_answer_chars)
        if s.api_key is not None:
            components_root = doc["components"]
            components_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path in ("/v1/score", "/score", "/get_reward", "/v1/explain"):
                for op in doc["paths"].get(path, {}).values():
                    op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _set_max_length(schema: dict[str, Any], limit: int) -> None:
    """Add ``maxLength`` to a string schema, or to the string branch of ``anyOf``."""
    if schema.get("type") == "string":
        schema["maxLength"] = limit
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["maxLength"] = limit


__all__ = ["create_app", "openrlhf_items", "read_body"]
