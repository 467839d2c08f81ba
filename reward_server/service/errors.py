"""Every way a request can fail, once: the service raises these, each transport converts them.

Each class says everything a transport needs to answer it (the role of text-embeddings-inference's
``TextEmbeddingsError`` and its ``From`` conversions): a stable ``reason`` (the
``sde2_failures_total`` label, the same over every transport), the HTTP status, the gRPC status
code (by name, so this module needs no grpc), the field at fault when there is one, the message,
and extra headers such as ``Retry-After``. HTTP answers ``{"detail": ...}`` with
:attr:`ServiceError.detail`; gRPC aborts with :attr:`ServiceError.grpc_code` and
:attr:`ServiceError.message`, the headers going out as trailing metadata. Where the two wires
legitimately differ (a 422's issue list against one gRPC details string), the class says both.

:func:`error_classes` lists every class by reason: the error-mapping test is enumerated from it,
so a new reason without a row there fails.
"""

from __future__ import annotations

from typing import Any, ClassVar

from reward_server.field_names import not_utf8

#: Most validation issues reported for one request (a 10k-item batch of wrong types would
#: otherwise produce a response larger than the request).
MAX_ISSUES = 20

Loc = tuple[str | int, ...]


def issue(loc: Loc, msg: str, kind: str) -> dict[str, Any]:
    """One validation issue in the wire shape (``loc`` list plus a dotted ``field``), a name
    longer than :data:`MAX_NAME` cut (:func:`short_name`).

    >>> issue(("items", 3, "completion"), "too long", "too_long")["field"]
    'items.3.completion'
    """
    named = tuple(map(short_name, loc))
    field = ".".join(map(str, named)) or "body"
    return {"loc": list(named), "field": field, "msg": msg, "type": kind}


#: The longest field name an issue repeats whole: a body's unknown keys are the client's own
#: text, and repeated whole, a few long keys would make a 422 larger than the request itself
#: (measurements: benchmarks/README.md, the service's design).
MAX_NAME = 64


def short_name(part: str | int) -> str | int:
    """``part`` of a field's path; past :data:`MAX_NAME` characters, its first 48 and its length.

    >>> short_name("k" * 100)
    'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk... (100 characters)'
    >>> short_name(3), short_name("params")
    (3, 'params')
    """
    if isinstance(part, int) or len(part) <= MAX_NAME:
        return part
    return f"{part[:48]}... ({len(part)} characters)"


def wire_kind(kind: str, msg: str) -> tuple[str, str]:
    """A validation error's type and message as every wire and the offline commands name them.
    An unknown field is ``extra_forbidden`` at every level: an item, a validating dataclass,
    reports it as an unexpected keyword argument, which the wire has none of.

    >>> wire_kind("unexpected_keyword_argument", "Unexpected keyword argument")
    ('extra_forbidden', 'Extra inputs are not permitted')
    >>> wire_kind("string_type", "Input should be a valid string")
    ('string_type', 'Input should be a valid string')
    """
    return _WIRE_KINDS.get(kind, (kind, msg))


#: pydantic error types the wire names otherwise: (type, message).
_WIRE_KINDS = {"unexpected_keyword_argument": ("extra_forbidden", "Extra inputs are not permitted")}


class ServiceError(Exception):
    """A request the service cannot answer with a result (subclasses set the class fields)."""

    #: The ``sde2_failures_total`` label: stable, the same over HTTP and gRPC.
    reason: ClassVar[str]
    http_status: ClassVar[int]
    #: A ``grpc.StatusCode`` member's name.
    grpc_code: ClassVar[str]

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: Sent as HTTP headers and as gRPC trailing metadata (lower-cased there).
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def field(self) -> str | None:
        """The dotted path of the field at fault, when one is."""
        return None

    @property
    def detail(self) -> Any:
        """The HTTP body's ``detail``."""
        return self.message

    @property
    def http_headers(self) -> dict[str, str]:
        """Headers of the HTTP answer (transport-only ones included, e.g. ``Connection``)."""
        return self.headers

    @property
    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of the gRPC answer."""
        return tuple((k.lower(), v) for k, v in self.headers.items())


class RequestInvalid(ServiceError):
    """Bad input, with every issue's field path (the first :data:`MAX_ISSUES` of them, wherever
    they were found, so that no answer outgrows its request). HTTP's ``detail`` is the issue
    list; gRPC's details string joins ``field: msg`` of each (gRPC has no structured details
    here).

    >>> len(RequestInvalid([issue(("items", i), "bad", "x") for i in range(5000)]).issues)
    20
    """

    reason = "invalid"
    http_status = 422
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, issues: list[dict[str, Any]]) -> None:
        issues = issues[:MAX_ISSUES]
        super().__init__("; ".join(f"{i['field']}: {i['msg']}" for i in issues))
        self.issues = issues

    @classmethod
    def one(cls, loc: Loc, msg: str, kind: str) -> RequestInvalid:
        """A single issue at ``loc``."""
        return cls([issue(loc, msg, kind)])

    @classmethod
    def not_utf8(cls, loc: Loc, at: int) -> RequestInvalid:
        r"""The string at ``loc`` is not valid UTF-8 from its character ``at`` on: HTTP's JSON
        and gRPC's protobuf parsers both refuse it naming no field, and both transports
        answer it with these words (written once, so that they stay the same).

        >>> refusal = RequestInvalid.not_utf8(("items", 1, "completion"), 3)
        >>> refusal.field, refusal.issues[0]["type"]
        ('items.1.completion', 'string_unicode')
        >>> print(*refusal.issues[0]["msg"].split(": "), sep="\n")
        not valid UTF-8 at character 3
        a lone surrogate (\ud800-\udfff) or a byte UTF-8 does not allow; send text as UTF-8
        """
        return cls.one(loc, f"{not_utf8(at)}; send text as UTF-8", "string_unicode")

    @property
    def field(self) -> str | None:
        return str(self.issues[0]["field"]) if self.issues else None

    @property
    def detail(self) -> Any:
        return self.issues


class Unauthorized(ServiceError):
    """No or wrong bearer key while one is set."""

    reason = "unauthorized"
    http_status = 401
    grpc_code = "UNAUTHENTICATED"

    def __init__(self, message: str = "missing or wrong bearer key") -> None:
        super().__init__(message)

    @property
    def http_headers(self) -> dict[str, str]:
        return {**self.headers, "WWW-Authenticate": "Bearer"}


class BodyTooLarge(ServiceError):
    """The body exceeds ``max_body_bytes`` (refused while reading). gRPC refuses such a message
    itself (``grpc.max_receive_message_length``) with the code declared here."""

    reason = "body_too_large"
    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")


class UnsupportedEncoding(ServiceError):
    """A body sent with a ``Content-Encoding`` (gzip, br...), or a ``Transfer-Encoding`` other
    than ``chunked`` (the server undoes that one only): the server reads JSON as sent, so a
    compressed body would be refused as invalid JSON naming nothing, and a plain one labelled
    compressed would be scored. gRPC negotiates its own compression; the class declares a code for
    completeness."""

    reason = "unsupported_encoding"
    http_status = 415
    grpc_code = "UNIMPLEMENTED"

    def __init__(self, encoding: str, header: str = "Content-Encoding") -> None:
        super().__init__(f"{header} {encoding!r} is not accepted: send the JSON body uncompressed")


class UnsupportedMediaType(ServiceError):
    """A body not declared as UTF-8 JSON (``text/plain``, a form, ``charset=latin-1``...), or
    declared as nothing by a web page of another site (which :func:`~reward_server.service.
    http_scoring.body_format_refusal` tells). Such bodies are what any web page may send to
    any server without asking it first: scored when they hold JSON, they would let a page
    spend a key-less server's compute. HTTP only; gRPC's code is declared for completeness."""

    reason = "unsupported_media_type"
    http_status = 415
    grpc_code = "UNIMPLEMENTED"

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}: send the body as JSON, Content-Type: application/json")


class BodyTimeout(ServiceError):
    """The body did not arrive within ``body_timeout`` seconds after admission (a stalled or too
    slow upload; HTTP closes the connection), or a gRPC call's message within as long after the
    call began."""

    reason = "body_timeout"
    http_status = 408
    grpc_code = "DEADLINE_EXCEEDED"

    def __init__(self, timeout: float) -> None:
        super().__init__(f"request body not received within {timeout:g} s (--body-timeout)")

    @property
    def http_headers(self) -> dict[str, str]:
        return {**self.headers, "Connection": "close"}


class ClientGone(ServiceError):
    """The client disconnected (mid-upload, or while its texts waited for the encoder): nobody
    reads the answer, but it is counted (HTTP as nginx's 499 "client closed request", without a
    body; gRPC as CANCELLED)."""

    reason = "client_disconnect"
    http_status = 499
    grpc_code = "CANCELLED"

    def __init__(self, message: str = "client disconnected") -> None:
        super().__init__(message)


class Overloaded(ServiceError):
    """At capacity; ``retry_after`` is a whole number of seconds to wait."""

    reason = "overloaded"
    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, retry_after: int, message: str | None = None) -> None:
        text = message or f"server at capacity, retry after {retry_after} s"
        super().__init__(text, headers={"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its result was ready."""

    reason = "deadline"
    http_status = 503
    grpc_code = "DEADLINE_EXCEEDED"


class NotReady(ServiceError):
    """The model is still loading (or failed to load)."""

    reason = "not_ready"
    http_status = 503
    grpc_code = "UNAVAILABLE"

    @property
    def detail(self) -> Any:
        return f"not ready: {self.message}"


class ShuttingDown(ServiceError):
    """The server is stopping and accepts no new work."""

    reason = "shutting_down"
    http_status = 503
    grpc_code = "UNAVAILABLE"


class EncoderFailed(ServiceError):
    """The encoder raised: the server's fault, never the input's (a 500 that says so)."""

    reason = "encoder"
    http_status = 500
    grpc_code = "INTERNAL"

    @property
    def detail(self) -> Any:
        return f"encoder failed: {self.message}"


class MathUnavailable(ServiceError):
    """The math checker's processes cannot start: the server's fault, never the input's."""

    reason = "math_unavailable"
    http_status = 500
    grpc_code = "INTERNAL"


class ReplicaLost(ServiceError):
    """Under Ray Serve: every try ended with the scorer replica gone; worth retrying later."""

    reason = "replica_lost"
    http_status = 503
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


def error_classes() -> dict[str, type[ServiceError]]:
    """Every concrete error class (one that sets ``reason``), by reason; two classes sharing a
    reason is a programming error."""
    found: list[type[ServiceError]] = []
    pending: list[type[ServiceError]] = [ServiceError]
    while pending:
        cls = pending.pop()
        if "reason" in cls.__dict__:
            found.append(cls)
        pending.extend(cls.__subclasses__())
    by_reason = {cls.reason: cls for cls in found}
    if len(by_reason) != len(found):
        raise RuntimeError(f"two error classes share a reason: {sorted(c.reason for c in found)}")
    return by_reason


__all__ = [
    "MAX_ISSUES",
    "BodyTimeout",
    "BodyTooLarge",
    "ClientGone",
    "DeadlineExceeded",
    "EncoderFailed",
    "Loc",
    "NotReady",
    "Overloaded",
    "ReplicaLost",
    "RequestInvalid",
    "ServiceError",
    "ShuttingDown",
    "Unauthorized",
    "UnsupportedEncoding",
    "UnsupportedMediaType",
    "error_classes",
    "issue",
]
