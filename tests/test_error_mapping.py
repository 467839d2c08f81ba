"""Every error reason over every transport: one table, enumerated from the error hierarchy.

:data:`ROWS` holds, per reason of :func:`~reward_server.service.errors.error_classes`, the HTTP
answer (status, headers, ``{"detail": ...}``) and the gRPC answer (code, details, trailing
metadata) of the contract (README's status table, SPEC §6). A reason added to the hierarchy
without a row here fails :func:`test_the_table_covers_every_reason`.

Two kinds of checks, both through the real transports (the FastAPI app over HTTP, a ``grpc.aio``
server in process), never through the conversion function alone:

* every reason x {HTTP route, gRPC method}: the service raises the error, the wire shows the row;
* every reason a transport can meet by itself is also provoked for real (bad input, a missing
  key, a full queue, an unloaded or stopped service, a failing encoder, an oversized body).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from reward_server.service.errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    DeadlineExceeded,
    EncoderFailed,
    MathUnavailable,
    NotReady,
    Overloaded,
    ReplicaLost,
    RequestInvalid,
    ServiceError,
    ShuttingDown,
    Unauthorized,
    UnsupportedEncoding,
    UnsupportedMediaType,
    error_classes,
    issue,
)
from reward_server.service.grpc_client import request_from_dict
from reward_server.service.grpc_messages import pb
from reward_server.service.pipeline import ScoringService
from tests.doubles import HashEncoder
from tests.service_fixtures import Running, SlowEncoder, http_client, make_service, make_settings

ISSUE = issue(("items", 0, "completion"), "Input should be a valid string", "string_type")


@dataclass(frozen=True)
class Row:
    """One reason's contract on both wires."""

    error: Callable[[], ServiceError]
    http_status: int
    #: The HTTP body, or None for no body (499: nobody receives it).
    http_detail: Any
    grpc_code: grpc.StatusCode
    grpc_details: str
    #: Headers that must be on the HTTP answer (names lower-case).
    http_headers: dict[str, str] = field(default_factory=dict)
    grpc_metadata: dict[str, str] = field(default_factory=dict)


MEDIA_TYPE_MESSAGE = (
    "Content-Type 'text/plain' is not JSON: send the body as JSON, Content-Type: application/json"
)

ROWS: dict[str, Row] = {
    "invalid": Row(
        lambda: RequestInvalid([ISSUE]),
        422,
        [ISSUE],
        grpc.StatusCode.INVALID_ARGUMENT,
        "items.0.completion: Input should be a valid string",
    ),
    "unauthorized": Row(
        Unauthorized,
        401,
        "missing or wrong bearer key",
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong bearer key",
        http_headers={"www-authenticate": "Bearer"},
    ),
    "body_too_large": Row(
        lambda: BodyTooLarge(100),
        413,
        "request body larger than 100 bytes",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "request body larger than 100 bytes",
    ),
    "unsupported_encoding": Row(
        lambda: UnsupportedEncoding("gzip"),
        415,
        "Content-Encoding 'gzip' is not accepted: send the JSON body uncompressed",
        grpc.StatusCode.UNIMPLEMENTED,
        "Content-Encoding 'gzip' is not accepted: send the JSON body uncompressed",
    ),
    "unsupported_media_type": Row(
        lambda: UnsupportedMediaType("Content-Type 'text/plain' is not JSON"),
        415,
        MEDIA_TYPE_MESSAGE,
        grpc.StatusCode.UNIMPLEMENTED,
        MEDIA_TYPE_MESSAGE,
    ),
    "body_timeout": Row(
        lambda: BodyTimeout(1.5),
        408,
        "request body not received within 1.5 s (--body-timeout)",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "request body not received within 1.5 s (--body-timeout)",
        http_headers={"connection": "close"},
    ),
    "client_disconnect": Row(
        ClientGone,
        499,
        None,
        grpc.StatusCode.CANCELLED,
        "client disconnected",
    ),
    "overloaded": Row(
        lambda: Overloaded(3),
        429,
        "server at capacity, retry after 3 s",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "server at capacity, retry after 3 s",
        http_headers={"retry-after": "3"},
        grpc_metadata={"retry-after": "3"},
    ),
    "deadline": Row(
        lambda: DeadlineExceeded("request deadline passed while encoding"),
        503,
        "request deadline passed while encoding",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "request deadline passed while encoding",
    ),
    "not_ready": Row(
        lambda: NotReady("the model is loading"),
        503,
        "not ready: the model is loading",
        grpc.StatusCode.UNAVAILABLE,
        "the model is loading",
    ),
    "shutting_down": Row(
        lambda: ShuttingDown("the server is shutting down"),
        503,
        "the server is shutting down",
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down",
    ),
    "encoder": Row(
        lambda: EncoderFailed("RuntimeError: boom"),
        500,
        "encoder failed: RuntimeError: boom",
        grpc.StatusCode.INTERNAL,
        "RuntimeError: boom",
    ),
    "math_unavailable": Row(
        lambda: MathUnavailable("cannot check math answers: the math checker exited with 1"),
        500,
        "cannot check math answers: the math checker exited with 1",
        grpc.StatusCode.INTERNAL,
        "cannot check math answers: the math checker exited with 1",
    ),
    "replica_lost": Row(
        lambda: ReplicaLost("scorer replica lost (3 tries)"),
        503,
        "scorer replica lost (3 tries)",
        grpc.StatusCode.UNAVAILABLE,
        "scorer replica lost (3 tries)",
        http_headers={"retry-after": "1"},
        grpc_metadata={"retry-after": "1"},
    ),
}
#: Two wrong strategies: the request needs the encoder (a deadline or an encoder failure can
#: hit it).
COMPLETION = "".join(
    f"<strategy><reasoning>way {j}</reasoning><strategy_outcome>{j}</strategy_outcome></strategy>"
    for j in (2, 3)
)
ONE_ITEM = {"items": [{"completion": COMPLETION, "answer": "1"}]}
OPENRLHF = {"query": ["Q: " + COMPLETION], "prompts": ["Q:"], "labels": ["1"]}
#: The scoring routes: each goes through the service (and its errors) the same way.
HTTP_ROUTES = (("/v1/score", ONE_ITEM), ("/get_reward", OPENRLHF), ("/v1/explain", ONE_ITEM))
GRPC_METHODS = ("Score", "Explain")


def test_the_table_covers_every_reason() -> None:
    classes = error_classes()
    assert set(ROWS) == set(classes)
    for reason, row in ROWS.items():
        error = row.error()
        assert type(error) is classes[reason] and error.reason == reason
        # The row agrees with what the class declares (so the transports test the class).
        assert (error.http_status, error.grpc_code) == (row.http_status, row.grpc_code.name)


def count(service: ScoringService, sample: str) -> float:
    """A sample's value in the service's Prometheus text (0 when absent)."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", service.metrics.render().decode(), re.M)
    return float(found.group(1)) if found else 0.0


def failures(service: ScoringService, reason: str) -> float:
    return count(service, f'sde2_failures_total{{reason="{reason}"}}')


def raising(error: Callable[[], ServiceError]) -> Callable[..., Any]:
    async def score(*args: Any, **kwargs: Any) -> Any:
        raise error()

    return score


def check_http(r: Any, row: Row) -> None:
    assert r.status_code == row.http_status, r.text[:300]
    if row.http_detail is None:
        assert r.content == b""
    else:
        assert r.json() == {"detail": row.http_detail}
    for name, value in row.http_headers.items():
        assert r.headers.get(name) == value, (name, dict(r.headers))
    if "retry-after" not in row.http_headers:
        assert "retry-after" not in r.headers


def check_grpc(err: grpc.aio.AioRpcError, row: Row) -> None:
    assert err.code() == row.grpc_code
    assert err.details() == row.grpc_details
    trailers = dict(err.trailing_metadata() or ())
    for name, value in row.grpc_metadata.items():
        assert trailers.get(name) == value
    if "retry-after" not in row.grpc_metadata:
        assert "retry-after" not in trailers


@pytest.mark.parametrize("reason", sorted(ROWS))
def test_http_answers_each_reason(reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    row = ROWS[reason]
    service = make_service()
    monkeypatch.setattr(service, "score", raising(row.error))
    with http_client(service) as client:
        for path, body in HTTP_ROUTES:
            check_http(client.post(path, json=body), row)
            sample = f'sde2_requests_total{{route="{path}",status="{row.http_status}"}}'
            assert count(service, sample) == 1
    assert failures(service, reason) == len(HTTP_ROUTES)


@pytest.mark.parametrize("reason", sorted(ROWS))
async def test_grpc_answers_each_reason(reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    row = ROWS[reason]
    service = make_service()
    monkeypatch.setattr(service, "score", raising(row.error))
    async with Running(service) as running:
        for method in GRPC_METHODS:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(running.stub, method)(request_from_dict(ONE_ITEM))
            check_grpc(err.value, row)
            sample = f'sde2_requests_total{{route="grpc:{method}",status="{row.grpc_code.name}"}}'
            assert count(service, sample) == 1
    assert failures(service, reason) == len(GRPC_METHODS)


# --- the same reasons, provoked for real --------------------------------------------------------


class FailingEncoder(HashEncoder):
    """Encodes the warm-up, then fails every call (the encoder's fault, not the input's)."""

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if list(texts) != ["warm up"]:
            raise RuntimeError("boom")
        return super().encode(texts)


@contextlib.contextmanager
def held_admission(service: ScoringService) -> Iterator[None]:
    """Every admission slot taken (``queue_capacity=1``): the next request is over capacity."""
    assert service.batcher is not None
    with service.batcher.admit():
        yield


def unloaded() -> ScoringService:
    """A service whose model failed to load: it never becomes ready."""

    def load() -> HashEncoder:
        raise OSError("no model here")

    service = ScoringService(make_settings(), loader=load)
    service.start(background=False)
    assert not service.ready
    return service


def stopped() -> ScoringService:
    service = make_service()
    assert service.batcher is not None
    service.batcher.close(timeout=5)
    return service


@dataclass(frozen=True)
class Provoked:
    """A service and a request that meet ``reason`` without any injection."""

    service: Callable[[], ScoringService]
    body: dict[str, Any] = field(default_factory=lambda: ONE_ITEM)
    hold: Callable[[ScoringService], contextlib.AbstractContextManager[None]] | None = None


BAD_PARAM = {**ONE_ITEM, "params": {"similarity_threshold": 2.0}}
PROVOKED: dict[str, Provoked] = {
    "invalid": Provoked(make_service, BAD_PARAM),
    "unauthorized": Provoked(lambda: make_service(api_key="k3y")),
    "overloaded": Provoked(lambda: make_service(queue_capacity=1), hold=held_admission),
    "not_ready": Provoked(unloaded),
    "shutting_down": Provoked(stopped),
    "encoder": Provoked(lambda: make_service(FailingEncoder())),
    "deadline": Provoked(lambda: make_service(SlowEncoder(0.5), request_timeout=0.1)),
}
#: What the transports alone meet: the body limits exist on HTTP only (gRPC refuses an
#: oversized message itself, see test_body_too_large_on_both_wires); a lost replica only under
#: Ray (tests/test_ray_serve.py); a stalled upload and a vanished client on HTTP only
#: (tests/test_hostile_clients.py); a math checker that cannot start in test_math_service.
#: Provoked where their transport is (test_http, test_hostile_inputs, test_hostile_clients,
#: test_ray_serve).
NOT_PROVOKED_HERE = {
    "math_unavailable",
    "body_too_large",
    "body_timeout",
    "client_disconnect",
    "replica_lost",
    "unsupported_encoding",
    "unsupported_media_type",
}


def test_every_reason_is_provoked_somewhere() -> None:
    assert set(PROVOKED) | NOT_PROVOKED_HERE == set(ROWS)


@pytest.mark.parametrize("reason", sorted(PROVOKED))
def test_http_meets_each_reason(reason: str) -> None:
    case, row = PROVOKED[reason], ROWS[reason]
    service = case.service()
    hold = case.hold(service) if case.hold else contextlib.nullcontext()
    with http_client(service) as client, hold:
        r = client.post("/v1/score", json=case.body)
    assert r.status_code == row.http_status, r.text[:300]
    if isinstance(row.http_detail, list):
        assert r.json()["detail"][0]["field"] == "params.similarity_threshold"
    else:
        assert isinstance(r.json()["detail"], str)
    for name in row.http_headers:
        assert name in r.headers
    assert failures(service, reason) == 1
    service.close()


@pytest.mark.parametrize("reason", sorted(PROVOKED))
async def test_grpc_meets_each_reason(reason: str) -> None:
    case, row = PROVOKED[reason], ROWS[reason]
    service = case.service()
    async with Running(service) as running:
        hold = case.hold(service) if case.hold else contextlib.nullcontext()
        with hold, pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(request_from_dict(case.body))
    assert err.value.code() == row.grpc_code
    if reason == "invalid":
        assert (err.value.details() or "").startswith("params.similarity_threshold:")
    for name in row.grpc_metadata:
        assert name in dict(err.value.trailing_metadata() or ())
    assert failures(service, reason) == 1  # the same reason as over HTTP
    service.close()


async def test_body_too_large_on_both_wires() -> None:
    """HTTP refuses while reading (413, counted); gRPC refuses the message itself with the code
    :class:`BodyTooLarge` declares."""
    service = make_service(max_body_bytes=2048)
    big = {"items": [{"completion": "z" * 5000, "answer": "1"}]}
    with http_client(service) as client:
        r = client.post("/v1/score", json=big)
    assert r.status_code == BodyTooLarge.http_status == 413
    assert r.json() == {"detail": "request body larger than 2048 bytes"}
    assert failures(service, "body_too_large") == 1
    async with Running(service) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(request_from_dict(big))
    assert err.value.code().name == BodyTooLarge.grpc_code
    service.close()


def test_info_not_ready_is_the_same_error_on_both_wires() -> None:
    service = unloaded()
    with http_client(service) as client:
        r = client.get("/v1/info")
    assert r.status_code == 503 and r.json() == {"detail": "not ready: loading"}


async def test_grpc_info_not_ready() -> None:
    service = unloaded()
    async with Running(service) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Info(pb.InfoRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == "loading"


class _Refusing:
    """A scorer deployment handle whose calls all fail with one of Ray's errors."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.http = self

    async def _fail(self) -> Any:
        raise self.exc

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._fail()


async def test_ray_ingress_and_handle_answer_with_the_same_conversion() -> None:
    """Under Ray Serve, a full router queue and a lost replica become the service's own errors,
    answered by the ingress exactly as the app answers them (and by the handle as the status)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    from reward_server.service.ray_app import Forwarded, Ingress, RewardHandle, ScoreCallError

    cases = {
        "overloaded": BackPressureError(num_queued_requests=3, max_queued_requests=2),
        "replica_lost": RayActorError(),
    }
    for reason, ray_error in cases.items():
        row = ROWS[reason]
        answer = await Ingress(_Refusing(ray_error), 1024, attempts=2).relay(Forwarded())
        assert answer.status == row.http_status
        assert answer.header("retry-after") == "1"  # Ray says nothing sooner
        assert answer.header("content-type") == "application/json"
        detail = json.loads(answer.body)["detail"]
        assert isinstance(detail, str) and detail
        handle = RewardHandle.__new__(RewardHandle)  # no cluster: only its error path is used
        handle.handle, handle.attempts, handle.timeout = _Refusing(ray_error), 2, 30.0
        handle.handle.score = handle.handle
        with pytest.raises(ScoreCallError) as err:
            await handle.score_async(ONE_ITEM)
        assert (err.value.status, err.value.retry_after) == (row.http_status, 1.0)
        assert err.value.retryable and err.value.detail == detail
