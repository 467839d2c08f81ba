"""What every HTTP scoring route shares: the bounded body read, the call into the service, and
the one conversion of a :class:`~reward_server.service.errors.ServiceError` into a response.

Bodies are read and validated by hand (bounded read, then ``model_validate_json``) rather than by
FastAPI's body parameter, for three reasons: the size limit is enforced while reading (413 before
the whole body is buffered), pydantic's strict JSON parser rejects lone surrogates, and parsing
counts in the ``parse`` phase timing. The body is read only once the service has admitted the
request, so a full server answers 429 at once and the bodies held in memory are bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from functools import cache
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.routing import get_route_path

from reward_server.core import RewardParams, ScoreItem
from reward_server.field_names import printable_path, unencodable_in_json
from reward_server.service.credentials import one_credential
from reward_server.service.errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    RequestInvalid,
    ServiceError,
    UnsupportedEncoding,
    UnsupportedMediaType,
    issue,
)
from reward_server.service.json_values import values_of, values_over
from reward_server.service.pipeline import ScoringService
from reward_server.service.request_checks import LocMap
from reward_server.service.schemas import ErrorResponse, ScoreRequest
from reward_server.service.scored import Scored

Body = TypeVar("Body", bound=BaseModel)

#: The error statuses of a scoring route, for the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong bearer key"},
    408: {"model": ErrorResponse, "description": "body not received within the body timeout"},
    413: {"model": ErrorResponse, "description": "body larger than the server's limit"},
    415: {"model": ErrorResponse, "description": "a Content-Encoding (send the body plain)"},
    422: {"model": ErrorResponse, "description": "invalid input; each issue names its field"},
    429: {"model": ErrorResponse, "description": "at capacity; retry after Retry-After seconds"},
    500: {"model": ErrorResponse, "description": "the encoder failed (never bad input)"},
    503: {"model": ErrorResponse, "description": "deadline passed, model loading or stopping"},
}


class FastJSONResponse(JSONResponse):
    """A JSON response serialized by orjson, much faster than the standard library for a step's
    answer: serializing is a visible share of a step when the encoder costs little (GPU; see
    benchmarks/README.md). Same compact JSON; scoring responses hold only finite floats (the
    scorer refuses others). An integer orjson cannot write (past 64 bits: a parameter such as
    ``length_target`` may be that large) falls back to the standard library instead of failing
    with a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except TypeError:
            return super().render(content)


def service_of(request: Request) -> ScoringService:
    """The service the app was made for (:func:`~reward_server.service.http_app.create_app`)."""
    service: ScoringService = request.app.state.service
    return service


def error_response(exc: ServiceError) -> Response:
    """The HTTP answer to ``exc``: its status, ``{"detail": ...}`` and headers (499 has no
    body: nobody receives it)."""
    if isinstance(exc, ClientGone):
        return Response(status_code=exc.http_status)
    return JSONResponse(
        {"detail": exc.detail}, status_code=exc.http_status, headers=exc.http_headers
    )


def route_label(request: Request) -> str:
    """The route a request is counted under: its path within the app, without the prefix a
    proxy mounts it under (``root_path``: Ray's ``route_prefix``), as ``sde2-reward serve``
    names it."""
    return get_route_path(request.scope)


async def answer_service_error(request: Request, exc: Exception) -> Response:
    """The app's one exception handler for :class:`ServiceError`: count it, answer it."""
    assert isinstance(exc, ServiceError)
    service_of(request).metrics.count(route_label(request), str(exc.http_status), exc.reason)
    return error_response(exc)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refusing (before buffering it) a compressed one (:class:`UnsupportedEncoding`),
    anything over ``limit`` bytes (:class:`BodyTooLarge`) and a body not all received within
    ``timeout`` seconds (:class:`BodyTimeout`: a stalled upload holds its slot at most this long);
    :class:`ClientGone` when the client disconnects first."""

    async def read() -> bytes:
        body_format_refusal(request.headers)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise BodyTimeout(timeout) from None


def body_format_refusal(headers: Headers) -> None:
    """:class:`UnsupportedEncoding` for a ``Content-Encoding`` other than ``identity`` or a
    ``Transfer-Encoding`` other than ``chunked`` (every header line and comma-separated entry
    counts: HTTP reads two lines as one list), and
    :class:`UnsupportedMediaType` for a body not declared as UTF-8 JSON.

    >>> two_lines = [(b"content-encoding", b"identity"), (b"content-encoding", b"gzip")]
    >>> body_format_refusal(Headers(raw=two_lines[:1]))
    >>> body_format_refusal(Headers(raw=two_lines))
    Traceback (most recent call last):
    ...
    reward_server.service.errors.UnsupportedEncoding: Content-Encoding 'gzip' is not accepted: ...
    >>> body_format_refusal(Headers({"transfer-encoding": "gzip, chunked"}))
    Traceback (most recent call last):
    ...
    reward_server.service.errors.UnsupportedEncoding: Transfer-Encoding 'gzip' is not accepted: ...
    >>> body_format_refusal(Headers({"content-type": "Application/JSON;charset=UTF-8"}))
    >>> body_format_refusal(Headers({"content-type": "text/plain"}))
    Traceback (most recent call last):
    ...
    reward_server.service.errors.UnsupportedMediaType: Content-Type 'text/plain' is not JSON: ...

    A body without a ``Content-Type`` is read as JSON (as FastAPI does: ``curl --data-binary``,
    ``requests.post(data=...)``), unless a browser sent it for a page of another site (its
    ``Sec-Fetch-Site``, or an ``Origin`` from a browser too old to send that): a typeless
    ``Blob`` posted by such a page needs no permission from the server.

    >>> body_format_refusal(Headers({"sec-fetch-site": "same-origin"}))
    >>> body_format_refusal(Headers({"sec-fetch-site": "cross-site"}))
    Traceback (most recent call last):
    ...
    reward_server.service.errors.UnsupportedMediaType: a body without Content-Type from a page ...
    """
    for header, undone in _CODINGS_UNDONE.items():
        codings = (e.strip().lower() for v in headers.getlist(header) for e in v.split(","))
        refused = [e for e in codings if e not in undone]
        if refused:
            raise UnsupportedEncoding(", ".join(refused), header.title())
    problem = _media_type_problem(headers)
    if problem is not None:
        raise UnsupportedMediaType(problem)


#: The codings each header may name: what the server undoes (the HTTP layer decodes chunked
#: transfers) or what changes nothing. ``Transfer-Encoding: gzip, chunked`` had its gzip
#: silently left on the body, read as JSON.
_CODINGS_UNDONE = {
    "content-encoding": ("identity", ""),
    "transfer-encoding": ("chunked", "identity", ""),
}


def _media_type_problem(headers: Headers) -> str | None:
    """Why the body's declared type is refused (:func:`body_format_refusal`), or None."""
    types = headers.getlist("content-type")
    if len(types) > 1:
        return f"Content-Type given {len(types)} times"
    if not types:
        site = headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site") or (site is None and "origin" in headers):
            return "a body without Content-Type from a page of another site"
        return None
    media, *parameters = (part.strip().lower() for part in types[0].split(";"))
    kind, _, subtype = media.partition("/")
    structured = subtype.endswith("+json") and subtype != "+json"  # application/problem+json
    if kind != "application" or not (subtype == "json" or structured):
        return f"Content-Type {types[0]!r} is not JSON"
    # A parameter is name=value; spaces around the "=" are not RFC 9110's, but a sender that
    # writes them means the charset all the same.
    charsets = [
        value.strip().strip('"')
        for name, _, value in (p.partition("=") for p in parameters)
        if name.strip() == "charset"
    ]
    if any(c not in ("utf-8", "utf8") for c in charsets):
        return f"Content-Type {types[0]!r}: JSON is read as UTF-8 (RFC 8259)"
    return None


#: ASGI scope extension: when a relay in front of this app received the request (``time.time()``,
#: Ray's ingress sets it), so that the request's deadline counts the time before it arrived here.
RECEIVED_AT = "sde2.received_at"


def time_left(request: Request, request_timeout: float) -> float | None:
    """Seconds left of ``request_timeout`` since a relay received the request (see
    :data:`RECEIVED_AT`); None when it came straight to this app (its clock starts here)."""
    received = request.scope.get("extensions", {}).get(RECEIVED_AT)
    return None if received is None else request_timeout - (time.time() - float(received))


async def run_scoring(
    request: Request,
    parse_body: Callable[[bytes], ScoreRequest | None],
    *,
    loc_map: LocMap | None = None,
    explain: bool = False,
    query: Collection[str] = (),
) -> Scored:
    """Score the request's body (read once admitted, bounded in size and time); raises a
    :class:`ServiceError`, which the app's handler answers. ``query``: the query parameters
    the route reads; any other is refused with the body's other faults (a misspelt
    ``?answer-type=choice`` silently scored with the default matcher)."""
    service = service_of(request)
    refused = query_refusal([name for name, _ in request.query_params.multi_items()], query)
    settings = service.settings
    body = b""
    received = False

    async def receive() -> None:
        nonlocal body, received
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
        received = True

    async def gone() -> None:
        # Once the body is read, the next ASGI message is the client's disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def parse() -> ScoreRequest | None:
        if refused is not None:
            raise refused
        if (too_many := value_refusal(body, settings.max_items)) is not None:
            raise too_many
        return parse_body(body)

    try:
        return await service.score(
            parse,
            authorization=one_credential(request.headers.getlist("authorization")),
            receive=receive,
            gone=gone,
            size=lambda: len(body),
            loc_map=loc_map,
            timeout=time_left(request, settings.request_timeout),
            explain=explain,
        )
    except ServiceError as exc:
        if not received:  # refused before its body was read whole (401, 413, 429...)
            # Kept alive, the connection would have its unread body drained by the server,
            # past every limit (measurements: benchmarks/README.md, the service's design):
            # the answer closes it instead.
            exc.headers["Connection"] = "close"
        raise


def query_refusal(names: Sequence[str], known: Collection[str]) -> RequestInvalid | None:
    """The 422 for the query parameters ``names`` (in order, repeats kept) of a route that
    reads ``known``: each one it does not read, and each given twice (the last one won), named
    at ``query.NAME``; None when there is nothing to refuse.

    >>> query_refusal(["answer-type"], ["recipe", "answer_type"]).message
    'query.answer-type: not a parameter of this route (it reads recipe, answer_type)'
    >>> query_refusal(["recipe"], []).message
    'query.recipe: not a parameter of this route (it reads none: parameters go in the body)'
    >>> query_refusal(["recipe", "recipe"], ["recipe"]).message
    'query.recipe: given 2 times: give it once'
    >>> query_refusal(["recipe"], ["recipe"]) is None
    True
    >>> len(query_refusal([str(i) for i in range(1000)], []).issues)  # errors.MAX_ISSUES
    20
    """
    reads = ", ".join(known) if known else "none: parameters go in the body"
    issues: list[dict[str, Any]] = []
    for name in dict.fromkeys(names):  # RequestInvalid keeps the first MAX_ISSUES
        if name not in known:
            msg = f"not a parameter of this route (it reads {reads})"
            issues.append(issue(("query", name), msg, "unknown_query"))
        elif (times := names.count(name)) > 1:
            issues.append(issue(("query", name), f"given {times} times: give it once", "repeated"))
    return RequestInvalid(issues) if issues else None


@cache  # once per limit, not per request: it builds the default parameters
def max_values(max_items: int) -> int:
    """The most JSON values a scoring body may hold: twice what the fullest accepted request
    holds (the root, each field of the request and of its parameters, and ``max_items`` items
    with every field; an OpenRLHF body holds three values a sample). The margin leaves a body
    a little over the item limit to the schema, whose refusal names the field (``items``).

    >>> max_values(1024)
    12340
    """
    fields = dict.fromkeys(ScoreRequest.model_fields) | {"params": RewardParams().model_dump()}
    item = dict.fromkeys(f.name for f in dataclasses.fields(ScoreItem))
    return 2 * (values_of(fields) + max_items * values_of(item))


def value_refusal(body: bytes, max_items: int) -> RequestInvalid | None:
    """The 422 for a body holding more JSON values than :func:`max_values`, before the parser
    builds them (see :mod:`~reward_server.service.json_values`); None for the others.

    >>> value_refusal(b'{"items": [' + b"{}, " * 2000 + b'{}]}', 8).message
    'body: 2003 JSON values, over the limit of 148 (twice what 8 items hold with every field): \
send at most 8 items per request, with only the fields the API documents'
    """
    limit = max_values(max_items)
    count = values_over(body, limit)
    if count is None:
        return None
    msg = (
        f"{count} JSON values, over the limit of {limit} (twice what {max_items} items hold "
        f"with every field): send at most {max_items} items per request, with only the "
        "fields the API documents"
    )
    return RequestInvalid.one((), msg, "too_many_values")


def scored_response(
    request: Request,
    scored: Scored,
    content: Any,
    response_class: type[JSONResponse] = JSONResponse,
) -> Response:
    """A 200 answer with the phase timings as ``x-<phase>-time`` headers (ms) and the batch's
    warnings as ``x-sde2-warning`` headers, counted."""
    service_of(request).metrics.count(route_label(request), "200")
    response = response_class(content, headers=dict(scored.timing_headers()))
    for name, value in scored.warning_headers():
        response.headers.append(name, value)
    return response


def parse_score(body: bytes) -> ScoreRequest:
    """A SPEC §6 scoring body."""
    return validated(ScoreRequest, body)


def validated(model: type[Body], body: bytes) -> Body:
    """``body`` validated as ``model``. pydantic refuses a string holding a lone surrogate
    escape or a byte UTF-8 does not allow as invalid JSON at a line and column, naming no
    field; that refusal names the field instead (:func:`unencodable_refusal`)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        refusal = unencodable_refusal(exc, body)
        if refusal is None:
            raise
        raise refusal from None


def unencodable_refusal(exc: ValidationError, body: bytes) -> RequestInvalid | None:
    r"""The 422 naming the string that made ``body`` invalid JSON for holding what UTF-8
    cannot carry, or None when that is not why (:func:`unencodable_in_json`; read only once
    the body is refused, and over a body within the server's value limit).

    >>> try:
    ...     ScoreRequest.model_validate_json(b'{"items": [{"completion": "x\\ud800"}]}')
    ... except ValidationError as exc:
    ...     unencodable_refusal(exc, b'{"items": [{"completion": "x\\ud800"}]}').issues[0]["field"]
    'items.0.completion'
    """
    if exc.errors(include_url=False, include_input=False)[0]["type"] != "json_invalid":
        return None
    found = unencodable_in_json(body)
    if found is None:
        return None
    path, at = found
    return RequestInvalid.not_utf8(printable_path(path), at)


#: The route description ``/v1/score`` and its siblings share (errors, documented body).
SCORE_DOC: dict[str, Any] = {
    "responses": ERROR_RESPONSES,
    "openapi_extra": {"x-sde2-body": "ScoreRequest"},
}
