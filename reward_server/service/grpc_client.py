"""Client-side helpers for ``sde2.v1.RewardService``: a stub, and the HTTP JSON shape in and out
(clients and the parity tests compare gRPC answers with HTTP ones)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from reward_server.field_names import not_utf8, shown_path, unencodable_at
from reward_server.service.grpc_messages import (
    METHODS,
    REQUIRED_ITEM_FIELDS,
    SERVICE,
    pb,
    response_to_dict,  # re-exported: clients import it from here, beside request_from_dict
)


class RewardStub:
    """Client for ``sde2.v1.RewardService`` (``Score``, ``Info``, ``Health``, ``Explain``)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        def method(name: str) -> Callable[..., Any]:
            req, resp = METHODS[name]
            return channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=getattr(pb, req).SerializeToString,
                response_deserializer=getattr(pb, resp).FromString,
            )

        self.Score = method("Score")
        self.Info = method("Info")
        self.Health = method("Health")
        self.Explain = method("Explain")


#: Channel options of :func:`insecure_channel`: no cap on the answers received. gRPC's default
#: of 4 MiB would refuse an ``Explain`` of a few hundred items after the server has done the
#: work (it sends up to ``--max-body-bytes``, at least 64 MiB).
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1),)


def insecure_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (``host:port``) that takes any answer the server
    sends (:data:`CHANNEL_OPTIONS`). Make it inside the running event loop (it binds to the
    loop it is made in); ``grpc.insecure_channel(target, CHANNEL_OPTIONS)`` is the blocking one."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def request_from_dict(body: dict[str, Any]) -> pb.ScoreRequest:
    """A ``ScoreRequest`` message from the HTTP JSON shape (clients, tests).

    A value the message would carry as something else is a :class:`ValueError` naming its
    field, where protobuf would coerce it (``True`` into ``1.0``, ``1`` into ``true``) or drop
    it (``None``: the default) and the server would score what HTTP refuses. Values of the
    right type go through unchecked: the server validates them as over HTTP.

    >>> request_from_dict({"items": [{"completion": "a", "answer": "1", "group": None}]}).items[0]
    completion: "a"
    answer: "1"
    <BLANKLINE>
    >>> request_from_dict({"items": [], "params": {"lambda_oc": True}})
    Traceback (most recent call last):
    ...
    ValueError: params.lambda_oc: a double, got bool True (HTTP refuses it too)
    >>> request_from_dict({"items": [{"completion": "a"}]})
    Traceback (most recent call last):
    ...
    ValueError: items.0.answer: a string is required, missing (HTTP refuses it too)
    >>> request_from_dict({"items": [{"completion": "x\\ud800", "answer": "1"}]})
    Traceback (most recent call last):
    ...
    ValueError: items.0.completion: not valid UTF-8 at character 1: a lone surrogate ...
    """
    msg = pb.ScoreRequest()
    for key, value in body.items():
        if key == "items":
            for k, item in enumerate(_listed(value, ("items",))):
                fields = _mapping(item, ("items", k))
                _require(fields, REQUIRED_ITEM_FIELDS, ("items", k))
                # None is a declared field's default; an unknown name is refused whatever its value.
                present = {
                    f: v for f, v in fields.items() if v is not None or not _declares(pb.Item, f)
                }
                _fill(msg.items.add(), present, ("items", k))
        elif key == "params":
            params = dict(_mapping(value, ("params",)))
            has_weights = "weights" in params
            weights = params.pop("weights", None)
            msg.params.SetInParent()
            _fill(msg.params, params, ("params",))
            if has_weights:
                msg.params.weights.SetInParent()
                _fill(
                    msg.params.weights,
                    _mapping(weights, ("params", "weights")),
                    ("params", "weights"),
                )
        else:
            _fill(msg, {key: value}, ())
    return msg


def _declares(message: Message | type[Message], name: str) -> bool:
    r"""Whether ``message`` declares a field ``name``. protobuf's lookup raises (a bare
    ``SystemError``, or ``UnicodeEncodeError``) for a name UTF-8 cannot carry: no field has one.

    >>> _declares(pb.Item, "answer"), _declares(pb.Item(), "answers"), _declares(pb.Item, "\ud800")
    (True, False, False)
    """
    return unencodable_at(name) is None and name in message.DESCRIPTOR.fields_by_name


def _require(fields: Mapping[str, Any], names: Sequence[str], loc: tuple[str | int, ...]) -> None:
    """Refuse (naming it) a field of ``names`` that ``fields`` lacks or holds as ``None``."""
    for name in names:
        if fields.get(name) is None:
            path = shown_path((*loc, name))
            got = "missing" if name not in fields else "got None"
            raise ValueError(f"{path}: a string is required, {got} (HTTP refuses it too)")


#: Which Python values each field type of these messages carries as HTTP's JSON reads them.
_CARRIES: dict[int, tuple[str, Callable[[Any], bool]]] = {
    FieldDescriptor.TYPE_DOUBLE: (
        "a double",
        lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    ),
    FieldDescriptor.TYPE_INT64: (
        "an integer",
        lambda v: isinstance(v, int) and not isinstance(v, bool),
    ),
    FieldDescriptor.TYPE_BOOL: ("a boolean", lambda v: isinstance(v, bool)),
    FieldDescriptor.TYPE_STRING: ("a string", lambda v: isinstance(v, str)),
}


def _fill(message: Message, fields: Mapping[str, Any], loc: tuple[str | int, ...]) -> None:
    """Set each of ``fields`` on ``message``, refusing (naming the field) an unknown name, a
    value its field would carry as something else, and a string UTF-8 cannot carry (a lone
    surrogate, as a broken tokenizer's decoding can leave: protobuf's error named no field)."""
    declared = message.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        path = shown_path((*loc, name))
        field = declared[name] if _declares(message, name) else None
        if field is None or field.type not in _CARRIES:
            raise ValueError(f"{path}: not a field of sde2.v1's {message.DESCRIPTOR.name}")
        kind, carries = _CARRIES[field.type]
        if not carries(value):
            raise ValueError(
                f"{path}: {kind}, got {type(value).__name__} {value!r} (HTTP refuses it too)"
            )
        at = unencodable_at(value)
        if at is not None:
            raise ValueError(f"{path}: {not_utf8(at)}; not sent")
        try:
            setattr(message, name, value)
        except ValueError as exc:  # past int64: protobuf names no field
            raise ValueError(f"{path}: {exc} (past gRPC's int64)") from None
        except OverflowError as exc:  # past a double: no field named
            raise ValueError(f"{path}: {exc} (HTTP refuses it too)") from None


def _mapping(value: Any, loc: tuple[str | int, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{shown_path(loc)}: an object, got {type(value).__name__} {value!r}")
    return value


def _listed(value: Any, loc: tuple[str | int, ...]) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{shown_path(loc)}: a list, got {type(value).__name__}")
    return list(value)


__all__ = [
    "CHANNEL_OPTIONS",
    "RewardStub",
    "insecure_channel",
    "request_from_dict",
    "response_to_dict",
]
