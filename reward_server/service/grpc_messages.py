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
from reward_server.service.errors import RequestInvalid
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


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


#: Top-level fields beyond the items a ``ScoreRequest`` may hold (six are declared): a message
#: with more is not one a client's encoder writes, and is refused before it is parsed.
OTHER_FIELDS = 64


def count_items(data: bytes, stop_after: int) -> int | None:
    """How many ``items`` (field 1) the serialized ``ScoreRequest`` ``data`` holds, counted in
    its bytes without parsing them, and at most ``stop_after + 1``: the scan ends there. None
    when the message holds more than :data:`OTHER_FIELDS` other top-level fields, or a group
    (which this message never declares, and whose contents the scan would not see).

    Why: an empty item is two bytes, so a message under the body limit holds millions, and
    protobuf builds every one of them (about 100 bytes of memory per byte sent) before a
    handler could count them. The scan reads at most ``stop_after + 1 + OTHER_FIELDS`` fields
    (an item's contents are skipped by its length), so millions of junk fields cost no more
    than a full batch. Bytes that are not a valid message end the scan with what was counted
    so far; the parser then refuses them with its own words.

    >>> two = pb.ScoreRequest(items=[pb.Item(completion="x"), pb.Item()], recipe="sde2")
    >>> count_items(two.SerializeToString(), stop_after=10)
    2
    >>> count_items(b"\\x0a\\x00" * 4_000_000, stop_after=1024)
    1025
    >>> count_items(b"\\x98\\x06\\x00" * 2_000_000, stop_after=1024) is None  # field 99
    True
    >>> count_items(b"\\x9b\\x06\\x9c\\x06" + b"\\x0a\\x00" * 2000, stop_after=1024) is None
    True
    >>> count_items(b"\\x0a\\x05ab", stop_after=10)  # cut short: counted, the parser refuses it
    1
    """
    found = others = pos = 0
    end = len(data)
    try:
        while pos < end and found <= stop_after:
            key, pos = _varint(data, pos)
            wire = key & 7
            if key >> 3 == 1 and wire == 2:
                found += 1
            elif others == OTHER_FIELDS:
                return None
            else:
                others += 1
            if wire == 2:  # length-delimited
                size, pos = _varint(data, pos)
                pos += size
            elif wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:  # a group (3, 4: none in this message, yet protobuf keeps unknown ones whole,
                return None  # items and all, so the count would stop short) or not protobuf
    except IndexError:
        pass
    return found


class Malformed:
    """A request whose bytes are not the method's protobuf message (see :func:`lenient`)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def refusal(self) -> RequestInvalid:
        """The INVALID_ARGUMENT this request is answered with."""
        msg = f"request is not a valid protobuf message: {self.why}"
        return RequestInvalid.one((), msg, "malformed")


def lenient(messages: Any, name: str) -> Callable[[bytes], Any]:
    """A deserializer of message ``name`` that never raises: grpc answers a raising one with
    UNKNOWN and a logged traceback; the handler answers :class:`Malformed` with
    INVALID_ARGUMENT instead."""
    parse = getattr(messages, name).FromString

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything the parser raises on junk
            return Malformed(str(exc) or type(exc).__name__)

    return deserialize


def parse_request(data: bytes) -> pb.ScoreRequest:
    """``data`` as a ``ScoreRequest``, or the INVALID_ARGUMENT saying why it is not one.

    >>> len(parse_request(pb.ScoreRequest(items=[pb.Item()]).SerializeToString()).items)
    1
    >>> parse_request(b"\\x0a\\x05ab")
    Traceback (most recent call last):
    ...
    reward_server.service.errors.RequestInvalid: body: request is not a valid protobuf message: ...
    """
    request = lenient(pb, "ScoreRequest")(data)
    if isinstance(request, Malformed):
        raise request.refusal()
    return request
