"""``sde2.v1`` messages <-> the HTTP contract's JSON: what the gRPC server and its clients share.

A gRPC request becomes the JSON body of the HTTP contract (:func:`request_to_json`) and is then
validated by the very same :class:`ScoreRequest` model, so both front ends accept, reject (with
the same field paths) and score identically; a :class:`Scored` goes out in protobuf form
(:func:`scored_to_proto`).

The messages (``pb``) are generated from ``protos/`` when the package is built (``setup.py``;
``protos/generate.py`` says why they are not committed) and typed by their generated stubs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from reward_server.core.params import RewardParams, Weights
from reward_server.service._generated.sde2.v1 import reward_pb2 as pb
from reward_server.service.pipeline import Scored

SERVICE = "sde2.v1.RewardService"
#: The messages' fields are the models' (``RewardParams`` less its nested ``weights``; ``Weights``):
#: a test checks ``reward.proto`` declares exactly these.
PARAM_FIELDS = tuple(name for name in RewardParams.model_fields if name != "weights")
WEIGHT_FIELDS = tuple(Weights.model_fields)


#: Each method's request and response message names.
METHODS: dict[str, tuple[str, str]] = {
    "Score": ("ScoreRequest", "ScoreResponse"),
    "Info": ("InfoRequest", "InfoResponse"),
    "Health": ("HealthRequest", "HealthResponse"),
    "Explain": ("ScoreRequest", "ExplainResponse"),
}


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
        params = _set_fields(request.params, PARAM_FIELDS)
        if request.params.HasField("weights"):
            params["weights"] = _set_fields(request.params.weights, WEIGHT_FIELDS)
        body["params"] = params
    # NaN/inf doubles are written as JSON's NaN/Infinity tokens, which the model then rejects
    # as non-finite with the field's path (exactly as over HTTP).
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def params_to_proto(params: dict[str, Any]) -> pb.RewardParams:
    """Every effective parameter as a ``RewardParams`` message."""
    flat = {k: params[k] for k in PARAM_FIELDS}
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


def info_to_proto(info: dict[str, Any]) -> pb.InfoResponse:
    """The service's info (``GET /v1/info``'s JSON) as an ``InfoResponse`` message."""
    return pb.InfoResponse(
        encoder=info["encoder"],
        variant=info["variant"],
        provider=info["provider"],
        version=info["version"],
        model_path=info["model_path"] or "",
        defaults_json=json.dumps(info["defaults"]),
        limits_json=json.dumps(info["limits"]),
    )


class Malformed:
    """A request whose bytes are not the method's protobuf message (see :func:`lenient`)."""

    def __init__(self, why: str) -> None:
        self.why = why


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer that never raises: grpc answers a raising one with UNKNOWN and a logged
    traceback; the handler answers :class:`Malformed` with INVALID_ARGUMENT instead."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything the parser raises on junk
            return Malformed(str(exc) or type(exc).__name__)

    return deserialize
