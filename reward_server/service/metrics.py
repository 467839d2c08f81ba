"""Prometheus metrics of the reward server, on a registry of its own.

An own :class:`CollectorRegistry` (not the global default) so that several apps in one process
(tests) never collide and ``/metrics`` shows exactly this server. The names follow
text-embeddings-inference's split of a request into phases (parse, queue, encode, reward), so
the usual dashboards answer "where does the time go" without guessing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
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
#: Where prometheus_client's multiprocess mode keeps each process's values.
SHARED_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


class _EncoderCounters:
    """The encoder's own running totals (cache lookups, tokens actually computed) as counters,
    brought up to date from :meth:`Encoder.stats` by :meth:`sync`: the encoder stays free of
    any metrics dependency, and the counters, unlike a collector reading the encoder at scrape
    time, add up across ``--workers`` processes."""

    _WORK = (
        ("tokens", "real tokens embedded"),
        ("padded_tokens", "tokens computed including padding"),
        ("batches", "onnxruntime runs"),
        ("texts", "texts embedded by the model"),
    )

    def __init__(self, encoder: Encoder, registry: CollectorRegistry) -> None:
        self.encoder = encoder
        self.registry = registry
        self.lookups = Counter(
            "sde2_cache_lookups",
            "embedding cache lookups by result",
            ["result"],
            registry=registry,
        )
        self.work: dict[str, Counter] = {}  # created once the backend reports its work
        self.seen: dict[str, int] = {}  # each total as last counted
        self.lock = threading.Lock()  # synced from the event loop and the batcher's thread

    def sync(self) -> None:
        """Count what the encoder did since the last call."""
        stats = self.encoder.stats()
        with self.lock:
            if stats.cache is not None:
                self._add("hit", stats.cache.hits, self.lookups.labels("hit"))
                self._add("miss", stats.cache.misses, self.lookups.labels("miss"))
            if stats.work is not None:
                for name, help_text in self._WORK:
                    counter = self.work.get(name)
                    if counter is None:
                        counter = self.work[name] = Counter(
                            f"sde2_encoder_{name}", help_text, registry=self.registry
                        )
                    self._add(name, getattr(stats.work, name), counter)

    def _add(self, key: str, total: int, counter: Counter) -> None:
        counter.inc(max(0, total - self.seen.get(key, 0)))
        self.seen[key] = max(total, self.seen.get(key, 0))


class _HitRatio(Collector):
    """``sde2_cache_hit_ratio`` from the lookups ``source`` counts (nothing without a cache).
    A collector, never a :class:`Gauge`: in multiprocess mode a gauge would write each
    scrape's ratio to the shared folder, to be read back as a stale series of its own."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        hits, misses = (
            self.source.get_sample_value("sde2_cache_lookups_total", {"result": result})
            for result in ("hit", "miss")
        )
        if hits is None or misses is None:
            return
        ratio = GaugeMetricFamily(
            "sde2_cache_hit_ratio", "share of embedding lookups served by the cache"
        )
        ratio.add_metric([], hits / (hits + misses) if hits + misses else 0.0)
        yield ratio


class Metrics(BatchObserver):
    """Every metric of one server; also the batcher's observer.

    ``shared_dir``: the folder the ``--workers`` processes of one server share, set as
    ``PROMETHEUS_MULTIPROC_DIR`` before this process imported ``prometheus_client``
    (prometheus_client's multiprocess mode: each process writes its values there). Whichever
    worker answers a scrape then shows the sum over all of them (the gauges: over the live
    ones; ``sde2_ready``: their least), so counters never seem to go back and forth.
    """

    def __init__(self, shared_dir: str | None = None) -> None:
        if shared_dir is not None and os.environ.get(SHARED_DIR_VARIABLE) != shared_dir:
            raise RuntimeError(
                f"Metrics(shared_dir={shared_dir!r}) needs {SHARED_DIR_VARIABLE} set to it "
                "before prometheus_client is imported"
            )
        self.shared_dir = shared_dir
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

        # Summed over the live workers when there are several (see ``shared_dir``).
        def live_sum(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, registry=r, multiprocess_mode="livesum")

        self.admitted = live_sum("sde2_admitted_requests", "requests admitted now")
        self.queue_depth = live_sum("sde2_queue_depth", "requests waiting for the encoder")
        self.queue_tokens = live_sum(
            "sde2_queue_tokens", "estimated tokens waiting for the encoder"
        )
        self.ready = Gauge(
            "sde2_ready",
            "1 once the model is loaded and warm",
            registry=r,
            multiprocess_mode="livemin",
        )
        self._encoder: _EncoderCounters | None = None

    def attach_encoder(self, encoder: Encoder) -> None:
        """Count the encoder's own totals (cache, tokens) from now on."""
        self._encoder = _EncoderCounters(encoder, self.registry)
        self._encoder.sync()

    def _sync_shared(self) -> None:
        """Bring the encoder's counters up to date where other processes read them: a worker
        whose scrape another worker answers is counted as of its last request or encoder call
        (one process syncs at each scrape, which is exact)."""
        if self.shared_dir is not None and self._encoder is not None:
            self._encoder.sync()

    def count(self, route: str, status: str, reason: str | None = None) -> None:
        """One answered request of ``route`` (an HTTP path or ``grpc:<Method>``) under its
        status, and, for a refusal or a failure, its ``reason`` too: every transport counts
        through here, so a reason and its status are never counted apart."""
        if reason is not None:
            self.failures.labels(reason).inc()
        self.requests.labels(route, status).inc()

    def observe_phases(self, seconds: dict[str, float]) -> None:
        """Record one request's phase timings."""
        for phase, value in seconds.items():
            self.latency.labels(phase).observe(value)
        self._sync_shared()

    def on_batch(self, record: BatchRecord) -> None:
        """Batcher hook: one encoder call finished."""
        self._sync_shared()
        if not record.requests:
            return
        self.batch_requests.observe(record.requests)
        self.batch_texts.observe(record.distinct_texts)
        self.batch_tokens.observe(record.tokens)
        self.deduplicated.inc(record.texts - record.distinct_texts)

    def on_dropped(self, jobs: int) -> None:
        """Batcher hook: queued jobs skipped (deadline or a gone caller)."""
        self.dropped.inc(jobs)

    def on_depth(self, admitted: int, queued_requests: int, queued_tokens: int) -> None:
        """Batcher hook: admission or queue changed."""
        self.admitted.set(admitted)
        self.queue_depth.set(queued_requests)
        self.queue_tokens.set(queued_tokens)

    def render(self) -> bytes:
        """The text exposition format: this process's metrics, or, with ``shared_dir``, every
        worker's added up."""
        if self._encoder is not None:
            self._encoder.sync()
        if self.shared_dir is None:
            source = self.registry
        else:
            source = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(source, path=self.shared_dir)
        ratio = CollectorRegistry(auto_describe=False)
        ratio.register(_HitRatio(source))
        return generate_latest(source) + generate_latest(ratio)
