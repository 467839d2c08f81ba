"""Server limits: body size, items, characters, capacity (429), deadlines (503), the batcher's
coalescing / dedup / token budget, encoder failures, and the settings' flags and env vars."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import re
import string
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reward_server.service.batcher import (
    Batcher,
    DeadlineExceeded,
    EncoderFailed,
    Overloaded,
    ShuttingDown,
    estimate_tokens,
)
from reward_server.service.config import Settings, add_settings_arguments, load_settings
from reward_server.service.errors import RequestInvalid
from reward_server.service.metrics import Metrics
from reward_server.service.pipeline import ScoringService
from reward_server.service.request_checks import check_encoder_budget
from tests.doubles import HashEncoder
from tests.service_fixtures import SlowEncoder, http_client, make_service, make_settings


@given(st.text(alphabet=st.sampled_from(" a!.,中é\u0301😀\n" + string.punctuation), max_size=400))
def test_the_token_estimate_counts_what_its_docstring_says(text: str) -> None:
    """Words, ASCII punctuation and half the non-ASCII characters, or a quarter of the length,
    capped at the model's limit: counted here character by character."""
    punctuation = sum(c in string.punctuation for c in text)
    non_ascii = sum(not c.isascii() for c in text)
    pieces = text.count(" ") + 1 + punctuation + non_ascii // 2
    assert estimate_tokens(text) == min(256, 2 + max(math.ceil(len(text) / 4), pieces))


class DepthWatch(Metrics):
    """The service's metrics, which also let a test wait until the batcher's admitted and queued
    counts reach a state (the batcher reports every change): no polling, no sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition()
        self._admitted = self._queued = 0

    def on_depth(self, admitted: int, queued_requests: int, queued_tokens: int) -> None:
        super().on_depth(admitted, queued_requests, queued_tokens)
        with self._changed:
            self._admitted, self._queued = admitted, queued_requests
            self._changed.notify_all()

    def wait_for(self, *, admitted: int | None = None, queued: int | None = None) -> bool:
        """Whether the counts reached ``admitted`` / ``queued`` (within 10 s)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: admitted in (None, self._admitted) and queued in (None, self._queued), 10
            )


def watched_service(encoder: SlowEncoder, **overrides: Any) -> tuple[ScoringService, DepthWatch]:
    """A started service over ``encoder`` whose metrics are a :class:`DepthWatch`."""
    watch = DepthWatch()
    service = ScoringService(make_settings(**overrides), encoder=encoder, metrics=watch)
    service.start(background=False)
    assert service.ready
    return service, watch


def past(instant: float) -> None:
    """Return once ``time.monotonic()`` is past ``instant`` (a deadline under test)."""
    while (left := instant - time.monotonic()) >= 0:
        time.sleep(left + 1e-3)


def needs_encoder(tag: str, n: int = 2) -> dict[str, Any]:
    """An item whose ``n`` wrong strategies make the encoder run (texts unique to ``tag``)."""
    blocks = "".join(
        f"<strategy><reasoning>{tag} way {j}</reasoning><strategy_outcome>{j}</strategy_outcome>"
        "</strategy>"
        for j in range(n)
    )
    return {"completion": blocks, "answer": "999"}


# -- sizes ----------------------------------------------------------------------------------------


def test_limits_on_items_and_characters() -> None:
    service = make_service(max_items=3, max_completion_chars=50, max_answer_chars=5)
    ok = {"completion": "short", "answer": "1"}
    with http_client(service) as c:
        r = c.post("/v1/score", json={"items": [ok] * 4})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "items"
        long_completion = {"completion": "x" * 51, "answer": "1"}
        r = c.post("/v1/score", json={"items": [ok, ok, long_completion]})
        assert r.status_code == 422
        assert [d["field"] for d in r.json()["detail"]] == ["items.2.completion"]
        r = c.post("/v1/score", json={"items": [{"completion": "a", "answer": "123456"}]})
        assert [d["field"] for d in r.json()["detail"]] == ["items.0.answer"]
        r = c.post("/v1/score", json={"items": [ok] * 3})
        assert r.status_code == 200
        # OpenRLHF: the paths name that protocol's own fields.
        r = c.post(
            "/get_reward",
            json={"query": ["p" + "y" * 60], "prompts": ["p"], "labels": ["1"]},
        )
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "query.0"
        four = {"query": ["pa"] * 4, "prompts": ["p"] * 4, "labels": ["1"] * 4}
        r = c.post("/get_reward", json=four)
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "query"


def test_limit_checks_report_every_field_over_its_limit_and_nothing_else() -> None:
    """The checks skip a field whose longest value cannot be over its limit, even after NFKC,
    and report each one that is, in item order: the same issues as checking every item."""
    service = make_service(max_completion_chars=36, max_answer_chars=4)
    nfkc = "\ufdfa\ufdfa"  # 2 characters, 36 after NFKC: at the limit, not over it
    cases = [
        ([{"completion": nfkc, "answer": "1"}], []),
        ([{"completion": nfkc + "a", "answer": "1"}], ["items.0.completion"]),
        ([{"completion": "a" * 36, "answer": "1", "prompt": "p" * 37}], ["items.0.prompt"]),
        (
            [{"completion": "ok", "answer": "12345"}, {"completion": "x" * 37, "answer": "1"}],
            ["items.0.answer", "items.1.completion"],
        ),
        ([{"completion": "ok", "answer": "1", "group": "g" * 5}], ["items.0.group"]),
    ]
    try:
        with http_client(service) as c:
            for items, fields in cases:
                r = c.post("/v1/score", json={"items": items})
                got = [d["field"] for d in r.json()["detail"]] if r.status_code == 422 else []
                assert got == fields, (items, r.text)
                assert r.status_code == (422 if fields else 200)
    finally:
        service.close()


def test_encoder_budget_counts_the_texts_when_their_count_alone_cannot_clear_it() -> None:
    check_encoder_budget(["abcd"] * 3, 10)  # 3 texts of 3 tokens: 9 <= 10
    with pytest.raises(RequestInvalid) as raised:
        check_encoder_budget(["abcd"] * 4, 10)  # 12 > 10
    assert "needs about 12 encoder tokens" in str(raised.value.issues)
    check_encoder_budget([], 10)


def test_body_limit_is_413_declared_or_streamed() -> None:
    service = make_service(max_body_bytes=1000)
    body = json.dumps({"items": [{"completion": "z" * 2000, "answer": "1"}]}).encode()
    with http_client(service) as c:
        r = c.post("/v1/score", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413

        def chunks() -> Any:  # no content-length: the limit holds while streaming
            for i in range(0, len(body), 100):
                yield body[i : i + 100]

        r = c.post("/v1/score", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/score", json={"items": [{"completion": "a", "answer": "1"}]}).is_success
        assert 'sde2_failures_total{reason="body_too_large"} 2.0' in c.get("/metrics").text


# -- capacity and deadlines -----------------------------------------------------------------------


def test_full_server_answers_429_at_once_then_recovers() -> None:
    encoder = SlowEncoder(delay=0.05)
    service, watch = watched_service(encoder, queue_capacity=2)
    encoder.gate.clear()  # hold the first batch until the burst is done
    with http_client(service) as c, ThreadPoolExecutor(4) as pool:
        held = [
            pool.submit(c.post, "/v1/score", json={"items": [needs_encoder(f"held{i}")]})
            for i in range(2)
        ]
        assert watch.wait_for(admitted=2)
        assert service.batcher.admitted == 2
        t0 = time.monotonic()
        rejected = [
            c.post("/v1/score", json={"items": [needs_encoder(f"burst{i}")]}) for i in range(5)
        ]
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in rejected] == [429] * 5
        assert elapsed < 2.0  # fail fast: nothing waited for the encoder
        assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
        # The body is received only once admitted: a full server buffers none of it.
        received: list[bool] = []

        async def receive() -> None:
            received.append(True)

        def parse() -> Any:
            raise AssertionError("a refused request is never parsed")

        with pytest.raises(Overloaded):
            asyncio.run(service.score(parse, receive=receive))
        assert received == []
        encoder.gate.set()
        assert [f.result(timeout=10).status_code for f in held] == [200, 200]
        after = c.post("/v1/score", json={"items": [needs_encoder("after")]})
        assert after.status_code == 200
        metrics = c.get("/metrics").text
        assert 'sde2_failures_total{reason="overloaded"} 5.0' in metrics
        assert "sde2_admitted_requests 0.0" in metrics


def test_request_past_its_deadline_is_503_and_not_encoded() -> None:
    encoder = SlowEncoder(delay=0.0)
    service = make_service(encoder, request_timeout=0.4)
    encoder.gate.clear()  # the first request's encode lasts until the test opens the gate
    with http_client(service) as c, ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.post, "/v1/score", json={"items": [needs_encoder("first")]})
        assert encoder.entered.wait(10)  # the worker is inside the encoder, for the first
        second = pool.submit(c.post, "/v1/score", json={"items": [needs_encoder("second")]})
        assert first.result(10).status_code == 503  # its encode outlived the deadline
        assert second.result(10).status_code == 503  # still queued at its deadline
        encoder.gate.set()
        # The worker serves the queue in order: once a later request is encoded, the second one
        # was either encoded or dropped.
        later = c.post("/v1/score", json={"items": [needs_encoder("later")]})
        assert later.status_code == 200
        encoded = {t for call in encoder.calls for t in call}
        assert not any("second" in t for t in encoded)  # dropped, never encoded
        assert 'sde2_failures_total{reason="deadline"} 2.0' in c.get("/metrics").text


def test_encoder_failure_is_a_500_that_says_so_and_the_server_survives() -> None:
    class Flaky(HashEncoder):
        fail = False

        def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
            if self.fail:
                raise RuntimeError("boom")
            return super().encode(texts)

    encoder = Flaky()
    with http_client(make_service(encoder)) as c:
        encoder.fail = True
        r = c.post("/v1/score", json={"items": [needs_encoder("x")]})
        assert r.status_code == 500 and "boom" in r.json()["detail"]
        encoder.fail = False
        assert c.post("/v1/score", json={"items": [needs_encoder("x")]}).status_code == 200


# -- batcher --------------------------------------------------------------------------------------


def test_batcher_coalesces_concurrent_requests_and_dedups_texts() -> None:
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=16, batch_tokens=100_000)
    far = time.monotonic() + 30
    first = batcher.submit(["warm"], far)  # occupies the worker at the gate
    assert encoder.entered.wait(5)
    shared = "a strategy every request repeats"
    futures = [batcher.submit([shared, f"own text {i}"], far) for i in range(8)]
    encoder.gate.set()
    results = [f.result(5) for f in [first, *futures]]
    assert len(encoder.calls) == 2  # the gated one, then all eight together
    assert encoder.calls[1].count(shared) == 1  # deduplicated across requests
    assert len(encoder.calls[1]) == 9
    reference = HashEncoder()
    for i, res in enumerate(results[1:]):
        np.testing.assert_array_equal(res.embeddings, reference.encode([shared, f"own text {i}"]))
        assert res.batch_requests == 8 and res.batch_texts == 9
    batcher.close(5)


def test_batcher_respects_the_token_budget() -> None:
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    text = "w" * 400  # ~102 estimated tokens
    budget = 3 * estimate_tokens(f"0{text}")
    batcher = Batcher(encoder, capacity=16, batch_tokens=budget)
    far = time.monotonic() + 30
    futures = [batcher.submit([f"{i}{text}"], far) for i in range(7)]
    encoder.gate.set()
    for f in futures:
        f.result(5)
    sizes = [len(c) for c in encoder.calls]
    assert sum(sizes) == 7 and max(sizes) == 3  # coalesced, but never past the budget
    # A single job larger than the budget still runs (alone).
    big = batcher.submit([f"big {i} {text}" for i in range(5)], far)
    assert big.result(5).embeddings.shape == (5, 384)
    batcher.close(5)


def test_batcher_admission_and_retry_after() -> None:
    batcher = Batcher(HashEncoder(), capacity=2, batch_tokens=1000)
    a, b = batcher.admit(), batcher.admit()
    with pytest.raises(Overloaded) as err:
        batcher.admit()
    assert err.value.retry_after >= 1
    a.release()
    a.release()  # idempotent
    c = batcher.admit()
    assert batcher.admitted == 2
    b.release()
    c.release()
    assert batcher.wait_idle(1)
    batcher.close(5)


def test_batcher_deadline_and_cancellation() -> None:
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=8, batch_tokens=10_000)
    blocker = batcher.submit(["block"], time.monotonic() + 30)
    assert encoder.entered.wait(5)  # the worker holds the blocker at the gate
    soon = time.monotonic() + 0.05
    expired = batcher.submit(["too late"], soon)
    cancelled = batcher.submit(["gone"], time.monotonic() + 30)
    assert cancelled.cancel()
    past(soon)  # the expired job's deadline passes while it is queued
    encoder.gate.set()
    blocker.result(5)
    with pytest.raises(DeadlineExceeded):
        expired.result(5)
    batcher.close(5)
    assert all(t == "block" for call in encoder.calls for t in call)


def test_batcher_worker_survives_encoder_errors() -> None:
    class Broken:
        name = "broken"

        def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
            return np.zeros((len(texts) + 1, 384), np.float32)  # wrong shape

    batcher = Batcher(Broken(), capacity=4, batch_tokens=1000)
    with pytest.raises(EncoderFailed):
        batcher.submit(["a"], time.monotonic() + 5).result(5)
    with pytest.raises(EncoderFailed):  # the worker is still alive
        batcher.submit(["b"], time.monotonic() + 5).result(5)
    batcher.close(5)


class GatedFailure:
    """An encoder whose calls wait at ``gate`` (the worker held inside it, what is submitted
    meanwhile queued), then end as ``end`` says: a failure of the test's choosing."""

    name = "gated-failure"

    def __init__(self, end: Callable[[Sequence[str]], npt.NDArray[np.float32]]) -> None:
        self.end = end
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.entered.set()
        assert self.gate.wait(5)
        return self.end(texts)


def _exit(texts: Sequence[str]) -> npt.NDArray[np.float32]:
    raise SystemExit(3)


def _wrong_shape(texts: Sequence[str]) -> npt.NDArray[np.float32]:
    return np.zeros((len(texts) + 1, 384), np.float32)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_ended_by_a_base_exception_fails_every_request() -> None:
    """SystemExit (or KeyboardInterrupt) raised in engine code ended the worker's thread with
    its batch unanswered and the queue open: requests then waited out their deadlines, and
    later ones were queued for a thread that was gone."""
    encoder = GatedFailure(_exit)
    batcher = Batcher(encoder, capacity=8, batch_tokens=10)
    running = batcher.submit(["a"], time.monotonic() + 30)
    assert encoder.entered.wait(5)
    queued = batcher.submit(["b" * 100], time.monotonic() + 30)  # over the batch: queued
    encoder.gate.set()
    for job in (running, queued):
        with pytest.raises(EncoderFailed, match="the encoder worker stopped: SystemExit"):
            job.result(5)
    with pytest.raises(ShuttingDown):
        batcher.submit(["c"], time.monotonic() + 30)
    batcher.close(5)


def test_jobs_dropped_in_a_batch_the_encoder_fails_are_counted() -> None:
    """A batch whose encoder call fails still reports the jobs it dropped for their deadline
    (the failure returned before the report: the drop went uncounted)."""

    metrics = Metrics()
    encoder = GatedFailure(_wrong_shape)
    batcher = Batcher(encoder, capacity=8, batch_tokens=10_000, observer=metrics)
    blocker = batcher.submit(["block"], time.monotonic() + 30)
    assert encoder.entered.wait(5)
    soon = time.monotonic() + 0.05
    expired = batcher.submit(["too late"], soon)
    failing = batcher.submit(["fails"], time.monotonic() + 30)
    past(soon)
    encoder.gate.set()
    for job, error in (
        (blocker, EncoderFailed),
        (expired, DeadlineExceeded),
        (failing, EncoderFailed),
    ):
        with pytest.raises(error):
            job.result(5)
    batcher.close(5)
    assert metrics.registry.get_sample_value("sde2_batch_dropped_jobs_total") == 1


def test_abandoned_queued_jobs_leave_the_queue_at_once() -> None:
    """Jobs whose callers left while queued are taken out of the queue then, not when the
    worker reaches them: the backlog that admission reads, the queue gauges and the dropped
    counter say so at once, and a live request their work would have refused is taken."""
    metrics = DepthWatch()
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=8, batch_tokens=256, max_backlog_seconds=20,
                      observer=metrics)  # fmt: skip
    batcher._tokens_per_second = 100.0  # a known rate: a 256-token job is ~2.6 s of backlog
    blocker = batcher.submit(["hold the worker"], time.monotonic() + 60)
    assert encoder.entered.wait(5)
    long_texts = [f"queued text {i} " + "w" * 1200 for i in range(1)]  # 256 estimated tokens
    queued = [batcher.submit(long_texts, time.monotonic() + 60) for _ in range(3)]
    assert metrics.wait_for(queued=3)
    for future in queued:
        future.abandon()
    assert metrics.wait_for(queued=0)
    gauge = metrics.registry.get_sample_value
    assert gauge("sde2_queue_depth") == 0 and gauge("sde2_queue_tokens") == 0
    assert gauge("sde2_batch_dropped_jobs_total") == 3
    # ~8 s of dead work ahead of it would outlast this deadline (a 429 before): now taken.
    live = batcher.submit(long_texts, time.monotonic() + 6)
    encoder.gate.set()
    assert live.result(10).embeddings.shape == (1, 384)
    assert blocker.result(10).embeddings.shape == (1, 384)
    assert sum(call.count(long_texts[0]) for call in encoder.calls) == 1  # the live one only
    batcher.close(5)
    assert gauge("sde2_batch_dropped_jobs_total") == 3  # each counted once


def test_a_request_dropped_midway_leaves_the_worker_and_the_metrics_sound() -> None:
    """Two requests in one batch, one past its deadline after the first chunk: the other gets its
    rows, the dedup counter stays sound (the dropped request's texts were encoded but are not
    the batch's), and the worker serves the next request."""
    metrics = Metrics()
    encoder = SlowEncoder(delay=0.3)  # one chunk of 50 estimated tokens a call
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=8, batch_tokens=100_000, chunk_tokens=50, observer=metrics)
    blocker = batcher.submit(["hold the worker"], time.monotonic() + 30)
    assert encoder.entered.wait(5)
    now = time.monotonic()
    # Longest first: the dropped request's texts are encoded in the batch's first chunks.
    dropped = batcher.submit([f"long text {i} " * 20 for i in range(4)], now + 0.5)
    kept = batcher.submit(["short", "short"], now + 30)
    encoder.gate.set()
    blocker.result(10)
    assert kept.result(10).embeddings.shape == (2, 384)
    with pytest.raises(DeadlineExceeded, match="while encoding"):
        dropped.result(10)
    later = batcher.submit(["a later request"], time.monotonic() + 5)
    assert later.result(5).embeddings.shape == (1, 384)
    text = metrics.render().decode()
    assert re.search(r"^sde2_batch_deduplicated_texts_total 1\.0$", text, re.M), text
    batcher.close(5)


def test_the_worker_outlives_a_failing_observer_and_refuses_non_finite_rows() -> None:
    class Failing(Metrics):
        def on_batch(self, record: Any) -> None:
            raise RuntimeError("observer broke")

    class Nan(HashEncoder):
        def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
            out = super().encode(texts)
            if "nan" in texts:
                out[list(texts).index("nan"), 0] = np.nan
            return out

    batcher = Batcher(Nan(), capacity=4, batch_tokens=1000, observer=Failing())
    assert batcher.submit(["a"], time.monotonic() + 5).result(5).embeddings.shape == (1, 384)
    with pytest.raises(EncoderFailed, match="non-finite"):
        batcher.submit(["b", "nan"], time.monotonic() + 5).result(5)
    assert batcher.submit(["c"], time.monotonic() + 5).result(5).embeddings.shape == (1, 384)
    batcher.close(5)


def test_a_non_finite_embedding_is_a_500_that_says_so_and_is_not_cached() -> None:
    class Nan(HashEncoder):
        broken = True

        def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
            out = super().encode(texts)
            if self.broken:
                out[:, 0] = np.nan
            return out

    encoder = Nan()
    from reward_server.encoders.cache import CachedEncoder

    with http_client(make_service(CachedEncoder(encoder, 100))) as c:
        item = {"items": [needs_encoder("x")]}
        for _ in range(2):  # the second time too: the bad rows were not kept
            r = c.post("/v1/score", json=item)
            assert r.status_code == 500 and "non-finite" in r.json()["detail"], r.text
        encoder.broken = False
        assert c.post("/v1/score", json=item).status_code == 200
        assert 'sde2_failures_total{reason="encoder"}' in c.get("/metrics").text


def test_batcher_close_finishes_queued_work() -> None:
    encoder = SlowEncoder(delay=0.05)
    batcher = Batcher(encoder, capacity=8, batch_tokens=10)
    futures = [batcher.submit([f"t{i}"], time.monotonic() + 30) for i in range(4)]
    batcher.close(5)
    assert all(f.result(0).embeddings.shape == (1, 384) for f in futures)


def test_concurrent_http_requests_share_batches() -> None:
    encoder = SlowEncoder(delay=0.0)
    service, watch = watched_service(encoder, queue_capacity=32)
    encoder.calls.clear()  # forget the warm-up
    encoder.gate.clear()  # the first request holds the worker until all twelve are in
    bodies = [{"items": [needs_encoder(f"r{i}", 3)]} for i in range(12)]
    with http_client(service) as c, ThreadPoolExecutor(12) as pool:
        pending = [pool.submit(c.post, "/v1/score", json=b) for b in bodies]
        assert encoder.entered.wait(10)
        inside = {text.split()[0] for text in encoder.held}  # the requests the worker holds
        assert watch.wait_for(queued=len(bodies) - len(inside))  # every other one is queued
        encoder.gate.set()
        responses = [f.result(10) for f in pending]
    assert all(r.status_code == 200 for r in responses)
    assert len(encoder.calls) < len(bodies)  # coalesced
    assert sum(len(call) for call in encoder.calls) == 36
    queue_times = [float(r.headers["x-queue-time"]) for r in responses]
    assert max(queue_times) > 0


# -- settings -------------------------------------------------------------------------------------


def test_settings_flags_then_env_then_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--port", "9001", "--max-items", "7", "--grpc-port", "5"])
    env = {
        "SDE2_PORT": "1",
        "SDE2_QUEUE_CAPACITY": "3",
        "SDE2_API_KEY": "k",
        "SDE2_REQUEST_TIMEOUT": "2.5",
        "SDE2_MODEL": "/models/x",
    }
    s = load_settings(args, env)
    assert (s.port, s.max_items, s.grpc_port) == (9001, 7, 5)  # flags win
    assert (s.queue_capacity, s.api_key, s.request_timeout) == (3, "k", 2.5)  # env next
    assert s.model == "/models/x"
    assert s.max_body_bytes == Settings().max_body_bytes  # default
    assert s.public()["api_key_required"] is True  # never the key itself
    with pytest.raises(SystemExit):
        parser.parse_args(["--api-key", "x"])  # the key is env-only (not visible in ps)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SDE2_MAX_ITEMS": "0"}, "max_items (--max-items / SDE2_MAX_ITEMS) must be an integer"),
        ({"SDE2_PORT": "eighty"}, "SDE2_PORT='eighty'"),
        ({"SDE2_PORT": "70000"}, "port (--port / SDE2_PORT) must be a port number"),
        ({"SDE2_PROVIDER": "tpu"}, "provider (--provider / SDE2_PROVIDER) must be one of"),
        ({"SDE2_QUEUE_CAPACITY": "0"}, "queue_capacity (--queue-capacity"),
        ({"SDE2_WORKERS": "0"}, "workers (--workers / SDE2_WORKERS)"),
        ({"SDE2_BATCH_TOKENS": "-1"}, "batch_tokens (--batch-tokens"),
        ({"SDE2_MATH_TIMEOUT": "0"}, "math_timeout (--math-timeout / SDE2_MATH_TIMEOUT) must be"),
        ({"SDE2_DRAIN_TIMEOUT": "-1"}, "drain_timeout (--drain-timeout"),
        (
            {"SDE2_DRAIN_TIMEOUT": "inf"},
            "drain_timeout (--drain-timeout / SDE2_DRAIN_TIMEOUT) must be a finite number, got inf",
        ),
        (
            {"SDE2_BODY_TIMEOUT": "1e400"},
            "body_timeout (--body-timeout / SDE2_BODY_TIMEOUT) must be a finite number",
        ),
        ({"SDE2_REQUEST_TIMEOUT": "nan"}, "request_timeout (--request-timeout"),
        (
            {"SDE2_DRAIN_TIMEOUT": "1e308"},  # finite, but no wait can last that long
            "drain_timeout (--drain-timeout / SDE2_DRAIN_TIMEOUT) must be at most 31536000 s",
        ),
        ({"SDE2_KEEP_ALIVE_TIMEOUT": str(10**12)}, "keep_alive_timeout (--keep-alive-timeout"),
        (
            {"SDE2_API_KEY": "clé secrète"},  # no header or gRPC metadata can carry it
            "api_key (SDE2_API_KEY) must be printable ASCII without spaces, got a value not shown",
        ),
        (
            {"SDE2_MAX_BODY_BYTES": str(2**31)},  # past gRPC's 32-bit message limit
            "max_body_bytes (--max-body-bytes / SDE2_MAX_BODY_BYTES) must be at most 2147483647",
        ),
        ({"SDE2_LOG_LEVEL": "verbose"}, "log_level (--log-level / SDE2_LOG_LEVEL) must be one of"),
        ({"SDE2_INTRA_OP_THREADS": "0"}, "intra_op_threads (--intra-op-threads"),
        (  # --workers binds both with SO_REUSEPORT: gRPC clients reached the HTTP server
            {"SDE2_PORT": "9000", "SDE2_GRPC_PORT": "9000"},
            "grpc_port (--grpc-port / SDE2_GRPC_PORT) must be another port than --port",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        load_settings(None, env)


def test_an_empty_api_key_variable_means_no_key() -> None:
    assert load_settings(None, {"SDE2_API_KEY": ""}).api_key is None
    assert load_settings(None, {"SDE2_API_KEY": ""}).public()["api_key_required"] is False
    assert Settings(drain_timeout=0.0).drain_timeout == 0.0  # 0: cancel at once, not "forever"


def test_capacity_threads_do_not_leak() -> None:
    before = threading.active_count()
    for _ in range(3):
        service = make_service()
        service.close()
    deadline = time.monotonic() + 10  # closed pools' threads exit on their own schedule
    while threading.active_count() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before + 1


def test_batcher_refuses_work_that_would_outlast_the_deadline() -> None:
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=100, batch_tokens=1000, max_backlog_seconds=1.0)
    far = time.monotonic() + 30
    blocker = batcher.submit(["block"], far)  # the worker holds this one at the gate
    assert encoder.entered.wait(5)
    # ~25k estimated tokens queued: at the starting estimate of 5k tokens/s, ~5 s of work.
    queued = [batcher.submit(["t" * 1000 + str(i)], far) for i in range(100)]
    with pytest.raises(Overloaded) as err:
        batcher.admit()
    assert err.value.retry_after >= 2
    encoder.gate.set()
    for f in [blocker, *queued]:
        f.result(10)
    batcher.admit().release()  # the backlog is gone: admitted again
    batcher.close(5)


def test_work_queued_behind_a_backlog_past_its_deadline_is_429_at_once() -> None:
    """A burst of large requests was admitted (admission knows only the backlog), then each
    answered 503 after waiting out its whole deadline. Work that the queue ahead of it and
    its own would take past its deadline is refused at once with Retry-After; alone, a
    request is still tried."""
    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    batcher = Batcher(encoder, capacity=100, batch_tokens=1000)
    far = time.monotonic() + 30
    blocker = batcher.submit(["block"], far)  # the worker holds this one at the gate
    assert encoder.entered.wait(5)
    # ~25k estimated tokens queued: at the starting estimate of 5k tokens/s, ~5 s of work.
    queued = [batcher.submit(["t" * 1000 + str(i)], far) for i in range(100)]
    with pytest.raises(Overloaded) as err:
        batcher.submit(["late " * 200], time.monotonic() + 3)
    assert err.value.retry_after >= 2 and "would outlast its deadline" in err.value.message
    assert "alone" not in err.value.message  # retrying when the queue is gone can help
    with pytest.raises(Overloaded) as err:  # its own work alone is past its deadline
        batcher.submit(["t" * 1000] * 50, time.monotonic() + 1)
    assert "its own work alone is estimated over the 1 s its deadline leaves" in err.value.message
    encoder.gate.set()
    for f in [blocker, *queued]:
        f.result(10)
    alone = batcher.submit(["t" * 1000] * 50, time.monotonic() + 1)  # ~2.5 s estimated: tried
    assert alone.result(10).embeddings.shape[0] == 50
    batcher.close(5)


async def asgi_post(app: Any, item: dict[str, Any], left: asyncio.Event) -> tuple[int, bytes]:
    """``POST /v1/score`` of one item as raw ASGI: the status and body; the client disconnects
    once ``left`` is set."""
    body = json.dumps({"items": [item]}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/score", "raw_path": b"/v1/score", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    sent = False
    status: list[int] = []
    answer: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            answer.append(message.get("body", b""))

    await app(scope, receive, send)
    return status[0], b"".join(answer)


def test_a_client_gone_while_its_texts_wait_is_dropped_unencoded() -> None:
    """Over HTTP, a client that disconnects while its texts wait for the encoder frees its
    admission slot at once (499, counted) and its texts are never encoded; the one before it is
    answered as usual."""
    from reward_server.service.http_app import create_app

    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    service = make_service(encoder)
    app = create_app(service)

    async def run() -> tuple[int, int, int]:
        stays, goes = asyncio.Event(), asyncio.Event()
        first = asyncio.ensure_future(asgi_post(app, needs_encoder("first"), stays))
        assert await asyncio.to_thread(encoder.entered.wait, 5)  # the worker holds "first"
        second = asyncio.ensure_future(asgi_post(app, needs_encoder("second"), goes))
        while service.batcher is None or service.batcher.queued < 1:
            await asyncio.sleep(0.01)
        admitted = service.batcher.admitted
        goes.set()  # "second" disconnects while queued
        gone_status, _ = await asyncio.wait_for(second, 5)
        after = service.batcher.admitted
        encoder.gate.set()
        first_status, _ = await asyncio.wait_for(first, 5)
        return first_status, gone_status, admitted - after

    first_status, gone_status, freed = asyncio.run(run())
    assert (first_status, gone_status, freed) == (200, 499, 1)
    assert not any("second" in t for call in encoder.calls for t in call), encoder.calls
    text = service.metrics.render().decode()
    assert 'sde2_failures_total{reason="client_disconnect"} 1.0' in text


def test_the_drain_end_answers_what_still_waits_503_and_frees_its_slot() -> None:
    """:meth:`ScoringService.end_drain` (the drain timeout passed): a request whose texts wait
    for the encoder answers 503 shutting_down at once with its slot freed and its texts never
    encoded, as does any request after it; the one being encoded is cut too."""
    from reward_server.service.http_app import create_app

    encoder = SlowEncoder(delay=0.0)
    encoder.gate.clear()
    service = make_service(encoder)
    app = create_app(service)

    async def run() -> list[tuple[int, bytes]]:
        never = asyncio.Event()
        first = asyncio.ensure_future(asgi_post(app, needs_encoder("first"), never))
        assert await asyncio.to_thread(encoder.entered.wait, 5)  # the worker holds "first"
        second = asyncio.ensure_future(asgi_post(app, needs_encoder("second"), never))
        while service.batcher is None or service.batcher.queued < 1:
            await asyncio.sleep(0.01)
        assert service.end_drain() == 2
        answers = [await asyncio.wait_for(f, 5) for f in (first, second)]
        assert service.batcher.admitted == 0
        later = await asyncio.wait_for(asgi_post(app, needs_encoder("third"), never), 5)
        encoder.gate.set()
        return [*answers, later]

    answers = asyncio.run(run())
    service.close()  # the worker ends its queue: whatever it would still encode, it has
    assert [status for status, _ in answers] == [503] * 3
    assert all("shutting down" in json.loads(body)["detail"] for _, body in answers)
    assert not any("second" in t or "third" in t for call in encoder.calls for t in call)
    text = service.metrics.render().decode()
    assert 'sde2_failures_total{reason="shutting_down"} 3.0' in text


def test_a_job_submitted_while_the_batcher_closes_is_served_or_refused() -> None:
    """``submit`` racing ``close``: each job is encoded, or refused with ShuttingDown; none is
    queued after the worker has returned (its future would never complete)."""
    from concurrent.futures import wait

    lost = served = 0
    for _ in range(300):
        batcher = Batcher(HashEncoder(), capacity=4, batch_tokens=1000)
        go, first = threading.Event(), threading.Event()
        futures: list[Any] = []

        def submit(
            batcher: Batcher = batcher,
            go: threading.Event = go,
            first: threading.Event = first,
            futures: list[Any] = futures,
        ) -> None:
            go.wait()
            for _ in range(50):
                try:
                    futures.append(batcher.submit(["x"], time.monotonic() + 60))
                except ShuttingDown:
                    return
                finally:
                    first.set()

        thread = threading.Thread(target=submit)
        thread.start()
        go.set()
        first.wait(5)  # the race starts once submitting has (on a loaded machine, not always)
        batcher.close()
        thread.join()
        done, pending = wait(futures, timeout=1.0)
        served, lost = served + len(done), lost + len(pending)
    assert lost == 0 and served > 0


def test_a_finished_job_is_freed_without_the_cycle_collector() -> None:
    """A job's future held the withdraw closure, which held the job, which held the future: each
    answered request's embeddings and texts waited for a cyclic GC pass."""
    batcher = Batcher(HashEncoder(), capacity=4, batch_tokens=1000)
    gc.disable()
    try:
        first = batcher.submit(["a first text"], time.monotonic() + 5)
        first.result(5)
        freed = weakref.ref(first)
        del first
        # The worker keeps its latest batch until the next one: run another.
        batcher.submit(["a second text"], time.monotonic() + 5).result(5)
        assert freed() is None
    finally:
        gc.enable()
        batcher.close(5)
