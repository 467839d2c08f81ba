"""gRPC front end: same numbers as HTTP, status codes, Info/Health, generated code."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from reward_server.field_names import not_utf8
from reward_server.service.grpc_client import RewardStub, request_from_dict, response_to_dict
from reward_server.service.grpc_messages import pb
from reward_server.service.pipeline import ScoringService
from tests.doubles import HashEncoder
from tests.server_process import REPO
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    Running,
    SlowEncoder,
    assert_same_response,
    hashed_fixture,
    http_client,
    make_service,
    onnx_encoder_fixture,
    onnx_model_dir_fixture,
    reference_response,
    step_items,
)


async def test_score_matches_http_and_in_process_exactly(hashed: Running) -> None:
    body = {"items": step_items(seed=11), "diagnostics": True, "params": {"explore_cap": 0.6}}
    got = response_to_dict(await hashed.stub.Score(request_from_dict(body)))
    want = reference_response(body, HashEncoder())
    assert_same_response(got, want)
    with http_client(hashed.service) as c:
        via_http = c.post("/v1/score", json=body).json()
    assert via_http == got
    # In HTTP's order too (components, their batch means, params): a protobuf map has none,
    # and columns built from the keys came out in another order over gRPC.
    assert json.dumps(via_http) == json.dumps(got)
    cfl = {"items": step_items(seed=12), "recipe": "cfl", "params": {"length_target": 64}}
    with http_client(hashed.service) as c:
        cfl_http = c.post("/v1/score", json=cfl).json()
    cfl_grpc = response_to_dict(await hashed.stub.Score(request_from_dict(cfl)))
    assert json.dumps(cfl_http) == json.dumps(cfl_grpc) and list(cfl_http["components"]) == [
        "oc",
        "fa",
        "len",
    ]


async def test_unset_fields_take_defaults_and_nulls_survive(hashed: Running) -> None:
    body = {"items": [{"completion": "no tags at all", "answer": "3"}]}
    got = response_to_dict(await hashed.stub.Score(request_from_dict(body)))
    assert got["items"][0]["final_answer"] is None and got["items"][0]["uniq"] is None
    assert got["advantages"] is None and got["recipe"] == "sde2"
    assert got["params"]["max_strategies"] == 32 and got["params"]["weights"]["sd"] == 1.0


async def test_timing_trailers(hashed: Running) -> None:
    call = hashed.stub.Score(request_from_dict({"items": step_items(seed=12)[:4]}))
    await call
    trailers = dict(await call.trailing_metadata())
    for phase in ("parse", "queue", "encode", "reward", "total"):
        assert float(trailers[f"x-{phase}-time"]) >= 0


async def test_a_batch_warning_is_trailing_metadata(hashed: Running) -> None:
    """A gold no sensible answer matches is scored, with its warning where the timings are."""
    body = {"items": [{"completion": "a", "answer": "1"}, {"completion": "b", "answer": "$"}]}
    call = hashed.stub.Score(request_from_dict(body))
    assert list((await call).rewards) == reference_response(body, HashEncoder())["rewards"]
    warnings = [v for k, v in await call.trailing_metadata() if k == "x-sde2-warning"]
    assert [w.split(": ")[0] for w in warnings] == ["items.1.answer"]
    assert "'$' is empty once canonicalized" in warnings[0]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"items": [{"completion": "a", "answer": "1"}], "recipe": "x"}, "recipe"),
        ({"items": [{"completion": "a", "answer": "1", "num_tokens": -2}]}, "items.0.num_tokens"),
        ({"items": [{"completion": "a", "answer": "1"}], "params": {"eps": 0.0}}, "params.eps"),
        (
            {"items": [{"completion": "a", "answer": "1"}], "params": {"lambda_oc": float("nan")}},
            "params.lambda_oc",
        ),
        (
            {"items": [{"completion": "a", "answer": "1"}], "params": {"weights": {"sd": 1e999}}},
            "params.weights.sd",
        ),
        ({"items": []}, "items"),
    ],
)
async def test_invalid_argument_names_the_field(hashed: Running, body: dict, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await hashed.stub.Score(request_from_dict(body))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field + ":")


async def test_info_and_health(hashed: Running) -> None:
    before = _count(hashed, "sde2_requests_total", route="grpc:Info", status="OK")
    info = await hashed.stub.Info(pb.InfoRequest())
    assert info.encoder == "hash" and info.version
    # Counted as its refusals (UNAVAILABLE while loading) are: only those were.
    assert _count(hashed, "sde2_requests_total", route="grpc:Info", status="OK") == before + 1
    health = await hashed.stub.Health(pb.HealthRequest())
    assert health.status == pb.HealthResponse.Status.SERVING


async def test_health_not_serving_while_loading() -> None:
    import threading

    release = threading.Event()

    def loader() -> HashEncoder:
        release.wait(10)
        return HashEncoder()

    service = ScoringService(make_service().settings, loader=loader)
    service.start()
    async with Running(service) as running:
        health = await running.stub.Health(pb.HealthRequest())
        assert health.status == pb.HealthResponse.Status.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(
                request_from_dict({"items": [{"completion": "a", "answer": "1"}]})
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        release.set()
        assert await asyncio.get_running_loop().run_in_executor(None, service.wait_ready, 10)
        health = await running.stub.Health(pb.HealthRequest())
        assert health.status == pb.HealthResponse.Status.SERVING


async def test_unauthenticated_without_the_key() -> None:
    body = request_from_dict({"items": [{"completion": "a", "answer": "1"}]})
    async with Running(make_service(api_key="k3y")) as running:
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await running.stub.Score(body, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = await running.stub.Score(body, metadata=(("authorization", "Bearer k3y"),))
        assert len(ok.rewards) == 1
        # Spaces around the value: HTTP's parser strips them from a header, gRPC's metadata not.
        ok = await running.stub.Score(body, metadata=(("authorization", " Bearer k3y "),))
        assert len(ok.rewards) == 1


async def test_without_the_key_the_message_is_not_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key is checked before any work on the message (HTTP reads no body without it)."""
    from reward_server.service import grpc_server

    converted: list[Any] = []
    real = grpc_server.request_to_json
    monkeypatch.setattr(grpc_server, "request_to_json", lambda r: converted.append(r) or real(r))
    body = request_from_dict({"items": [{"completion": "z" * 100_000, "answer": "1"}] * 20})
    async with Running(make_service(api_key="k3y")) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(body)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert converted == []
        ok = await running.stub.Score(body, metadata=(("authorization", "Bearer k3y"),))
        assert len(ok.rewards) == 20 and len(converted) == 1
        for pair in (("Bearer x", "Bearer k3y"), ("Bearer k3y", "Bearer x")):  # none, as HTTP
            with pytest.raises(grpc.aio.AioRpcError) as two:
                await running.stub.Score(body, metadata=[("authorization", v) for v in pair])
            assert two.value.code() == grpc.StatusCode.UNAUTHENTICATED, pair


async def test_too_many_items_are_refused_before_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty item is two bytes of protobuf: a message under the body limit holds millions.
    Their count is refused (as over HTTP, naming ``items``) before any item is converted."""
    from reward_server.service import grpc_server

    converted: list[Any] = []
    real = grpc_server.request_to_json
    monkeypatch.setattr(grpc_server, "request_to_json", lambda r: converted.append(r) or real(r))
    body = pb.ScoreRequest(items=[pb.Item()] * 500_000)
    assert body.ByteSize() == 1_000_000
    async with Running(make_service()) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(body)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "items: at most 1024 items per request, got more than 1024"
        assert converted == []
        counted = running.service.metrics.render().decode()
        assert 'sde2_failures_total{reason="invalid"} 1.0' in counted
        ok = await running.stub.Score(request_from_dict({"items": step_items(seed=1)[:2]}))
        assert len(ok.rewards) == 2 and len(converted) == 1


async def test_a_message_of_millions_of_other_fields_is_refused_unscanned() -> None:
    """Millions of fields that are not items (a repeated scalar, an unknown field) would cost
    the item count a second of Python on the event loop, field by field: past the fields a
    ScoreRequest can hold the message is refused, before it is parsed or scanned further."""
    junk = {
        "unknown field 99": b"\x98\x06\x00" * 2_000_000,
        "recipe repeated": b"\x12\x00" * 3_000_000,
        # An unknown group (field 99) first: protobuf keeps it and parses the items after it.
        "a group before the items": b"\x9b\x06\x9c\x06" + b"\x0a\x00" * 2_000_000,
    }
    async with Running(make_service()) as running:
        score = running.channel.unary_unary("/sde2.v1.RewardService/Score")
        for name, data in junk.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await score(data)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert "not a ScoreRequest" in (err.value.details() or ""), name
        # A message with a few unknown fields (a newer client's) is still served.
        extra = b"\x98\x06\x01" * 3
        body = request_from_dict({"items": step_items(seed=1)[:2]}).SerializeToString() + extra
        ok = pb.ScoreResponse.FromString(await score(body))
        assert len(ok.rewards) == 2


async def test_a_varint_that_never_ends_is_refused_at_once() -> None:
    """The item count read a varint until a byte without the continuation bit: a message of
    0xff bytes was one varint growing a Python integer (quadratic: 400 KB held the event loop,
    HTTP and health included, 5 s; the 16 MiB limit about two hours). A varint is at most 10
    bytes: past them the message is not protobuf, refused as any other."""
    async with Running(make_service()) as running:
        score = running.channel.unary_unary("/sde2.v1.RewardService/Score")
        for junk in (b"\xff" * 4_000_000, b"\x80" * 4_000_000, b"\x0a\x00" + b"\xff" * 100):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await score(junk, timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf message" in (err.value.details() or "")
        health = await running.stub.Health(pb.HealthRequest(), timeout=5)
        assert health.status == pb.HealthResponse.SERVING


def _field(number: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field: its key, then ``payload`` (a length-delimited one's length first)."""
    key = bytes([number << 3 | wire])
    return key + (_varint_bytes(len(payload)) + payload if wire == 2 else payload)


async def test_declared_fields_of_another_wire_type_are_refused_naming_them() -> None:
    """protobuf keeps a declared field sent with another wire type among the unknown ones, and
    the message reads its default: a client built from another .proto (float for double,
    double for int64) was scored with the defaults, silently. Refused, each field named, as
    HTTP refuses a value of the wrong type; an unknown number is still ignored."""
    item = _field(1, 2, b"x") + _field(2, 2, b"1") + _field(5, 1, b"\x00" * 8)
    params = _field(9, 5, b"\x00\x00\x00\x3f") + _field(11, 2, _field(1, 0, b"\x02"))
    body = (
        _field(1, 2, item) + _field(2, 0, b"\x01") + _field(4, 2, params) + _field(5, 2, b"x")
        + _field(15, 0, b"\x01")
    )  # fmt: skip
    async with Running(make_service()) as running:
        score = running.channel.unary_unary("/sde2.v1.RewardService/Score")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await score(body)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        fields = re.findall(r"(?:^|; )([\w.]+): sent as a ([\w-]+) field", err.value.details())
        assert fields == [
            ("recipe", "varint"),
            ("normalize", "length-delimited"),
            ("items.0.num_tokens", "64-bit"),
            ("params.similarity_threshold", "32-bit"),
            ("params.weights.oc", "varint"),
        ]
        assert "declared double (64-bit): send it as sde2.v1 declares it" in err.value.details()


def _spoiled(body: dict[str, Any], placeholder: str, raw: bytes) -> bytes:
    """``body`` as a message whose string ``placeholder`` is the bytes ``raw`` instead (of the
    same length: the lengths written before it stay true); no client writes them."""
    assert len(placeholder.encode()) == len(raw)
    sent = request_from_dict(body).SerializeToString()
    assert sent.count(placeholder.encode()) == 1
    return sent.replace(placeholder.encode(), raw)


_TWO_ITEMS = [{"completion": "ok", "answer": "1"}, {"completion": "CCCCC", "answer": "AAA"}]


@pytest.mark.parametrize(
    ("data", "field", "at"),
    [
        (_spoiled({"items": _TWO_ITEMS}, "CCCCC", b"ab\xffde"), "items.1.completion", 2),
        # A lone surrogate as UTF-8 would write it (0xed 0xa0 0x80): protobuf refuses it too.
        (_spoiled({"items": _TWO_ITEMS}, "AAA", b"\xed\xa0\x80"), "items.1.answer", 0),
        (
            _spoiled({"items": [{**_TWO_ITEMS[0], "prompt": "PPPP"}]}, "PPPP", b"\xc3\xa9\xc3!"),
            "items.0.prompt",
            1,
        ),
        # The request's own strings (RewardParams and Weights declare none: numbers only).
        (_spoiled({"items": _TWO_ITEMS[:1], "recipe": "RRR"}, "RRR", b"sd\xe2"), "recipe", 2),
        (
            _spoiled({"items": _TWO_ITEMS[:1], "answer_type": "TT"}, "TT", b"\x80a"),
            "answer_type",
            0,
        ),
    ],
    ids=["completion", "answer", "prompt", "recipe", "answer_type"],
)
async def test_a_string_that_is_not_utf8_is_refused_naming_its_field(
    hashed: Running, data: bytes, field: str, at: int
) -> None:
    """protobuf's parser refuses a whole message for one string that is not valid UTF-8 and
    names no field: the refusal named none ("not a valid protobuf message"), where HTTP names
    the string's field and character. Both now say the same."""
    score = hashed.channel.unary_unary("/sde2.v1.RewardService/Score")
    explain = hashed.channel.unary_unary("/sde2.v1.RewardService/Explain")
    for method in (score, explain):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await method(data, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"{field}: not valid UTF-8 at character {at}: a lone surrogate (\\ud800-\\udfff) or "
            "a byte UTF-8 does not allow; send text as UTF-8"
        )
    health = await hashed.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.status == pb.HealthResponse.SERVING
    ok = await hashed.stub.Score(request_from_dict({"items": _TWO_ITEMS}), timeout=10)
    assert len(ok.rewards) == 2


async def test_a_string_that_is_not_utf8_is_refused_as_over_http(hashed: Running) -> None:
    """The same string refused over both transports, in the same words."""
    body = b'{"items": [{"completion": "ok", "answer": "1"}, {"completion": "ab\xffde"}]}'
    with http_client(hashed.service) as c:
        r = c.post("/v1/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    [issue] = r.json()["detail"]
    score = hashed.channel.unary_unary("/sde2.v1.RewardService/Score")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await score(_spoiled({"items": _TWO_ITEMS}, "CCCCC", b"ab\xffde"), timeout=10)
    assert err.value.details() == f"{issue['field']}: {issue['msg']}"
    assert issue["field"] == "items.1.completion" and "at character 2:" in issue["msg"]


async def test_malformed_bytes_besides_a_string_keep_the_parsers_refusal(hashed: Running) -> None:
    """Only a message that is otherwise whole names a string: one cut short, or whose length
    says more than it holds, is refused as not protobuf, as it was, strings spoiled or not."""
    spoiled = _spoiled({"items": _TWO_ITEMS}, "CCCCC", b"ab\xffde")
    score = hashed.channel.unary_unary("/sde2.v1.RewardService/Score")
    for data in (spoiled[:-2], b"\x0a\x05ab", spoiled + b"\x0a\x05ab", b"\x12\x03ab"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await score(data, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(
            "body: request is not a valid protobuf message: "
        ), data
    health = await hashed.stub.Health(pb.HealthRequest(), timeout=5)
    assert health.status == pb.HealthResponse.SERVING


async def test_millions_of_unknown_fields_inside_an_item_are_refused() -> None:
    """Unknown fields are read into Python objects to tell a misread declared field (~1 us
    and 100 bytes each): past a few KB of them the request is refused instead (3 million in
    one item held the loop 2 s and 300 MB); an item with a few is served, as are repeated
    declared fields (a merged message), which are not unknown."""
    junk = b"\x78\x01" * 3_000_000  # field 15, undeclared, as varints
    item = _field(1, 2, b"x") + _field(2, 2, b"1")
    async with Running(make_service()) as running:
        score = running.channel.unary_unary("/sde2.v1.RewardService/Score")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await score(b"\x0a" + _varint_bytes(len(junk)) + junk)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.fullmatch(
            r"body: 600000\d bytes of fields that sde2.v1 does not declare, over the limit of "
            r"16448 \(16384 \+ 64 an item\): send the fields it declares",
            err.value.details() or "",
        )
        # A newer client's field on every item of a full batch is within the bound.
        newer = b"".join(_field(1, 2, item + _field(15, 2, b"x" * 20)) for _ in range(1024))
        assert len(pb.ScoreResponse.FromString(await score(newer)).rewards) == 1024
        for extra in (b"\x78\x01" * 100, _field(1, 2, b"y") * 3000):
            body = pb.ScoreResponse.FromString(await score(_field(1, 2, item + extra)))
            assert len(body.rewards) == 1


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


async def test_calls_in_progress_are_bounded_past_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC holds each message whole before a handler runs: the calls in progress (so the
    messages held) are bounded by the queue's capacity plus a headroom; past it gRPC itself
    answers RESOURCE_EXHAUSTED, and once they end calls are served again."""
    from reward_server.service import grpc_server

    release = asyncio.Event()
    in_progress: list[object] = []

    async def held_info(self: Any, request: Any, context: Any) -> Any:
        in_progress.append(request)
        await release.wait()  # a call in progress that does not end yet
        return pb.InfoResponse()

    monkeypatch.setattr(grpc_server.RewardServicer, "Info", held_info)
    bound = 2 + grpc_server.GRPC_HEADROOM
    async with Running(make_service(queue_capacity=2)) as running:
        held = [asyncio.ensure_future(running.stub.Info(pb.InfoRequest())) for _ in range(bound)]
        deadline = time.monotonic() + 10
        while len(in_progress) < bound and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until every held call is in its handler
        assert len(in_progress) == bound
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Info(pb.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == "Concurrent RPC limit exceeded!"  # as the proto says
        release.set()
        await asyncio.gather(*held)
        assert len((await running.stub.Score(_needs_encoder(9))).rewards) == 1


async def test_an_ipv6_host_is_bracketed_for_grpc() -> None:
    from reward_server.service.grpc_server import create_server

    front = create_server(make_service(), "::1", 0)
    server, port = front.server, front.port
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
            health = await RewardStub(channel).Health(pb.HealthRequest())
        assert health.status == pb.HealthResponse.Status.SERVING
    finally:
        await server.stop(None)


async def test_oversized_message_is_resource_exhausted_without_retry_after() -> None:
    """gRPC refuses a message over ``max_body_bytes`` itself; no ``retry-after`` tells a client
    that this RESOURCE_EXHAUSTED is not "busy, retry" (see the proto's header)."""
    big = request_from_dict({"items": [{"completion": "z" * 5000, "answer": "1"}]})
    async with Running(make_service(max_body_bytes=1000)) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry-after" not in dict(err.value.trailing_metadata() or ())
        small = request_from_dict({"items": [{"completion": "a", "answer": "1"}]})
        assert len((await running.stub.Score(small)).rewards) == 1


def _needs_encoder(seed: int) -> Any:
    """One item with two wrong strategies (so the encoder must run), distinct per seed."""
    c = (
        f"<strategy><reasoning>path {seed} a</reasoning><strategy_outcome>1</strategy_outcome>"
        f"</strategy><strategy><reasoning>path {seed} b</reasoning>"
        "<strategy_outcome>2</strategy_outcome></strategy>"
    )
    return request_from_dict({"items": [{"completion": c, "answer": "9"}]})


async def test_resource_exhausted_with_retry_after() -> None:
    """The first call holds the only place (its encode waits at the encoder's gate until the
    test opens it); the second is refused at once, while the first is still held, instead of
    queueing (a queued call would wait for the gate, then for the request timeout)."""
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    async with Running(make_service(encoder, queue_capacity=1)) as running:
        first = asyncio.ensure_future(running.stub.Score(_needs_encoder(1)))
        try:
            # The first is admitted and inside the encoder (an event, not a sleep).
            assert await asyncio.to_thread(encoder.entered.wait, 10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await running.stub.Score(_needs_encoder(2), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not first.done()  # refused while the first still held its place
        finally:
            encoder.gate.set()
        trailers = dict(err.value.trailing_metadata() or ())
        assert int(trailers["retry-after"]) >= 1
        assert len((await first).rewards) == 1


async def test_deadline_exceeded_by_client_deadline() -> None:
    encoder = SlowEncoder(delay=1.0)
    async with Running(make_service(encoder)) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(_needs_encoder(3), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_server_deadline_is_deadline_exceeded() -> None:
    encoder = SlowEncoder(delay=1.0)
    async with Running(make_service(encoder, request_timeout=0.3)) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(_needs_encoder(4))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_real_model_http_and_grpc_identical(onnx_encoder: Any) -> None:
    body = {"items": step_items(seed=13, prompts=2, generations=4), "diagnostics": True}
    service = make_service(onnx_encoder)
    async with Running(service) as running:
        via_grpc = response_to_dict(await running.stub.Score(request_from_dict(body)))
    with http_client(service) as c:
        via_http = c.post("/v1/score", json=body).json()
    # Same batch, same batch composition: bit-identical numbers over both wires.
    assert via_http == via_grpc
    assert via_http["encoder"] == "all-MiniLM-L6-v2 onnx fp32"


GENERATED_DIR = Path(pb.__file__).resolve().parents[2]


def _protogen() -> ModuleType:
    """``protos/generate.py``, the build hook's generator (a build tool, not a package module)."""
    spec = importlib.util.spec_from_file_location("protogen", REPO / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    """The imported messages are what the build hook makes of today's .proto (else: make proto)."""
    protogen = _protogen()
    assert GENERATED_DIR == REPO / protogen.PACKAGE_PATH
    fresh = protogen.generate(tmp_path / "_generated")
    names = sorted(str(f.relative_to(tmp_path / "_generated")) for f in fresh)
    assert "sde2/v1/reward_pb2.pyi" in names  # the typed stubs mypy checks grpc_server against
    for name in names:
        ours = GENERATED_DIR / name
        assert ours.read_bytes() == (tmp_path / "_generated" / name).read_bytes(), (
            f"{ours} is stale: run `make proto`"
        )


def test_gencode_is_not_newer_than_the_runtime_floor() -> None:
    """protobuf refuses messages generated by a newer protoc than the runtime: the build's
    grpcio-tools and the `server` extra's protobuf floor must move together."""
    code = (GENERATED_DIR / "sde2" / "v1" / "reward_pb2.py").read_text()
    found = re.search(r"Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", code)
    assert found is not None
    gencode = tuple(int(x) for x in found.groups())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    server = project["project"]["optional-dependencies"]["server"]
    floor_spec = next(r for r in server if r.startswith("protobuf"))
    floor = re.search(r">=\s*(\d+)\.(\d+)\.(\d+)", floor_spec)
    assert floor is not None, floor_spec
    assert gencode <= tuple(int(x) for x in floor.groups()), (gencode, floor_spec)
    tools = [r for r in project["build-system"]["requires"] if r.startswith("grpcio-tools")]
    dev = [r for r in project["project"]["optional-dependencies"]["dev"] if "grpcio-tools" in r]
    assert tools and [r.split("#")[0].strip() for r in dev] == tools
    assert not any("grpcio-tools" in r for r in server)  # protoc is a build tool only


def test_generated_code_is_not_committed() -> None:
    import subprocess

    tracked = subprocess.run(
        ["git", "ls-files", str(GENERATED_DIR)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    assert tracked == ""


def _count(running: Running, metric: str, **labels: str) -> float:
    value = running.service.metrics.registry.get_sample_value(metric, labels)
    return 0.0 if value is None else value


async def test_calls_the_client_ends_are_counted() -> None:
    """A call cancelled by its client, or ended by the client's deadline, while its texts wait
    for the encoder was counted nowhere (HTTP counts a client gone as 499)."""
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()  # the encoder holds the first call's texts until the test opens it
    requests = "sde2_requests_total"

    def counts(running: Running) -> list[float]:
        return [
            _count(running, requests, route="grpc:Score", status="CANCELLED"),
            _count(running, requests, route="grpc:Score", status="DEADLINE_EXCEEDED"),
            _count(running, "sde2_failures_total", reason="client_disconnect"),
            _count(running, "sde2_failures_total", reason="deadline"),
        ]

    async with Running(make_service(encoder)) as running:
        try:
            call = running.stub.Score(_needs_encoder(5))
            assert await asyncio.to_thread(encoder.entered.wait, 10)  # its texts are encoding
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            with pytest.raises(grpc.aio.AioRpcError) as err:  # queued behind the held encode
                await running.stub.Score(_needs_encoder(6), timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 10
            while counts(running) != [1, 1, 1, 1] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the handlers see their cancellation
            assert counts(running) == [1, 1, 1, 1]
        finally:
            encoder.gate.set()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # A lone surrogate (a broken tokenizer's decoding) raised protobuf's UnicodeEncodeError,
        # said to be "past gRPC's int64".
        (
            {
                "items": [
                    {"completion": "a", "answer": "1"},
                    {"completion": "ab\ud800", "answer": ""},
                ]
            },
            f"items.1.completion: {not_utf8(2)}; not sent",
        ),
        (
            {"items": [{"completion": "a", "answer": "\udcff", "prompt": "p"}]},
            f"items.0.answer: {not_utf8(0)}; not sent",
        ),
        (
            {"items": [], "recipe": "x\udc80"},
            f"recipe: {not_utf8(1)}",
        ),
        # A misspelled name holding one is named printably.
        ({"items": [], "x\ud800": 1}, "x\\ud800: not a field of sde2.v1's ScoreRequest"),
        # A name that is not a string (a caller's dict) is named as it was before the paths
        # were made printable: that raised AttributeError ('NoneType' has no 'encode').
        ({"items": [], None: 1}, "None: not a field of sde2.v1's ScoreRequest"),
        (
            {"items": [{"completion": "a", "answer": "1", 2.5: "x"}]},
            "items.0.2.5: not a field of sde2.v1's Item",
        ),
        ({"items": [], "recipe": None}, "recipe: a string, got NoneType None"),
        ({"items": [], "params": {"lambda_oc": True}}, "params.lambda_oc: a double, got bool"),
        ({"items": [], "normalize": 1}, "normalize: a boolean, got int 1"),
        ({"items": [], "params": {"weights": None}}, "params.weights: an object, got NoneType"),
        ({"items": [], "params": {"eps": None}}, "params.eps: a double, got NoneType"),
        ({"items": [], "params": {"length_target": 512.0}}, "params.length_target: an integer"),
        ({"items": [{"completion": 3, "answer": "1"}]}, "items.0.completion: a string, got int"),
        ({"items": [{"answer": "1"}]}, "items.0.completion: a string is required, missing"),
        ({"items": [{"completion": "a", "answer": None}]}, "items.0.answer: a string is required"),
        ({"items": [], "recipee": "sde2"}, "recipee: not a field of sde2.v1's ScoreRequest"),
        (
            {"items": [{"completion": "a", "answer": "1", "num_tokens": 2**70}]},
            "items.0.num_tokens: Value out of range: 1180591620717411303424 (past gRPC's int64)",
        ),
        # HTTP refuses a negative count: the message says no more than the int64.
        (
            {"items": [{"completion": "a", "answer": "1", "num_tokens": -(2**64)}]},
            "items.0.num_tokens: Value out of range: -18446744073709551616 (past gRPC's int64)",
        ),
        # A misspelled field is refused whatever its value (a None one was dropped unsaid).
        (
            {"items": [{"completion": "a", "answer": "1", "num_token": None}]},
            "items.0.num_token: not a field of sde2.v1's Item",
        ),
        # An integer no double holds: it raised a bare OverflowError naming no field.
        (
            {"items": [], "params": {"lambda_oc": 10**400}},
            "params.lambda_oc: int too large to convert to float (HTTP refuses it too)",
        ),
    ],
)
def test_request_from_dict_refuses_what_the_message_would_carry_otherwise(
    body: dict[str, Any], message: str
) -> None:
    """protobuf coerces ``True`` into ``1.0`` and ``1`` into ``true`` and reads a missing
    field's default: the helper sent what HTTP refuses as something the server scored."""
    with pytest.raises(ValueError, match=re.escape(message)):
        request_from_dict(body)


async def test_the_clients_channel_takes_an_explanation_over_4_mib() -> None:
    """gRPC's default channel refuses answers over 4 MiB: an Explain of a few hundred items
    failed on the client (RESOURCE_EXHAUSTED) after the server had done the work."""
    from reward_server.service.grpc_client import insecure_channel

    body = request_from_dict({"items": step_items(seed=5, prompts=96)})  # 768 completions
    async with Running(make_service(max_request_tokens=2**21)) as running:
        target = f"127.0.0.1:{running.port}"
        async with grpc.aio.insecure_channel(target) as default:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await RewardStub(default).Explain(body)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with insecure_channel(target) as channel:
            answer = await RewardStub(channel).Explain(body)
        assert answer.ByteSize() > 4 * 2**20


def _raw_call(running: Running, method: str) -> Any:
    """``method`` called as the request stream it is served as (a unary client sends one
    message and ends its stream at once; this one chooses what it sends)."""
    from reward_server.service.grpc_messages import SERVICE

    return running.channel.stream_unary(f"/{SERVICE}/{method}")


async def _messages(*messages: bytes, then_wait: asyncio.Event | None = None) -> Any:
    """``messages``, then (with ``then_wait``) silence until the event is set."""
    for message in messages:
        yield message
    if then_wait is not None:
        await then_wait.wait()


async def test_calls_that_send_nothing_give_their_places_back_after_the_body_timeout() -> None:
    """gRPC admits a call at its headers: calls that never sent their message held every place
    (Info and Health included) for as long as their client liked. Now each call's message must
    arrive within --body-timeout, as an HTTP body must: the silent calls end with
    DEADLINE_EXCEEDED, counted as HTTP's 408s are, and the places are free again."""
    from reward_server.service import grpc_server

    never = asyncio.Event()
    async with Running(make_service(queue_capacity=2, body_timeout=1.0)) as running:
        bound = 2 + grpc_server.GRPC_HEADROOM
        methods = ["Score", "Explain", "Info", "Health"]
        silent = [
            asyncio.ensure_future(
                _raw_call(running, methods[i % 4])(_messages(then_wait=never), timeout=30)
            )
            for i in range(bound)
        ]
        await asyncio.sleep(0.3)  # every silent call admitted: nothing else gets in
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await running.stub.Health(pb.HealthRequest(), timeout=5)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        started = time.monotonic()
        for call in silent:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert ended.value.details() == (
                "request body not received within 1 s (--body-timeout)"
            )
        assert time.monotonic() - started < 5
        labels = {"reason": "body_timeout"}
        assert _count(running, "sde2_failures_total", **labels) == bound
        assert len((await running.stub.Score(_needs_encoder(21))).rewards) == 1
    never.set()


async def test_the_longest_body_timeout_a_setting_takes_starts_grpc() -> None:
    """The body timeout is also gRPC's keepalive timeout in milliseconds, a C int: a valid
    --body-timeout over 24 days ended the start with an OverflowError."""
    from reward_server.service.config import MAX_SECONDS

    async with Running(make_service(body_timeout=float(MAX_SECONDS))) as running:
        health = await running.stub.Health(pb.HealthRequest(), timeout=10)
        assert health.status == pb.HealthResponse.SERVING


#: A client that calls ``Explain`` with an answer of about 10 MB, then stops itself (SIGSTOP)
#: before reading it: a trainer frozen in a debugger, or any client that stops reading.
_FROZEN_CLIENT = """
import os, signal, sys, time
import grpc
from reward_server.service.grpc_client import CHANNEL_OPTIONS, RewardStub, request_from_dict
blocks = "".join(
    f"<strategy><reasoning>approach {j} {'x' * 200}</reasoning>"
    f"<strategy_outcome>{j}</strategy_outcome></strategy>" for j in range(11)
)
items = [{"completion": blocks + "<final_answer>7</final_answer>", "answer": "1"}] * 1024
stub = RewardStub(grpc.insecure_channel(sys.argv[1], CHANNEL_OPTIONS))
call = stub.Explain.future(request_from_dict({"items": items}), timeout=120)
time.sleep(0.2)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
try:
    print("answered", call.result().ByteSize(), flush=True)
except grpc.RpcError as exc:
    print("ended", exc.code().name, flush=True)
"""


async def test_a_client_that_stops_reading_is_cut_after_the_body_timeout() -> None:
    """An answer left unread held its call's place, and the answer in gRPC's buffers, for as
    long as the client stayed connected but frozen (about 20 s, gRPC's own TCP timeout, for a
    stopped process; without end for one that kept the connection alive). Unread past
    --body-timeout, the connection is now dropped, as HTTP drops it."""
    import signal
    import subprocess
    import sys

    async with Running(make_service(body_timeout=1.0)) as running:
        client = subprocess.Popen(
            [sys.executable, "-c", _FROZEN_CLIENT, f"127.0.0.1:{running.port}"],
            cwd=REPO, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert client.stdout is not None
            assert await asyncio.to_thread(client.stdout.readline) == "sent\n"
            answered = {"route": "grpc:Explain", "status": "OK"}
            deadline = time.monotonic() + 60
            while _count(running, "sde2_requests_total", **answered) < 1:
                assert time.monotonic() < deadline, "the Explain call was never answered"
                await asyncio.sleep(0.05)
            await asyncio.sleep(6)  # the answer unread: cut within the timeout and TCP's probes
            client.send_signal(signal.SIGCONT)
            out, _ = await asyncio.to_thread(client.communicate, timeout=60)
        finally:
            client.kill()
        assert out == "ended UNAVAILABLE\n"
        assert len((await running.stub.Score(_needs_encoder(22))).rewards) == 1


@pytest.mark.parametrize(
    ("messages", "details"),
    [
        ((), "body: the call ended without a request message"),
        (
            (
                request_from_dict(
                    {"items": [{"completion": "a", "answer": "1"}]}
                ).SerializeToString(),
            )
            * 2,
            "body: more than one request message: each method takes exactly one",
        ),
    ],
)
async def test_a_call_carries_exactly_one_message(
    hashed: Running, messages: tuple[bytes, ...], details: str
) -> None:
    """Each method takes one message: none, or a second one, is INVALID_ARGUMENT (served as a
    stream, a call could otherwise carry any number)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _raw_call(hashed, "Score")(_messages(*messages), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == details


async def test_calls_ended_before_their_message_are_not_counted_as_invalid() -> None:
    """gRPC ends the request stream of a call it refuses itself (a message over
    --max-body-bytes), or that its client cancels or lets its deadline pass, as a half-close:
    read as "no message", each was counted as an INVALID_ARGUMENT nobody had sent."""
    never = asyncio.Event()
    async with Running(make_service(max_body_bytes=1000, body_timeout=5.0)) as running:
        big = request_from_dict({"items": [{"completion": "x" * 5000, "answer": "1"}]})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(big, timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        cancelled = _raw_call(running, "Score")(_messages(then_wait=never))
        await asyncio.sleep(0.3)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _raw_call(running, "Score")(_messages(then_wait=never), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.5)  # past END_GRACE: each handler has seen its cancellation
        assert _count(running, "sde2_failures_total", reason="invalid") == 0
        assert _count(running, "sde2_failures_total", reason="deadline") == 1
        statuses = ("INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED")
        counted = [
            _count(running, "sde2_requests_total", route="grpc:Score", status=s) for s in statuses
        ]
        assert counted == [0, 0, 1]
    never.set()


@pytest.mark.parametrize("shared", [False, True])
async def test_a_stopping_server_refuses_new_calls_so_clients_retry_elsewhere(shared: bool) -> None:
    """While a call is in progress, a stopping server answers a new call UNAVAILABLE "send to
    another replica" (gRPC's own stop answered it CANCELLED, which clients do not retry); a
    worker sharing its port with others (``--workers``) stops listening at once instead, so
    the kernel hands new connections to the others (a worker stopped alone refused its share).
    The call in progress ends with its answer either way."""
    from reward_server.service.grpc_server import create_server

    encoder = SlowEncoder()
    encoder.gate.clear()
    front = create_server(make_service(encoder), "127.0.0.1", 0, reuse_port=shared)
    await front.start()
    target = f"127.0.0.1:{front.port}"
    try:
        async with grpc.aio.insecure_channel(target) as first:
            held = asyncio.ensure_future(RewardStub(first).Score(_needs_encoder(1), timeout=30))
            assert await asyncio.to_thread(encoder.entered.wait, 10)
            stopping = asyncio.ensure_future(front.stop(10, 1))
            await asyncio.sleep(0.3)
            options = (("grpc.use_local_subchannel_pool", 1),)  # a connection of its own
            async with grpc.aio.insecure_channel(target, options=options) as late:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await RewardStub(late).Score(_needs_encoder(2), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            said = refused.value.details() or ""
            assert ("send to another replica" in said) is not shared, said
            encoder.gate.set()
            assert len((await held).rewards) == 1
            await stopping
    finally:
        encoder.gate.set()
        await front.server.stop(None)
