"""The production encoder: onnxruntime + tokenizers + numpy, no torch.

Where its speed comes from (the figures are in ``benchmarks/README.md``):

* one fused graph (BERT + pooling + normalize, see :mod:`onnx_export`) per batch;
* length-sorted, token-budgeted batches: texts are sorted by token count and cut so that a batch's
  *padded* size (rows × longest row) stays within ``max_batch_tokens``. Padding is pure waste and
  attention cost grows with the padded length, so mixing one 256-token text with many 20-token
  ones would multiply the work;
* *small* batches on CPU: much of the time goes to memory-bound ops (SkipLayerNormalization,
  BiasGelu, the attention core) that read and write whole activation tensors, and a small batch
  keeps those tensors in cache between ops;
* onnxruntime's CPU memory arena, so activation buffers are reused from run to run. Without it
  every run maps fresh buffers and the kernel faults and zeroes them page by page, which the
  server's malloc tuning (:mod:`reward_server.service.memory`, large blocks always mapped) makes
  the rule; small runs also keep the arena's high-water mark small;
* a thread pool sized to the CPUs this process may really use (affinity mask and cgroup quota),
  not ``os.cpu_count()``: in a container limited to 2 CPUs on a 64-core host, 64 spinning threads
  are much slower than 2;
* on CPU, two batches at once (*streams*), each run with half the threads: a small batch's ops
  are too short to split well across cores (every op ends in a barrier), while two independent
  runs keep both cores busy. A text's embedding does not depend on the stream that ran it.

On CUDA the fp16 graph runs through IO binding. onnxruntime silently falls back to the CPU
provider when CUDA cannot be initialised; :class:`OnnxEncoder` checks the provider actually in use
and raises :class:`ProviderUnavailableError` instead of quietly serving at a fraction of the speed.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from reward_server.encoders.model_store import MANIFEST_FILE, MODEL_FILE
from reward_server.encoders.tokenization import encode_ids, load_tokenizer

_ORT_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: Default budget of padded tokens per batch on CPU: the fastest on the standard GRPO step
#: (``benchmarks/README.md``). Machines with more cache per core may prefer more:
#: ``--encoder-batch-tokens``.
DEFAULT_MAX_BATCH_TOKENS = 512
#: A text joins a batch only if it is at least this share of the batch's longest (padding waste).
MIN_ROW_FILL = 0.8
#: Default on CUDA, where larger batches keep the GPU busy.
DEFAULT_MAX_BATCH_TOKENS_CUDA = 65536
#: Batches run at once on CPU by default (when there are at least as many threads).
DEFAULT_CPU_STREAMS = 2


class ProviderUnavailableError(RuntimeError):
    """The execution provider that was asked for is not the one onnxruntime would run."""


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


def check_provider_available(provider: Provider, available: Sequence[str] | None = None) -> str:
    """The onnxruntime provider name for ``provider``; raise if this onnxruntime build lacks it."""
    if provider not in _ORT_PROVIDER:
        raise ValueError(f"provider must be 'cpu' or 'cuda', not {provider!r}")
    wanted = _ORT_PROVIDER[provider]
    if available is None:
        import onnxruntime as ort

        available = ort.get_available_providers()
    if wanted not in available:
        hint = (
            " (install onnxruntime-gpu instead of onnxruntime, with a matching CUDA/cuDNN)"
            if provider == "cuda"
            else ""
        )
        raise ProviderUnavailableError(
            f"execution provider {wanted} is not available in this onnxruntime build; "
            f"available: {list(available)}{hint}"
        )
    return wanted


def check_session_provider(provider: Provider, session_providers: Sequence[str]) -> None:
    """Raise unless the session really runs on ``provider`` (ORT falls back silently)."""
    wanted = _ORT_PROVIDER[provider]
    if not session_providers or session_providers[0] != wanted:
        raise ProviderUnavailableError(
            f"asked for {wanted} but onnxruntime is running {list(session_providers)}; "
            "the provider failed to initialise (check the CUDA/cuDNN libraries and the GPU)"
        )


def read_manifest(model_dir: Path) -> dict[str, Any]:
    """The export's manifest (empty for a folder without one: a bare ``model.onnx``)."""
    path = model_dir / MANIFEST_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def default_streams(provider: Provider, threads: int) -> int:
    """Batches to run at once: :data:`DEFAULT_CPU_STREAMS` on CPU when there are that many
    threads to share out, else one (a GPU runs one large batch at a time).

    >>> default_streams("cpu", 2), default_streams("cpu", 1), default_streams("cuda", 8)
    (2, 1, 1)
    """
    if provider != "cpu":
        return 1
    return max(1, min(DEFAULT_CPU_STREAMS, threads))


def plan_batches(
    lengths: Sequence[int], max_batch_tokens: int, min_fill: float = MIN_ROW_FILL
) -> list[npt.NDArray[np.intp]]:
    """Cut indices, sorted by length, into batches whose padded size fits ``max_batch_tokens``.

    Sorting descending makes each batch's first row its longest, so the padded size is known when
    the batch opens. A batch is also closed when the next text is shorter than ``min_fill`` times
    the batch's longest: otherwise a 256-token text would drag a dozen 10-token texts up to 256
    (padding is computed like real tokens). A text longer than the budget gets a batch of its own.
    """
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches: list[npt.NDArray[np.intp]] = []
    start = 0
    while start < len(order):
        longest = max(1, int(lengths[order[start]]))
        rows = max(1, max_batch_tokens // longest)
        stop = min(start + rows, len(order))
        end = start + 1
        while end < stop and lengths[order[end]] >= min_fill * longest:
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


class OnnxEncoder:
    """all-MiniLM-L6-v2 (or any export of :mod:`onnx_export`) on onnxruntime.

    Thread-safe: onnxruntime sessions may be run concurrently; the stats counters have a lock.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        provider: Provider = "cpu",
        intra_op_threads: int | None = None,
        streams: int | None = None,
        max_batch_tokens: int | None = None,
        min_row_fill: float = MIN_ROW_FILL,
        sequential: bool = True,
        graph_optimization: str = "all",
        allow_spinning: bool = False,
        memory_arena: bool = True,
        device_id: int = 0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = read_manifest(self.model_dir)
        self.variant: str = str(self.manifest.get("variant", "fp32"))
        self.provider: Provider = provider
        ort_provider = self._check_provider()
        self.max_seq_length = int(self.manifest.get("max_seq_length", MAX_SEQ_LENGTH))
        self.max_batch_tokens = max_batch_tokens or (
            DEFAULT_MAX_BATCH_TOKENS_CUDA if provider == "cuda" else DEFAULT_MAX_BATCH_TOKENS
        )
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.min_row_fill = min_row_fill
        self.intra_op_threads = intra_op_threads or available_cpus()
        self.streams = (
            default_streams(provider, self.intra_op_threads) if streams is None else streams
        )
        if self.streams < 1:
            raise ValueError("streams must be >= 1")
        self._streams_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._tokenizer = load_tokenizer(self.model_dir, self.max_seq_length)
        options = self._session_options(
            sequential=sequential,
            graph_optimization=graph_optimization,
            allow_spinning=allow_spinning,
            memory_arena=memory_arena,
        )
        self._session = self._open_session(options, ort_provider, device_id)
        self._device_id = device_id
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._output_name = self._session.get_outputs()[0].name
        self._stats_lock = threading.Lock()
        self.totals = EncodeStats()
        model_name = str(self.manifest.get("model_name", "all-MiniLM-L6-v2"))
        self._name = f"{model_name} onnx {self.variant}" + (" cuda" if provider == "cuda" else "")

    def _check_provider(self) -> str:
        """The onnxruntime provider to ask for; raise when it cannot run this graph here."""
        if self.variant == "fp16" and self.provider != "cuda":
            raise ProviderUnavailableError(
                f"{self.model_dir} holds the fp16 graph, which is meant for CUDA only; "
                "use the fp32 export on CPU"
            )
        return check_provider_available(self.provider)

    def _session_options(
        self, *, sequential: bool, graph_optimization: str, allow_spinning: bool, memory_arena: bool
    ) -> Any:
        """onnxruntime's session options for this encoder's threads and settings."""
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # The threads are shared out between the streams (each run uses its share).
        opts.intra_op_num_threads = max(1, self.intra_op_threads // self.streams)
        opts.inter_op_num_threads = 1
        opts.execution_mode = (
            ort.ExecutionMode.ORT_SEQUENTIAL if sequential else ort.ExecutionMode.ORT_PARALLEL
        )
        opts.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[graph_optimization]
        # Spinning worker threads burn the cores they wait on, and the reward server shares its
        # CPUs with request handling and often with a trainer.
        opts.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        # The CPU arena keeps the largest batch's buffers for the next run (see the module
        # docstring): off, each run's buffers are mapped, faulted and zeroed anew.
        opts.enable_cpu_mem_arena = memory_arena
        return opts

    def _open_session(self, options: Any, ort_provider: str, device_id: int) -> Any:
        """The inference session, checked to run on the provider asked for."""
        import onnxruntime as ort

        providers: list[Any] = (
            [(ort_provider, {"device_id": device_id}), "CPUExecutionProvider"]
            if self.provider == "cuda"
            else [ort_provider]
        )
        session = ort.InferenceSession(
            str(self.model_dir / MODEL_FILE), sess_options=options, providers=providers
        )
        check_session_provider(self.provider, session.get_providers())
        return session

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
        """ONNX, the export's variant, the provider, the folder and the run size."""
        return EncoderDescription(
            backend="onnx",
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
        batches = plan_batches(lengths, self.max_batch_tokens, self.min_row_fill)

        def run(batch: npt.NDArray[np.intp]) -> None:
            width = lengths[batch[0]]
            ids = np.zeros((len(batch), width), dtype=np.int64)
            mask = np.zeros((len(batch), width), dtype=np.int64)
            for row, idx in enumerate(batch):
                n = lengths[idx]
                ids[row, :n] = ids_list[idx]
                mask[row, :n] = 1
            out[batch] = self._run(ids, mask)  # batches hold disjoint rows

        if self.streams == 1 or len(batches) == 1:
            for batch in batches:
                run(batch)
        else:
            list(self._pool().map(run, batches))  # re-raises a failed run's exception
        stats.batches += len(batches)
        stats.padded_tokens += sum(len(b) * lengths[b[0]] for b in batches)
        stats.inference_seconds = time.perf_counter() - t1
        with self._stats_lock:
            self.totals.add(stats)
        return out, stats

    def _pool(self) -> ThreadPoolExecutor:
        """The threads that run batches at once (made on first use, shared by callers)."""
        with self._pool_lock:
            if self._streams_pool is None:
                self._streams_pool = ThreadPoolExecutor(self.streams, "sde2-onnx")
            return self._streams_pool

    def _run(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        if self.provider != "cuda":
            return self._session.run([self._output_name], feeds)[0]
        binding = self._session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output(self._output_name, "cuda", self._device_id)
        self._session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]
