"""Length-sorted, token-budgeted batches of the exported graph, for any engine that runs it.

The export (:mod:`onnx_export`) is one graph: BERT, mean pooling and normalization. Three engines
run it on CPU (onnxruntime, :mod:`onnx_runtime`; OpenVINO, :mod:`openvino_runtime`;
CTranslate2, :mod:`ctranslate2_runtime`, from a model converted out of the graph) and one on
CUDA (onnxruntime). What they share is here, in :class:`BatchedEncoder`; each engine supplies
only the run of one padded batch. Where the speed comes from (figures in
``benchmarks/README.md``):

* length-sorted, token-budgeted batches: texts are sorted by token count and cut so that a
  batch's *padded* size (rows × longest row) stays within ``max_batch_tokens``. Padding is pure
  waste and attention cost grows with the padded length, so mixing one 256-token text with many
  20-token ones would multiply the work;
* *small* batches on CPU: much of the time goes to memory-bound ops (layer norms, GELU, the
  attention core) that read and write whole activation tensors, and a small batch keeps those
  tensors in cache between ops;
* threads sized to the CPUs this process may really use (affinity mask and cgroup quota), not
  ``os.cpu_count()``: in a container limited to 2 CPUs on a 64-core host, 64 threads are much
  slower than 2;
* on CPU, two batches at once (*streams*), each run with its share of the threads: a small
  batch's ops are too short to split well across cores (every op ends in a barrier), while two
  independent runs keep both cores busy. A text's embedding does not depend on the stream that
  ran it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import (
    EMBEDDING_DIM,
    MAX_SEQ_LENGTH,
    EncoderDescription,
    EncoderStats,
    EncodeStats,
    Provider,
)
from reward_server.encoders.model_store import verify_manifest
from reward_server.encoders.tokenization import encode_ids, load_tokenizer

#: A text joins a batch only if it is at least this share of the batch's longest (padding waste).
MIN_ROW_FILL = 0.8
#: Batches run at once on CPU by default (when there are at least as many threads).
DEFAULT_CPU_STREAMS = 2


def _cgroup_cpu_limit(root: Path) -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), if any."""
    v2 = root / "cpu.max"
    try:
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            if quota != "max" and period:
                return int(quota) / int(period)
            return None
        q1, p1 = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if q1.is_file() and p1.is_file():
            quota_us, period_us = int(q1.read_text()), int(p1.read_text())
            if quota_us > 0 and period_us > 0:
                return quota_us / period_us
    except (OSError, ValueError):
        return None
    return None


def available_cpus(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """CPUs this process can actually use: min(affinity mask, ceil(cgroup quota)), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    limit = _cgroup_cpu_limit(Path(cgroup_root))
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def default_streams(provider: Provider, threads: int) -> int:
    """Batches to run at once: :data:`DEFAULT_CPU_STREAMS` on CPU when there are that many
    threads to share out, else one (a GPU runs one large batch at a time).

    >>> default_streams("cpu", 2), default_streams("cpu", 1), default_streams("cuda", 8)
    (2, 1, 1)
    """
    if provider != "cpu":
        return 1
    return max(1, min(DEFAULT_CPU_STREAMS, threads))


def graph_feeds(
    ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64], input_names: Collection[str]
) -> dict[str, npt.NDArray[np.int64]]:
    """The inputs of an exported graph (onnxruntime's and OpenVINO's): ``token_type_ids``, all
    zeros (one segment), only where the graph takes it.

    >>> sorted(graph_feeds(np.ones((1, 2), np.int64), np.ones((1, 2), np.int64), {"input_ids"}))
    ['attention_mask', 'input_ids']
    """
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in input_names:
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


def plan_batches(
    lengths: Sequence[int],
    max_batch_tokens: int,
    min_fill: float = MIN_ROW_FILL,
    run_width: Callable[[int], int] | None = None,
) -> list[npt.NDArray[np.intp]]:
    """Cut indices, sorted by length, into batches whose padded size fits ``max_batch_tokens``.

    Sorting descending makes each batch's first row its longest, so the padded size is known when
    the batch opens. A batch is also closed when the next text is shorter than ``min_fill`` times
    the batch's longest: otherwise a 256-token text would drag a dozen 10-token texts up to 256
    (padding is computed like real tokens). A text longer than the budget gets a batch of its own.
    ``run_width(longest)``: the length the engine computes such a batch at, when it pads further
    (onnxruntime on CUDA, :meth:`BatchedEncoder._run_width`); the rows are counted at it.

    >>> [len(b) for b in plan_batches([3] * 10, 64)], [len(b) for b in plan_batches([3] * 10, 64,
    ...     run_width=lambda n: 32)]
    ([10], [2, 2, 2, 2, 2])
    """
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches: list[npt.NDArray[np.intp]] = []
    start = 0
    while start < len(order):
        longest = max(1, int(lengths[order[start]]))
        width = longest if run_width is None else max(longest, run_width(longest))
        rows = max(1, max_batch_tokens // width)
        stop = min(start + rows, len(order))
        end = start + 1
        while end < stop and lengths[order[end]] >= min_fill * longest:
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


class BatchedEncoder(ABC):
    """An :class:`~reward_server.encoders.base.Encoder` over an export folder: tokenization,
    batches, streams and counters; a subclass runs one padded batch (:meth:`_run`).

    Thread-safe when the engine's runs are (every engine's are); the counters have a lock.
    """

    #: ``EncoderDescription.backend`` and the word in :attr:`name`.
    backend: ClassVar[str]

    def __init__(
        self,
        model_dir: str | Path,
        *,
        provider: Provider = "cpu",
        intra_op_threads: int | None = None,
        streams: int | None = None,
        max_batch_tokens: int | None = None,
        min_row_fill: float = MIN_ROW_FILL,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = verify_manifest(self.model_dir)
        self.variant: str = str(self.manifest.get("variant", "fp32"))
        self.provider: Provider = provider
        self.max_seq_length = int(self.manifest.get("max_seq_length", MAX_SEQ_LENGTH))
        # None is the default; 0 or less is refused (``or`` read 0 as the default).
        for name, value in (
            ("max_batch_tokens", max_batch_tokens),
            ("intra_op_threads", intra_op_threads),
            ("streams", streams),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_batch_tokens = max_batch_tokens or self._default_batch_tokens()
        self.min_row_fill = min_row_fill
        self.intra_op_threads = intra_op_threads or available_cpus()
        self.streams = (
            default_streams(provider, self.intra_op_threads) if streams is None else streams
        )
        self._streams_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._tokenizer = load_tokenizer(self.model_dir, self.max_seq_length)
        self._stats_lock = threading.Lock()
        self.totals = EncodeStats()
        model_name = str(self.manifest.get("model_name", "all-MiniLM-L6-v2"))
        suffix = " cuda" if provider == "cuda" else ""
        self._name = f"{model_name} {self.backend} {self.variant}{suffix}"
        self._open()

    @abstractmethod
    def _default_batch_tokens(self) -> int:
        """Padded tokens per run when none is asked for (the engine's and provider's best)."""

    @abstractmethod
    def _open(self) -> None:
        """Check that the engine can run this export here (raising why not) and load it."""

    def _require_cpu_fp32(self, error: type[Exception]) -> None:
        """Raise ``error`` unless this is the fp32 export on the CPU: what the engines other
        than onnxruntime run (the fidelity gate was passed by that graph on onnxruntime)."""
        if self.provider != "cpu":
            raise error(
                f"the {self.backend} backend runs on the CPU only, not {self.provider!r}: "
                "use --backend onnx for CUDA"
            )
        if self.variant != "fp32":
            raise error(
                f"{self.model_dir} holds the {self.variant} export; the {self.backend} backend "
                "runs the fp32 export (--variant fp32)"
            )

    @property
    def name(self) -> str:
        """E.g. ``"all-MiniLM-L6-v2 onnx fp32"`` (what the response's ``encoder`` field shows)."""
        return self._name

    @property
    def dimension(self) -> int:
        """The export's embedding length (384 for all-MiniLM-L6-v2)."""
        return int(self.manifest.get("embedding_dim", EMBEDDING_DIM))

    def warmup(self) -> None:
        """Run a few batches of different shapes so first requests do not pay allocator setup."""
        self.encode(["warm up " * n for n in (1, 8, 64, 200)])

    def describe(self) -> EncoderDescription:
        """The backend, the export's variant, the provider, the folder and the run size."""
        return EncoderDescription(
            backend=self.backend,
            variant=self.variant,
            provider=self.provider,
            model_dir=self.model_dir,
            max_batch_tokens=self.max_batch_tokens,
            streams=self.streams,
        )

    def stats(self) -> EncoderStats:
        """The work done so far (no cache here: see :mod:`reward_server.encoders.cache`)."""
        with self._stats_lock:
            return EncoderStats(work=replace(self.totals))

    def peek(self, texts: Sequence[str]) -> None:
        """Nothing at hand: every embedding is the model's work."""
        return None

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embeddings of ``texts`` in input order, shape ``(len(texts), 384)``, unit rows."""
        return self.encode_with_stats(texts)[0]

    def encode_with_stats(
        self, texts: Sequence[str]
    ) -> tuple[npt.NDArray[np.float32], EncodeStats]:
        """Like :meth:`encode`, also returning what the call cost (for metrics)."""
        stats = EncodeStats(texts=len(texts))
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out, stats
        t0 = time.perf_counter()
        ids_list = encode_ids(self._tokenizer, texts)  # long texts: from a bounded prefix
        lengths = [len(ids) for ids in ids_list]
        t1 = time.perf_counter()
        stats.tokenize_seconds = t1 - t0
        stats.tokens = sum(lengths)
        batches = plan_batches(lengths, self.max_batch_tokens, self.min_row_fill, self._run_width)

        def run(batch: npt.NDArray[np.intp]) -> None:
            width = lengths[batch[0]]
            ids = np.zeros((len(batch), width), dtype=np.int64)
            mask = np.zeros((len(batch), width), dtype=np.int64)
            for row, idx in enumerate(batch):
                n = lengths[idx]
                ids[row, :n] = ids_list[idx]
                mask[row, :n] = 1
            rows = self._run(ids, mask)
            if rows.shape != (len(batch), out.shape[1]):  # numpy would spread one row over all
                raise RuntimeError(
                    f"the engine returned {rows.shape} for a run of {len(batch)} texts"
                )
            out[batch] = rows  # batches hold disjoint rows

        if self.streams == 1 or len(batches) == 1:
            for batch in batches:
                run(batch)
        else:
            list(self._pool().map(run, batches))  # re-raises a failed run's exception
        stats.batches += len(batches)
        stats.padded_tokens += sum(
            math.prod(self._run_shape(len(b), lengths[b[0]])) for b in batches
        )
        stats.inference_seconds = time.perf_counter() - t1
        with self._stats_lock:
            self.totals.add(stats)
        return out, stats

    def _pool(self) -> ThreadPoolExecutor:
        """The threads that run batches at once (made on first use, shared by callers)."""
        with self._pool_lock:
            if self._streams_pool is None:
                self._streams_pool = ThreadPoolExecutor(self.streams, f"sde2-{self.backend}")
            return self._streams_pool

    def _run_width(self, width: int) -> int:
        """The length a run of texts padded to ``width`` tokens is computed at: its own, unless
        the engine rounds it up (onnxruntime's on CUDA); batches are planned at it
        (``run_width`` of :func:`plan_batches`)."""
        return width

    def _run_shape(self, rows: int, width: int) -> tuple[int, int]:
        """The shape a run of ``rows`` texts padded to ``width`` tokens is computed at, counted
        in ``padded_tokens``: :meth:`_run_width`, and the rows, which an engine may round up no
        further than ``max_batch_tokens`` allows."""
        return rows, self._run_width(width)

    @abstractmethod
    def _run(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        """The graph's output for one padded batch: ``(rows, d)`` embeddings (any array-like
        that numpy copies from; it is copied before the next run on this thread)."""
