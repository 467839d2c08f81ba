"""The gRPC front end (``sde2.v1.RewardService``): a translator between messages and the service.

Each call hands the service its request (as the HTTP contract's JSON, see
:mod:`~reward_server.service.grpc_messages`) and its ``authorization`` metadata. Every failure
is a :class:`~reward_server.service.errors.ServiceError`, converted once, by :func:`abort`: its
gRPC code, its message as details, its headers (``retry-after``) as trailing metadata, counted
under the same reason as over HTTP. Codes: INVALID_ARGUMENT (bad input, or bytes that are not
the method's message; the details list each field path), RESOURCE_EXHAUSTED (at capacity),
DEADLINE_EXCEEDED (server deadline or the client's own, whichever is sooner), UNAUTHENTICATED,
UNAVAILABLE (loading or shutting down), INTERNAL (the encoder failed). Phase timings go out as
trailing metadata (``x-parse-time`` … in ms), like the HTTP headers.

The plumbing uses grpc's generic handlers instead of protoc's ``*_pb2_grpc.py`` (which imports
its sibling as a top-level package); :class:`~reward_server.service.grpc_client.RewardStub` is
the matching client. Every method is unary on the wire but served as a request *stream*, read
here: gRPC's core admits a call at its headers, and a unary handler would only run once the
message arrived, so a client sending nothing held its place for good. Read here, the message
must arrive within ``--body-timeout`` (as an HTTP body must), alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc

from reward_server.service.credentials import one_credential
from reward_server.service.errors import (
    BodyTimeout,
    ClientGone,
    DeadlineExceeded,
    RequestInvalid,
    ServiceError,
    ShuttingDown,
)
from reward_server.service.grpc_messages import (
    METHODS,
    OTHER_FIELDS,
    SERVICE,
    Malformed,
    count_items,
    info_to_proto,
    lenient,
    parse_request,
    pb,
    request_to_json,
    scored_to_proto,
)
from reward_server.service.pipeline import ScoringService
from reward_server.service.schemas import ScoreRequest
from reward_server.service.scored import Scored
from reward_server.service.sockets import host_port

Context: TypeAlias = grpc.aio.ServicerContext

#: The methods that score (and so are refused once the server stops).
SCORING_METHODS = ("Score", "Explain")
Reply = TypeVar("Reply", pb.ScoreResponse, pb.ExplainResponse)


def count(service: ScoringService, method: str, exc: ServiceError) -> grpc.StatusCode:
    """Count a call ended by ``exc`` (under its reason, as over HTTP); its gRPC code."""
    code = grpc.StatusCode[exc.grpc_code]
    service.metrics.count(f"grpc:{method}", code.name, exc.reason)
    return code


async def abort(
    service: ScoringService, context: Context, method: str, exc: ServiceError
) -> NoReturn:
    """The gRPC answer to ``exc``, counted: the one conversion of errors on this wire."""
    code = count(service, method, exc)
    if exc.grpc_metadata:
        context.set_trailing_metadata(exc.grpc_metadata)
    await context.abort(code, exc.message)
    raise AssertionError("unreachable: context.abort raises")


class RewardServicer:
    """Handlers of ``sde2.v1.RewardService`` over a :class:`ScoringService`."""

    def __init__(self, service: ScoringService) -> None:
        self.service = service
        self.send_limit = send_limit(service)
        #: Set by :meth:`GrpcFrontEnd.stop`: a scoring call that comes now is refused.
        self.stopping = False
        self._calls = 0  # calls in progress
        self._idle = asyncio.Event()
        self._idle.set()

    def call_began(self, method: str) -> None:
        """Count a call in progress; once stopping, refuse a scoring one (:class:`ShuttingDown`,
        UNAVAILABLE: the proto's code for it, which clients retry on another replica)."""
        if self.stopping and method in SCORING_METHODS:
            raise ShuttingDown("the server is shutting down: send to another replica")
        self._calls += 1
        self._idle.clear()

    def call_ended(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            self._idle.set()

    async def calls_ended(self, timeout: float) -> None:
        """Wait until no call is in progress, or ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    async def _scored(self, data: bytes, context: Context, method: str) -> Scored:
        """The service's answer to a serialized ``ScoreRequest``, with its phase timings as
        trailers. The key is checked before any work on the bytes, and the items are counted in
        them before they are parsed (see :func:`count_items`)."""
        authorization = _authorization(context)
        self.service.authorize(authorization)
        limit = self.service.settings.max_items
        items = count_items(data, stop_after=limit)
        if items is None:
            msg = (
                f"a group, or more than {OTHER_FIELDS} top-level fields besides items: "
                "not a ScoreRequest"
            )
            raise RequestInvalid.one((), msg, "malformed")
        if items > limit:
            msg = f"at most {limit} items per request, got more than {limit}"
            raise RequestInvalid.one(("items",), msg, "too_long")
        request = parse_request(data)
        scored = await self.service.score(
            lambda: ScoreRequest.model_validate_json(request_to_json(request)),
            authorization=authorization,
            size=request.ByteSize,
            timeout=context.time_remaining(),
            explain=method == "Explain",
        )
        context.set_trailing_metadata((*scored.timing_headers(), *scored.warning_headers()))
        return scored

    def _sent(self, method: str, reply: Reply) -> Reply:
        """``reply``, counted as answered, once it fits the messages this server sends: past
        that gRPC would fail it after the work, to a client told nothing of why."""
        size = reply.ByteSize()
        if size > self.send_limit:
            msg = (
                f"the answer is {size} bytes, more than this server's gRPC message limit of "
                f"{self.send_limit}: send fewer items (POST /v1/explain has no such limit)"
            )
            raise RequestInvalid.one(("items",), msg, "answer_too_large")
        self.service.metrics.count(f"grpc:{method}", "OK")
        return reply

    async def Score(self, data: bytes, context: Context) -> pb.ScoreResponse:
        """Score one batch (``POST /v1/score``)."""
        scored = await self._scored(data, context, "Score")
        return self._sent("Score", scored_to_proto(scored))

    async def Explain(self, data: bytes, context: Context) -> pb.ExplainResponse:
        """Score one batch and explain every item (``POST /v1/explain``)."""
        scored = await self._scored(data, context, "Explain")
        explanation = json.dumps(scored.explanation, ensure_ascii=False)
        reply = pb.ExplainResponse(score=scored_to_proto(scored), explanation_json=explanation)
        return self._sent("Explain", reply)

    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        """Encoder, variant, provider, version, defaults and limits (``GET /v1/info``); the
        model's path only to holders of the key when one is set."""
        info = info_to_proto(self.service.info_for(_authorization(context)))
        self.service.metrics.count("grpc:Info", "OK")  # as its refusals are
        return info

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        """SERVING once the model is loaded and warm (``GET /readyz``), until the stop."""
        serving = self.service.ready and not self.stopping
        status = (
            pb.HealthResponse.Status.SERVING if serving else pb.HealthResponse.Status.NOT_SERVING
        )
        return pb.HealthResponse(status=status, encoder=self.service.encoder_name)


def _authorization(context: Context) -> str | None:
    """The credential the call carries (``authorization`` metadata), for the service to check."""
    metadata = context.invocation_metadata() or ()
    return one_credential([str(value) for key, value in metadata if key == "authorization"])


_END = object()  # what `anext` gives back once the client has half-closed its stream

#: How long a call whose stream ended without a message waits before it is refused. gRPC ends
#: the stream of a call that ended otherwise the same way (cancelled by its client, past the
#: client's deadline, or refused by gRPC itself for a message over --max-body-bytes, answered
#: RESOURCE_EXHAUSTED), and cancels the handler only just after: refused at once, such a call
#: would be counted as an invalid request nobody sent.
END_GRACE = 0.1


async def one_message(requests: AsyncIterator[Any], timeout: float) -> Any:
    """The call's request message: the first of its stream, which must then end, all within
    ``timeout`` seconds (:class:`BodyTimeout` past it, INVALID_ARGUMENT for no message or a
    second one). A unary client sends its message and ends its stream at once."""
    try:
        async with asyncio.timeout(timeout):
            message = await anext(requests, _END)
            if message is not _END and await anext(requests, _END) is not _END:
                msg = "more than one request message: each method takes exactly one"
                raise RequestInvalid.one((), msg, "malformed")
    except TimeoutError:
        raise BodyTimeout(timeout) from None
    if message is _END:
        await asyncio.sleep(END_GRACE)  # a call that ended otherwise is cancelled here
        raise RequestInvalid.one((), "the call ended without a request message", "malformed")
    return message


def _translated(
    servicer: RewardServicer, name: str
) -> Callable[[AsyncIterator[Any], Context], Awaitable[Any]]:
    """Method ``name`` of ``servicer`` on its call's one message (:func:`one_message`), its
    :class:`ServiceError` answered by :func:`abort`."""
    method = getattr(servicer, name)
    timeout = servicer.service.settings.body_timeout

    async def handle(requests: AsyncIterator[Any], context: Context) -> Any:
        request: Any = _END
        try:
            servicer.call_began(name)
        except ServiceError as exc:
            await abort(servicer.service, context, name, exc)
        try:
            request = await one_message(requests, timeout)
            if isinstance(request, Malformed):
                raise request.refusal()
            return await method(request, context)
        except ServiceError as exc:
            await abort(servicer.service, context, name, exc)
        except asyncio.CancelledError:
            # gRPC cancels the handler when the client cancels the call or its deadline passes:
            # no answer goes out, but the call is counted, as HTTP counts a client gone (499).
            # Before its message has arrived, a call cancelled otherwise than by the client's
            # deadline may be one gRPC refused itself (a message over --max-body-bytes,
            # RESOURCE_EXHAUSTED, uncounted as it always was): not counted as a client gone.
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            if expired:
                count(servicer.service, name, DeadlineExceeded("the client's deadline passed"))
            elif request is not _END:
                count(servicer.service, name, ClientGone())
            raise
        finally:
            servicer.call_ended()

    return handle


def generic_handler(servicer: RewardServicer) -> grpc.GenericRpcHandler:
    """The method table protoc's ``add_RewardServiceServicer_to_server`` would build (with
    malformed messages answered INVALID_ARGUMENT)."""
    handlers = {
        name: grpc.stream_unary_rpc_method_handler(
            _translated(servicer, name),
            # The scoring methods take their bytes unparsed (see RewardServicer._scored).
            request_deserializer=None if req == "ScoreRequest" else lenient(pb, req),
            response_serializer=getattr(pb, resp).SerializeToString,
        )
        for name, (req, resp) in METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


#: The smallest limit on the messages the server sends (answers may outgrow their request).
MIN_SEND_BYTES = 64 * 1024 * 1024


def send_limit(service: ScoringService) -> int:
    """The largest message the server sends: ``max_body_bytes``, and at least
    :data:`MIN_SEND_BYTES`."""
    return max(service.settings.max_body_bytes, MIN_SEND_BYTES)


#: The largest value a gRPC option takes (a C int): a --body-timeout over 24 days is this.
C_INT = 2**31 - 1

#: Calls in progress beyond the admission queue's capacity (see :func:`create_server`).
GRPC_HEADROOM = 8


@dataclass
class GrpcFrontEnd:
    """The ``grpc.aio`` server of :func:`create_server`, its handlers and its bound port."""

    server: grpc.aio.Server
    servicer: RewardServicer
    port: int
    #: The port is shared with the other workers (``SO_REUSEPORT``).
    shared: bool = False

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, drain: float, grace: float) -> None:
        """The drained stop: the calls in progress get ``drain`` seconds to end, then ``grace``
        more before gRPC cancels them. Meanwhile the port stays open and a new scoring call is
        answered UNAVAILABLE, Health NOT_SERVING: a call arriving on an open connection once
        gRPC's own stop has begun is CANCELLED (details "CANCELLED", no trailers), a code
        clients take for their own cancel and do not retry. A worker sharing its port stops
        listening at once instead: the kernel then hands new connections to the others, where
        a listening worker stopped alone would refuse its share of them."""
        self.servicer.stopping = True
        if not self.shared:
            await self.servicer.calls_ended(drain)
            drain = 0
        await self.server.stop(grace=drain + grace)


def create_server(
    service: ScoringService, host: str, port: int, *, reuse_port: bool = False
) -> GrpcFrontEnd:
    """A started-later ``grpc.aio`` server on ``host:port``, with its bound port."""
    limit = service.settings.max_body_bytes
    server = grpc.aio.server(
        # gRPC's core receives each message whole before a handler runs (HTTP reads a body only
        # once admitted): the calls in progress, and so the messages held, are bounded here;
        # past it gRPC answers RESOURCE_EXHAUSTED itself. The headroom keeps Info and Health
        # answering while the scoring calls fill the queue. (A call counts from its headers:
        # its message must follow within --body-timeout, see `one_message`.)
        maximum_concurrent_rpcs=service.settings.queue_capacity + GRPC_HEADROOM,
        options=[
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", send_limit(service)),
            # gRPC sets TCP_USER_TIMEOUT to this: a client that stops reading its answer (its
            # window stays shut) loses its connection after --body-timeout, as over HTTP, and
            # the call's place and buffered answer with it (gRPC's default holds them 20 s,
            # whatever --body-timeout is).
            (
                "grpc.keepalive_timeout_ms",
                min(max(1, round(service.settings.body_timeout * 1e3)), C_INT),
            ),
        ],
    )
    servicer = RewardServicer(service)
    server.add_generic_rpc_handlers((generic_handler(servicer),))
    try:
        bound = server.add_insecure_port(host_port(host, port))
    except RuntimeError:  # what grpc raises for a port in use
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port} (in use, or not an address here)")
    return GrpcFrontEnd(server, servicer, bound, shared=reuse_port)
