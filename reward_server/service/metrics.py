"""Prometheus metrics of the reward server, on a registry of its own.

An own :class:`CollectorRegistry` (not the global default) so that several apps in one process
(tests) never collide and ``/metrics`` shows exactly this server. The names follow
text-embeddings-inference's split of a request into phases (parse, queue, encode, reward), so
the usual dashboards answer "where does the time go" without guessing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from reward_server.encoders.base import Encoder
from reward_server.service.batcher import BatchObserver, BatchRecord

#: Seconds: from sub-millisecond parsing up to the slowest full GRPO step on a small CPU.
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TOKEN_BUCKETS = (64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
PHASES = ("parse", "queue", "encode", "reward", "total")


class _EncoderCollector(Collector):
    """Reads the encoder's own counters at scrape time (cache hits, tokens actually computed),
    so the encoder stays free of any metrics dependency."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder

    def collect(self) -> Iterator[Any]:
        stats = self.encoder.stats()
        if stats.cache is not None:
            hits, misses = stats.cache.hits, stats.cache.misses
            lookups = CounterMetricFamily(
                "sde2_cache_lookups", "embedding cache lookups by result", labels=["result"]
            )
            lookups.add_metric(["hit"], hits)
            lookups.add_metric(["miss"], misses)
            yield lookups
            ratio = GaugeMetricFamily(
                "sde2_cache_hit_ratio", "share of embedding lookups served by the cache"
            )
            ratio.add_metric([], hits / (hits + misses) if hits + misses else 0.0)
            yield ratio
        work = stats.work
        if work is not None:
            for name, value, help_text in (
                ("tokens", work.tokens, "real tokens embedded"),
                ("padded_tokens", work.padded_tokens, "tokens computed including padding"),
                ("batches", work.batches, "onnxruntime runs"),
                ("texts", work.texts, "texts embedded by the model"),
            ):
                c = CounterMetricFamily(f"sde2_encoder_{name}", help_text)
                c.add_metric([], value)
                yield c


class Metrics(BatchObserver):
    """Every metric of one server; also the batcher's observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sde2_requests", "requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "sde2_request_phase_seconds",
            "request latency by phase (parse, queue, encode, reward, total)",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "sde2_failures", "rejected or failed requests by reason", ["reason"], registry=r
        )
        self.items = Histogram(
            "sde2_request_items", "items per scored request", buckets=_COUNT_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "sde2_batch_requests",
            "requests coalesced into one encoder call",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.batch_texts = Histogram(
            "sde2_batch_texts",
            "distinct texts per encoder call",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "sde2_batch_tokens",
            "estimated tokens per encoder call",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.deduplicated = Counter(
            "sde2_batch_deduplicated_texts",
            "texts saved by deduplication across a coalesced batch",
            registry=r,
        )
        self.dropped = Counter(
            "sde2_batch_dropped_jobs",
            "queued requests skipped because of their deadline or a gone caller",
            registry=r,
        )
        self.math_timeouts = Counter(
            "sde2_math_check_timeouts",
            "answer_type=math checks stopped at --math-timeout (counted as not equivalent)",
            registry=r,
        )
        self.admitted = Gauge("sde2_admitted_requests", "requests admitted now", registry=r)
        self.queue_depth = Gauge("sde2_queue_depth", "requests waiting for the encoder", registry=r)
        self.queue_tokens = Gauge(
            "sde2_queue_tokens", "estimated tokens waiting for the encoder", registry=r
        )
        self.ready = Gauge("sde2_ready", "1 once the model is loaded and warm", registry=r)

    def attach_encoder(self, encoder: Encoder) -> None:
        """Expose the encoder's own counters (cache, tokens) at scrape time."""
        self.registry.register(_EncoderCollector(encoder))

    def observe_phases(self, seconds: dict[str, float]) -> None:
        """Record one request's phase timings."""
        for phase, value in seconds.items():
            self.latency.labels(phase).observe(value)

    def on_batch(self, record: BatchRecord) -> None:
        """Batcher hook: one encoder call finished."""
        if record.dropped:
            self.dropped.inc(record.dropped)
        if not record.requests:
            return
        self.batch_requests.observe(record.requests)
        self.batch_texts.observe(record.distinct_texts)
        self.batch_tokens.observe(record.tokens)
        self.deduplicated.inc(record.texts - record.distinct_texts)

    def on_depth(self, admitted: int, queued_requests: int, queued_tokens: int) -> None:
        """Batcher hook: admission or queue changed."""
        self.admitted.set(admitted)
        self.queue_depth.set(queued_requests)
        self.queue_tokens.set(queued_tokens)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
