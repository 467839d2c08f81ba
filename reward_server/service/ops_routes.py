"""Routes for operators and tools: ``/healthz``, ``/readyz``, ``/v1/info``, ``/metrics``, and the
OpenAPI document, which publishes the hand-validated request bodies with this server's limits
(read from the same tables the service enforces, so the document cannot drift from them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from reward_server.service.credentials import one_credential
from reward_server.service.http_scoring import route_label, service_of
from reward_server.service.openrlhf_routes import ITEM_SOURCES
from reward_server.service.request_checks import item_text_limits
from reward_server.service.schemas import (
    ErrorResponse,
    InfoResponse,
    OpenRLHFRequest,
    ScoreRequest,
)

router = APIRouter()
_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorResponse, "description": "not ready yet"}
}
#: Routes that take a key when one is set (their body is documented by ``x-sde2-body``).
SCORING_PATHS = ("/v1/score", "/score", "/get_reward", "/v1/explain")


# The probes answer HEAD too (the head alone is sent): a load balancer may probe with it.
# Left out of the schema, where it would be a second operation of the same name.
@router.head("/healthz", include_in_schema=False)
@router.get("/healthz", summary="liveness: the process answers (no model work)")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.head("/readyz", include_in_schema=False)
@router.get(
    "/readyz", summary="readiness: model loaded and warm-up inference done", responses=_NOT_READY
)
async def readyz(request: Request) -> Response:
    """A probe's answer (never counted as a failure)."""
    service = service_of(request)
    if service.ready:
        return JSONResponse({"status": "ready", "encoder": service.encoder_name})
    detail = f"load failed: {service.load_error}" if service.load_error else "loading"
    return JSONResponse({"detail": detail}, status_code=503)


@router.get(
    "/v1/info",
    response_model=InfoResponse,
    summary="encoder, variant, provider, defaults, limits and version",
    responses=_NOT_READY,
)
async def info(request: Request) -> Response:
    """Open to all; the model's path only with the key, when one is set."""
    service = service_of(request)
    info = service.info_for(one_credential(request.headers.getlist("authorization")))
    service.metrics.count(route_label(request), "200")  # as its refusals are
    return JSONResponse(jsonable_encoder(info))


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> Response:
    return Response(service_of(request).metrics.render(), media_type="text/plain; version=0.0.4")


def install_openapi(app: FastAPI) -> None:
    """Publish the hand-validated request bodies, with the server's limits, in OpenAPI."""
    bodies: dict[str, type[BaseModel]] = {
        "ScoreRequest": ScoreRequest,
        "OpenRLHFRequest": OpenRLHFRequest,
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        s = app.state.service.settings
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path_item in doc["paths"].values():
            for op in path_item.values():
                name = op.pop("x-sde2-body", None)
                if name is not None:
                    schema = _model_schema(bodies[name], components)
                    content = {"application/json": {"schema": schema}}
                    op["requestBody"] = {"required": True, "content": content}
        limits = item_text_limits(s)
        item = components.get("ScoreItem", {}).get("properties", {})
        for field, limit in limits.items():
            if field in item:
                _set_max_length(item[field], limit)
        for path in ("/v1/score", "/score", "/v1/explain"):
            for op in doc["paths"].get(path, {}).values():
                props = _body_properties(op)
                props["items"].update(minItems=1, maxItems=s.max_items)
        for op in doc["paths"].get("/get_reward", {}).values():
            props = _body_properties(op)
            for field, source in ITEM_SOURCES.items():
                props[source]["maxItems"] = s.max_items
                _set_max_length(props[source]["items"], limits[field])
        if s.api_key is not None:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path in SCORING_PATHS:
                for op in doc["paths"].get(path, {}).values():
                    op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _body_properties(op: dict[str, Any]) -> Any:
    """The properties of an operation's JSON request body schema."""
    return op["requestBody"]["content"]["application/json"]["schema"]["properties"]


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """``model``'s validation JSON schema, its ``$defs`` moved into OpenAPI components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    return schema


def _set_max_length(schema: dict[str, Any], limit: int) -> None:
    """Add ``maxLength`` to a string schema, or to the string branch of ``anyOf``."""
    if schema.get("type") == "string":
        schema["maxLength"] = limit
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["maxLength"] = limit
