"""``sde2.v1`` messages <-> the HTTP contract's JSON: what the gRPC server and its clients share.

A gRPC request becomes the JSON body of the HTTP contract (:func:`request_to_json`) and is then
validated by the very same :class:`ScoreRequest` model, so both front ends accept, reject (with
the same field paths) and score identically; a :class:`Scored` goes out in protobuf form
(:func:`scored_to_proto`), and a client reads it back in the HTTP answer's shape
(:func:`response_to_dict`, its inverse).

The messages (``pb``) are generated from ``protos/`` when the package is built (``setup.py``;
``protos/generate.py`` says why they are not committed) and typed by their generated stubs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from reward_server.core.components import COMPONENTS
from reward_server.core.params import RewardParams, Weights
from reward_server.core.recipes import RECIPES
from reward_server.core.scoring import ItemResult
from reward_server.field_names import first_found
from reward_server.service._generated.sde2.v1 import reward_pb2 as pb
from reward_server.service.errors import Loc, RequestInvalid, issue
from reward_server.service.scored import Scored

SERVICE = "sde2.v1.RewardService"
#: The messages' fields are the models' (``RewardParams`` less its nested ``weights``; ``Weights``):
#: a test checks ``reward.proto`` declares exactly these.
PARAM_FIELDS = tuple(name for name in RewardParams.model_fields if name != "weights")
WEIGHT_FIELDS = tuple(Weights.model_fields)
#: An item's fields HTTP requires. The message cannot: a proto3 string left unset and one set
#: to "" are the same bytes, and an empty completion is a real one, so the server scores a
#: missing field as empty (a missing answer with the empty-gold warning).
REQUIRED_ITEM_FIELDS = ("completion", "answer")
#: The fields ``reward.proto`` declares ``optional`` (besides the parameters'): unset in a
#: message, they are left out of HTTP's request and ``None`` in its answer. An item's:
OPTIONAL_ITEM_FIELDS = ("prompt", "group", "num_tokens")
#: A ``ScoreRequest``'s, beside its items and parameters:
OPTIONAL_REQUEST_FIELDS = ("recipe", "answer_type", "normalize", "diagnostics")
#: An ``ItemResult``'s:
OPTIONAL_RESULT_FIELDS = ("final_answer", "uniq", "div")


#: Each method's request and response message names.
METHODS: dict[str, tuple[str, str]] = {
    "Score": ("ScoreRequest", "ScoreResponse"),
    "Info": ("InfoRequest", "InfoResponse"),
    "Health": ("HealthRequest", "HealthResponse"),
    "Explain": ("ScoreRequest", "ExplainResponse"),
}


def _set_fields(msg: Message, names: tuple[str, ...]) -> dict[str, Any]:
    """``names``' fields that ``msg`` has set (an unset optional field is left out).

    The optional fields named above are exactly the scalars ``reward.proto`` declares so:

    >>> def declared(m):
    ...     fields = m.DESCRIPTOR.fields
    ...     return tuple(f.name for f in fields if f.has_presence and not f.message_type)
    >>> declared(pb.Item) == OPTIONAL_ITEM_FIELDS, declared(pb.ItemResult) == OPTIONAL_RESULT_FIELDS
    (True, True)
    >>> declared(pb.ScoreRequest) == OPTIONAL_REQUEST_FIELDS
    True
    """
    return {name: getattr(msg, name) for name in names if msg.HasField(name)}


def request_to_json(request: pb.ScoreRequest) -> bytes:
    """The HTTP JSON body equivalent to a ``ScoreRequest`` message (unset fields omitted)."""
    items = []
    for it in request.items:
        item: dict[str, Any] = {"completion": it.completion, "answer": it.answer}
        item.update(_set_fields(it, OPTIONAL_ITEM_FIELDS))
        items.append(item)
    body: dict[str, Any] = {"items": items}
    body.update(_set_fields(request, OPTIONAL_REQUEST_FIELDS))
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


def response_to_dict(resp: pb.ScoreResponse) -> dict[str, Any]:
    """A ``ScoreResponse`` back in the HTTP JSON shape (for clients and the parity tests): the
    inverse of :func:`scored_to_proto`."""
    weights = {k: getattr(resp.params.weights, k) for k in WEIGHT_FIELDS}
    params = {  # in HTTP's order
        k: weights if k == "weights" else getattr(resp.params, k) for k in RewardParams.model_fields
    }
    # The components in the recipe's order, as HTTP sends them (a protobuf map has none).
    known = RECIPES[resp.recipe].components if resp.recipe in RECIPES else tuple(COMPONENTS)
    keys = [*(k for k in known if k in resp.components), *sorted(set(resp.components) - set(known))]
    return {
        "rewards": list(resp.rewards),
        "components": {k: list(resp.components[k].values) for k in keys},
        "normalized": {k: list(resp.normalized[k].values) for k in keys if k in resp.normalized},
        "advantages": list(resp.advantages.values) if resp.HasField("advantages") else None,
        "items": [
            {
                k: (getattr(it, k) if k not in OPTIONAL_RESULT_FIELDS or it.HasField(k) else None)
                for k in ItemResult._fields
            }
            for it in resp.items
        ],
        "batch": {
            "mean": {k: resp.batch_mean[k] for k in keys if k in resp.batch_mean},
            "std": {k: resp.batch_std[k] for k in keys if k in resp.batch_std},
        },
        "recipe": resp.recipe,
        "params": params,
        "encoder": resp.encoder,
    }


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


#: The longest varint protobuf writes (a 64-bit value, 7 bits a byte).
_VARINT_MAX_BYTES = 10


class _NotAVarint(ValueError):
    """More than :data:`_VARINT_MAX_BYTES` bytes with the continuation bit: not protobuf."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; IndexError past the end,
    :class:`_NotAVarint` past its tenth byte (unbounded, a message of 0xff bytes would be one
    varint growing a Python integer: quadratic time, holding the loop; measurements:
    benchmarks/README.md, the service's design).

    >>> _varint(b"\\xac\\x02", 0)
    (300, 2)
    >>> _varint(b"\\xff" * 11, 0)
    Traceback (most recent call last):
    ...
    reward_server.service.grpc_messages._NotAVarint: a varint longer than 10 bytes
    """
    value = shift = 0
    for at in range(pos, min(pos + _VARINT_MAX_BYTES, len(data))):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at + 1
        shift += 7
    if len(data) > pos + _VARINT_MAX_BYTES:
        raise _NotAVarint(f"a varint longer than {_VARINT_MAX_BYTES} bytes")
    raise IndexError("the message ends inside a varint")


#: Top-level fields beyond the items a ``ScoreRequest`` may hold (six are declared): a message
#: with more is not one a client's encoder writes, and is refused before it is parsed.
OTHER_FIELDS = 64


def count_items(data: bytes, stop_after: int) -> int | None:
    """How many ``items`` (field 1) the serialized ``ScoreRequest`` ``data`` holds, counted in
    its bytes without parsing them, and at most ``stop_after + 1``: the scan ends there. None
    when the message holds more than :data:`OTHER_FIELDS` other top-level fields, or a group
    (which this message never declares, and whose contents the scan would not see).

    Why: an empty item is two bytes, so a message under the body limit holds millions, and protobuf
    builds every one of them (many times the bytes sent, in memory) before a handler could count
    them (measurements: benchmarks/README.md, the service's design). The scan reads at most
    ``stop_after + 1 + OTHER_FIELDS`` fields (an item's contents are skipped by its length), so
    millions of junk fields cost no more than a full batch. Bytes that are not a valid message end
    the scan with what was counted so far; the parser then refuses them with its own words.

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
    except (IndexError, _NotAVarint):
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
    >>> parse_request(b"\\x0a\\x03\\x0a\\x01\\xff")  # items[0].completion: one byte, 0xff
    Traceback (most recent call last):
    ...
    reward_server.service.errors.RequestInvalid: items.0.completion: not valid UTF-8 at ...
    """
    request = lenient(pb, "ScoreRequest")(data)
    if isinstance(request, Malformed):
        raise not_utf8_field(data) or request.refusal()
    # Fields it does not declare: none when the known fields alone make up the bytes sent (a
    # C-level check, cheap on every request); else they are read anew, within a bound.
    request.DiscardUnknownFields()
    if request.ByteSize() != len(data):  # unknown fields, or only an unusual encoding
        whole = pb.ScoreRequest.FromString(data)
        _check_unknown_fields(whole, whole.ByteSize() - request.ByteSize())
    return request


def not_utf8_field(data: bytes) -> RequestInvalid | None:
    """The INVALID_ARGUMENT naming the first string field of the serialized ``ScoreRequest``
    ``data`` (fields by number, a repeated one's values in order) that is not valid UTF-8, as
    HTTP names such a string (:meth:`RequestInvalid.not_utf8`), or None when none is, or the
    bytes are not a message for another reason. Read only once the parser has refused them:
    its error names no field.

    The bytes are parsed again as :func:`_unchecked`'s mirror of the message, whose strings
    are bytes protobuf does not check, and its strings are then decoded: time linear in the
    message's size (what the mirror's parser builds: a request's items are counted first,
    :func:`count_items`), a walk no deeper than the messages' declared nesting, and no error
    of the parser's escapes.

    >>> sent = pb.ScoreRequest(items=[pb.Item(), pb.Item(answer="abcde")], recipe="x")
    >>> bad = b"\\xc3\\xa9\\xed\\xa0\\x80"  # "é", then a lone surrogate as UTF-8 would write one
    >>> not_utf8_field(sent.SerializeToString().replace(b"abcde", bad)).message
    'items.1.answer: not valid UTF-8 at character 1: a lone surrogate ...'
    >>> not_utf8_field(b"\\x12\\x01\\x80").field, not_utf8_field(b"\\x12\\x05ab") is None
    ('recipe', True)
    """
    try:
        mirror = _unchecked(pb.ScoreRequest.DESCRIPTOR.full_name).FromString(data)
    except Exception:  # DecodeError, or anything the parser raises on junk: not protobuf
        return None
    found = first_found(mirror, _strings_and_messages, _undecodable_at)
    return None if found is None else RequestInvalid.not_utf8(*found)


def _undecodable_at(value: Message | bytes) -> int | None:
    """The character where a string field's bytes (in :func:`_unchecked`'s mirror) stop
    being UTF-8, counted in the characters before it; None for valid text, or a message."""
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return len(value[: exc.start].decode("utf-8"))
    return None


def _strings_and_messages(value: Message | bytes) -> list[tuple[Loc, Message | bytes]]:
    """The string values (as bytes, in :func:`_unchecked`'s mirror) and the messages that a
    message holds, each with its keys (a field's name, and a repeated one's index), in the
    order of their fields' numbers (a map would be left out: a request's messages declare
    none); a string has none."""
    if not isinstance(value, Message):
        return []
    found: list[tuple[Loc, Message | bytes]] = []
    for field, held in value.ListFields():
        nested = field.message_type
        if field.type == FieldDescriptor.TYPE_BYTES or (
            nested is not None and not nested.GetOptions().map_entry
        ):
            if field.is_repeated:
                found.extend(((field.name, k), v) for k, v in enumerate(held))
            else:
                found.append(((field.name,), held))
    return found


@cache
def _unchecked(name: str) -> Any:
    """The class of a mirror of message ``name`` of ``sde2.v1`` (and of the messages it
    holds) whose string fields are bytes fields: protobuf refuses a whole message for one
    string that is not valid UTF-8 and names none, where a bytes field is read unchecked.
    Built once, in a pool of its own (the names are ``sde2.v1``'s).

    >>> [f.type for f in _unchecked("sde2.v1.Item").DESCRIPTOR.fields][:3] == [12, 12, 12]
    True
    """
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    messages = list(proto.message_type)
    while messages:  # nested messages too, but a map's entries: a map's key cannot be bytes
        message = messages.pop()
        messages.extend(m for m in message.nested_type if not m.options.map_entry)
        for field in message.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    descriptor: Descriptor = pool.FindMessageTypeByName(name)
    return message_factory.GetMessageClass(descriptor)


#: The most bytes of fields ``sde2.v1`` does not declare that a request may hold, and more
#: for each item (a newer client's few fields a request and an item fit): each is read into
#: a Python object, so a message of millions would hold the event loop for seconds; these
#: bound it to ~45k fields for 1024 items (measurements: benchmarks/README.md, the service's
#: design).
MAX_UNKNOWN_BYTES = 16384
MAX_UNKNOWN_BYTES_PER_ITEM = 64


def _check_unknown_fields(request: pb.ScoreRequest, unknown_bytes: int) -> None:
    """Refuse ``request`` (parsed with its unknown fields) when they are over
    :data:`MAX_UNKNOWN_BYTES` or when one is a declared field sent with another wire type.
    ``unknown_bytes``: their size."""
    limit = MAX_UNKNOWN_BYTES + MAX_UNKNOWN_BYTES_PER_ITEM * len(request.items)
    if unknown_bytes > limit:
        msg = (
            f"{unknown_bytes} bytes of fields that sde2.v1 does not declare, over the limit of "
            f"{limit} ({MAX_UNKNOWN_BYTES} + {MAX_UNKNOWN_BYTES_PER_ITEM} an item): send the "
            "fields it declares"
        )
        raise RequestInvalid.one((), msg, "unknown_fields")
    misread = [
        *_misread(request, ()),
        *(i for k, item in enumerate(request.items) for i in _misread(item, ("items", k))),
    ]
    if request.HasField("params"):
        misread += _misread(request.params, ("params",))
        if request.params.HasField("weights"):
            misread += _misread(request.params.weights, ("params", "weights"))
    if misread:
        raise RequestInvalid(misread)


_WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group", 5: "32-bit"}
#: Each field type these messages declare: its name in the .proto, the wire type it is sent as.
_DECLARED = {
    FieldDescriptor.TYPE_DOUBLE: ("double", 1),
    FieldDescriptor.TYPE_INT64: ("int64", 0),
    FieldDescriptor.TYPE_BOOL: ("bool", 0),
    FieldDescriptor.TYPE_STRING: ("string", 2),
    FieldDescriptor.TYPE_MESSAGE: ("message", 2),
}


def _misread(message: Message, loc: tuple[str | int, ...]) -> list[dict[str, Any]]:
    """An issue for each field of ``message`` that was sent under a number it declares but
    with another wire type (a float for a double, a double for an int64: a client built from a
    .proto other than ``sde2.v1``'s). protobuf keeps such a field among the unknown ones and
    the message reads the field's default: scored as if it was not sent, where HTTP refuses a
    value of the wrong type. Unknown numbers stay ignored, as protobuf ignores them.

    >>> sent = pb.Weights(oc=2.0).SerializeToString().replace(b"\\x09", b"\\x0d", 1)[:5]
    >>> [i["field"] + ": " + i["msg"] for i in _misread(pb.Weights.FromString(sent), ("w",))]
    ['w.oc: sent as a 32-bit field, declared double (64-bit): send it as sde2.v1 declares it']
    """
    declared = message.DESCRIPTOR.fields_by_number
    issues = []
    unknowns = UnknownFieldSet(message)  # indexed: its stub declares no __iter__
    for unknown in map(unknowns.__getitem__, range(len(unknowns))):
        field = declared.get(unknown.field_number)
        if field is None:
            continue
        wire = _WIRE_NAMES.get(unknown.wire_type, str(unknown.wire_type))
        kind, expected = _DECLARED[field.type]
        msg = f"sent as a {wire} field, declared {kind} ({_WIRE_NAMES[expected]})"
        msg += ": send it as sde2.v1 declares it"
        issues.append(issue((*loc, field.name), msg, "wire_type"))
    return issues
