"""A request whose embeddings are all cached is rewarded in the trip that prepared it, without
the encoder worker's queue: same answers, same errors, and it is not held up by a running
encoder call. That trip runs on the event loop for a small body and in the CPU pool for a large
one (``inline_bytes``), with the same answers."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from reward_server.encoders.cache import CachedEncoder
from tests.doubles import HashEncoder
from tests.service_fixtures import (
    SlowEncoder,
    assert_same_response,
    http_client,
    make_service,
    reference_response,
    step_items,
    threads_running,
)


def test_peek_answers_only_when_every_text_is_cached() -> None:
    inner = SlowEncoder(delay=0.0)
    cached = CachedEncoder(inner, 10)
    assert cached.peek(["a", "b"]) is None  # nothing cached: nothing counted, no model call
    assert (cached.hits, cached.misses, inner.calls) == (0, 0, [])
    want = cached.encode(["a", "b"])
    assert (cached.hits, cached.misses) == (0, 2)
    got = cached.peek(["b", "a", "b"])
    assert got is not None and np.array_equal(got, want[[1, 0, 1]])
    assert cached.hits == 3 and len(inner.calls) == 1
    assert cached.peek(["a", "c"]) is None  # one miss: all or nothing, nothing counted
    assert cached.hits == 3
    assert CachedEncoder(inner, 0).peek(["a"]) is None  # a disabled cache holds nothing


def test_cached_request_is_answered_while_the_encoder_is_busy() -> None:
    slow = SlowEncoder(delay=0.0)
    service = make_service(CachedEncoder(slow, 10_000))
    body = {"items": step_items(seed=5)[:16], "diagnostics": True}
    want = reference_response(body, HashEncoder())
    try:
        with http_client(service) as c:
            first = c.post("/v1/score", json=body)  # misses: through the encoder worker
            assert first.status_code == 200, first.text
            assert_same_response(first.json(), want | {"encoder": "slow-hash"})
            # Hold the worker inside an encoder call: a request needing the model would wait.
            slow.gate.clear()
            assert service.batcher is not None
            held = service.batcher.submit(["a text nobody cached"], time.monotonic() + 30)
            assert slow.entered.wait(10)
            second = c.post("/v1/score", json=body)  # every text cached: no queue
            assert second.status_code == 200, second.text
            assert second.json() == first.json()
            assert float(second.headers["x-queue-time"]) == 0.0
            explained = c.post("/v1/explain", json=body)
            assert explained.status_code == 200, explained.text
            assert explained.json()["rewards"] == first.json()["rewards"]
            assert not held.done()
            slow.gate.set()
            held.result(10)
    finally:
        slow.gate.set()
        service.close()


def test_cached_request_errors_as_before() -> None:
    """A non-finite reward is the same 422 on the cached path."""
    service = make_service(CachedEncoder(HashEncoder(), 100))
    items = step_items(seed=6)[:8]
    params = {"lambda_oc": 1e308, "gamma_answer": 1e308}
    body = {"items": items, "normalize": False, "params": params}
    try:
        with http_client(service) as c:
            answers = [c.post("/v1/score", json=body) for _ in range(2)]  # miss, then hit
        assert service.encoder is not None and service.encoder.stats().cache is not None
        assert service.encoder.stats().cache.hits >= 1  # the second took the cached path
        for r in answers:
            assert r.status_code == 422
            assert r.json()["detail"][0]["field"] == "params"
    finally:
        service.close()


@pytest.mark.parametrize("cached", [False, True])
def test_where_a_request_is_prepared_depends_on_its_size_not_its_answer(
    monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """A body up to ``inline_bytes`` is parsed and rewarded on the event loop's thread, a larger
    one in the CPU pool; both answer as the reference does, on the encoder's path and on the
    cached one. (An uncached request's reward went to the pool whatever its size: two thread
    wake-ups more for a small step.)"""
    body = {"items": step_items(seed=8)[:16], "diagnostics": True}
    raw = json.dumps(body).encode()
    want = reference_response(body, HashEncoder())
    threads = threads_running(monkeypatch, "prepare_batch")
    rewarded = threads_running(monkeypatch, "finish_batch")
    places = {}
    for limit, place in ((len(raw), "loop"), (len(raw) - 1, "pool"), (0, "pool")):
        encoder = CachedEncoder(HashEncoder(), 1000) if cached else HashEncoder()
        service = make_service(encoder, inline_bytes=limit)
        try:
            with http_client(service) as c:
                for _ in range(2 if cached else 1):  # the second one finds every text cached
                    threads.clear()
                    rewarded.clear()
                    r = c.post(
                        "/v1/score", content=raw, headers={"content-type": "application/json"}
                    )
                    assert r.status_code == 200, r.text
                    assert_same_response(r.json(), want | {"encoder": encoder.name})
                    assert len(threads) == 1 and rewarded == threads, (threads, rewarded)
                    places[limit] = threads[0]
                bad = c.post("/v1/score", content=raw.replace(b'"answer"', b'"answr"', 1))
                assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == [
                    "items",
                    0,
                ]
        finally:
            service.close()
        assert places[limit].startswith("sde2-cpu") == (place == "pool"), places
