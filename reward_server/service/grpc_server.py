"""The gRPC front end (``sde2.v1.RewardService``): the same pipeline as HTTP, another wire.

A gRPC request is turned into the JSON object of the HTTP contract and validated by the very
same :class:`ScoreRequest` model, so both front ends accept, reject (with the same field paths)
and score identically; the response is the same :class:`BatchScore` in protobuf form.

Status codes: INVALID_ARGUMENT (bad input; the message lists each field path), RESOURCE_EXHAUSTED
(at capacity; trailing metadata ``retry-after``), DEADLINE_EXCEEDED (server deadline or the
client's own, whichever is sooner), UNAUTHENTICATED (wrong or missing ``authorization: Bearer``),
UNAVAILABLE (model loading or shutting down). Phase timings go out as trailing metadata
(``x-parse-time`` … in ms), like the HTTP headers.

The messages (``pb``) are generated from ``protos/`` when the package is built (``setup.py``;
``protos/generate.py`` says why they are not committed) and typed by their generated stubs. The
service plumbing uses grpc's generic handlers instead of protoc's ``*_pb2_grpc.py`` (which imports
its sibling as a top-level package); :class:`RewardStub` is the matching client.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import Message

from reward_server.core.params import RewardParams, Weights
from reward_server.service._generated.sde2.v1 import reward_pb2 as pb
from reward_server.service.batcher import (
    DeadlineExceeded,
    EncoderFailed,
    Overloaded,
    ShuttingDown,
)
from reward_server.service.pipeline import NotReady, RequestInvalid, Scored, ScoringService
from reward_server.service.schemas import ScoreRequest

log = logging.getLogger(__name__)

SERVICE = "sde2.v1.RewardService"
#: The messages' fields are the models' (``RewardParams`` less its nested ``weights``; ``Weights``):
#: a test checks ``reward.proto`` declares exactly these.
_PARAM_FIELDS = tuple(name for name in RewardParams.model_fields if name != "weights")
_WEIGHT_FIELDS = tuple(Weights.model_fields)


def _set_fields(msg: Message, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(msg, name) for name in names if msg.HasField(name)}


def request_to_json(request: pb.ScoreRequest) -> bytes:
    """The HTTP JSON body equivalent to a ``ScoreRequest`` message (unset fields omitted)."""
    items = []
    for it in request.items:
        item: dict[str, Any] = {"completion": it.completion, "answer": it.answer}
        item.update(_set_fields(it, ("prompt", "group", "num_tokens")))
        items.append(item)
    body: dict[str, Any] = {"items": items}
    body.update(_set_fields(request, ("recipe", "answer_type", "normalize", "diagnostics")))
    if request.HasField("params"):
        params = _set_fields(request.params, _PARAM_FIELDS)
        if request.params.HasField("weights"):
            params["weights"] = _set_fields(request.params.weights, _WEIGHT_FIELDS)
        body["params"] = params
    # NaN/inf doubles are written as JSON's NaN/Infinity tokens, which the model then rejects
    # as non-finite with the field's path (exactly as over HTTP).
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def params_to_proto(params: dict[str, Any]) -> pb.RewardParams:
    """Every effective parameter as a ``RewardParams`` message."""
    flat = {k: params[k] for k in _PARAM_FIELDS}
    return pb.RewardParams(**flat, weights=pb.Weights(**params["weights"]))


def scored_to_proto(scored: Scored) -> pb.ScoreResponse:
    """A :class:`Scored` as a ``ScoreResponse`` message."""
    d = scored.as_dict()
    resp = pb.ScoreResponse(
        rewards=d["rewards"],
        recipe=d["recipe"],
        encoder=d["encoder"],
        params=params_to_proto(d["params"]),
    )
    for key, values in d["components"].items():
        resp.components[key].values.extend(values)
    for key, values in d["normalized"].items():
        resp.normalized[key].values.extend(values)
    if d["advantages"] is not None:
        resp.advantages.SetInParent()
        resp.advantages.values.extend(d["advantages"])
    resp.batch_mean.update(d["batch"]["mean"])
    resp.batch_std.update(d["batch"]["std"])
    for it in d["items"]:
        resp.items.add(**{k: v for k, v in it.items() if v is not None})
    return resp


def response_to_dict(resp: pb.ScoreResponse) -> dict[str, Any]:
    """A ``ScoreResponse`` back in the HTTP JSON shape (for clients and the parity tests)."""
    params: dict[str, Any] = {k: getattr(resp.params, k) for k in _PARAM_FIELDS}
    params["weights"] = {k: getattr(resp.params.weights, k) for k in _WEIGHT_FIELDS}
    optional = ("final_answer", "uniq", "div")
    return {
        "rewards": list(resp.rewards),
        "components": {k: list(v.values) for k, v in resp.components.items()},
        "normalized": {k: list(v.values) for k, v in resp.normalized.items()},
        "advantages": list(resp.advantages.values) if resp.HasField("advantages") else None,
        "items": [
            {
                "n_strat": it.n_strat,
                "correct": it.correct,
                "strategy_correct": it.strategy_correct,
                **{k: getattr(it, k) if it.HasField(k) else None for k in optional},
            }
            for it in resp.items
        ],
        "batch": {"mean": dict(resp.batch_mean), "std": dict(resp.batch_std)},
        "recipe": resp.recipe,
        "params": params,
        "encoder": resp.encoder,
    }


class RewardServicer:
    """Handlers of ``sde2.v1.RewardService`` over a :class:`ScoringService`."""

    def __init__(self, service: ScoringService) -> None:
        self.service = service

    def _has_key(self, context: grpc.aio.ServicerContext) -> bool:
        """No key is set, or the call carries it (``authorization: Bearer``)."""
        key = self.service.settings.api_key
        if key is None:
            return True
        metadata = dict(context.invocation_metadata() or ())
        header = str(metadata.get("authorization", ""))
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"),
            key.encode("utf-8", "surrogateescape"),
        )

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self._has_key(context):
            await self._fail(context, "unauthorized", grpc.StatusCode.UNAUTHENTICATED, "bad key")

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        reason: str,
        code: grpc.StatusCode,
        msg: str,
        method: str = "Score",
    ) -> None:
        self.service.metrics.failures.labels(reason).inc()
        self.service.metrics.requests.labels(f"grpc:{method}", code.name).inc()
        await context.abort(code, msg)

    async def _scored(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext, method: str = "Score"
    ) -> Scored:
        """The pipeline's answer to a ``ScoreRequest``, or an abort with the matching status."""
        await self._authorize(context)
        remaining = context.time_remaining()
        body = request_to_json(request)
        fail = partial(self._fail, context, method=method)
        try:
            scored = await self.service.score(
                lambda: ScoreRequest.model_validate_json(body),
                timeout=remaining,
                explain=method == "Explain",
            )
        except RequestInvalid as exc:
            await fail("invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after)),))
            await fail("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DeadlineExceeded as exc:
            await fail("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (NotReady, ShuttingDown) as exc:
            await fail("not_ready", grpc.StatusCode.UNAVAILABLE, str(exc))
        except EncoderFailed as exc:
            await fail("encoder", grpc.StatusCode.INTERNAL, str(exc))
        context.set_trailing_metadata(
            tuple((f"x-{k}-time", f"{v * 1000:.3f}") for k, v in scored.timings.items())
        )
        self.service.metrics.requests.labels(f"grpc:{method}", "OK").inc()
        return scored

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        """Score one batch (``POST /v1/score``)."""
        return scored_to_proto(await self._scored(request, context))

    async def Explain(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        """Score one batch and explain every item (``POST /v1/explain``)."""
        scored = await self._scored(request, context, "Explain")
        return pb.ExplainResponse(
            score=scored_to_proto(scored),
            explanation_json=json.dumps(scored.explanation, ensure_ascii=False),
        )

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        """Encoder, variant, provider, version, defaults and limits (``GET /v1/info``); the
        model's path only to holders of the key when one is set."""
        if not self.service.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "loading")
        info = self.service.info(reveal_paths=self._has_key(context))
        return pb.InfoResponse(
            encoder=info["encoder"],
            variant=info["variant"],
            provider=info["provider"],
            version=info["version"],
            model_path=info["model_path"] or "",
            defaults_json=json.dumps(info["defaults"]),
            limits_json=json.dumps(info["limits"]),
        )

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        """SERVING once the model is loaded and warm (``GET /readyz``)."""
        status = (
            pb.HealthResponse.Status.SERVING
            if self.service.ready
            else pb.HealthResponse.Status.NOT_SERVING
        )
        return pb.HealthResponse(status=status, encoder=self.service.encoder_name)


_METHODS: dict[str, tuple[str, str]] = {
    "Score": ("ScoreRequest", "ScoreResponse"),
    "Info": ("InfoRequest", "InfoResponse"),
    "Health": ("HealthRequest", "HealthResponse"),
    "Explain": ("ScoreRequest", "ExplainResponse"),
}


class _Malformed:
    """A request whose bytes are not the method's protobuf message (see :func:`_lenient`)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer that never raises: grpc answers a raising one with UNKNOWN and a logged
    traceback; the handler answers :class:`_Malformed` with INVALID_ARGUMENT instead."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything the parser raises on junk
            return _Malformed(str(exc) or type(exc).__name__)

    return deserialize


def _refusing_malformed(servicer: RewardServicer, name: str) -> Callable[..., Any]:
    method = getattr(servicer, name)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            servicer.service.metrics.failures.labels("invalid").inc()
            code = grpc.StatusCode.INVALID_ARGUMENT
            servicer.service.metrics.requests.labels(f"grpc:{name}", code.name).inc()
            await context.abort(code, f"request is not a valid protobuf message: {request.why}")
        return await method(request, context)

    return handle


def generic_handler(servicer: RewardServicer) -> grpc.GenericRpcHandler:
    """The method table protoc's ``add_RewardServiceServicer_to_server`` would build (with
    malformed messages answered INVALID_ARGUMENT)."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _refusing_malformed(servicer, name),
            request_deserializer=_lenient(getattr(pb, req).FromString),
            response_serializer=getattr(pb, resp).SerializeToString,
        )
        for name, (req, resp) in _METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def create_server(
    service: ScoringService, host: str, port: int, *, reuse_port: bool = False
) -> tuple[grpc.aio.Server, int]:
    """A started-later ``grpc.aio`` server on ``host:port``; returns it and the bound port."""
    limit = service.settings.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", max(limit, 64 * 1024 * 1024)),
        ]
    )
    server.add_generic_rpc_handlers((generic_handler(RewardServicer(service)),))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # what grpc raises for a port in use
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port} (in use, or not an address here)")
    return server, bound


class RewardStub:
    """Client for ``sde2.v1.RewardService`` (``Score``, ``Info``, ``Health``, ``Explain``)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        def method(name: str) -> Callable[..., Any]:
            req, resp = _METHODS[name]
            return channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=getattr(pb, req).SerializeToString,
                response_deserializer=getattr(pb, resp).FromString,
            )

        self.Score = method("Score")
        self.Info = method("Info")
        self.Health = method("Health")
        self.Explain = method("Explain")


def request_from_dict(body: dict[str, Any]) -> pb.ScoreRequest:
    """A ``ScoreRequest`` message from the HTTP JSON shape (clients, tests)."""
    body = dict(body)
    params = dict(body.pop("params", None) or {})
    weights = params.pop("weights", None)
    msg = pb.ScoreRequest(**{k: v for k, v in body.items() if k != "items"})
    for item in body.get("items", []):
        msg.items.add(**{k: v for k, v in item.items() if v is not None})
    if params or weights is not None:
        msg.params.SetInParent()
        for k, v in params.items():
            setattr(msg.params, k, v)
        if weights is not None:
            msg.params.weights.SetInParent()
            for k, v in weights.items():
                setattr(msg.params.weights, k, v)
    return msg
