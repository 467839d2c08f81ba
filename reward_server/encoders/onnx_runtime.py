"""The production encoder: onnxruntime + tokenizers + numpy, no torch.

Batching, streams and threads are :class:`~reward_server.encoders.batched.BatchedEncoder`'s;
what is onnxruntime's (the figures are in ``benchmarks/README.md``):

* one fused graph (BERT + pooling + normalize, see :mod:`onnx_export`) per batch, with every
  fusion but the residual's into its layer norm on CPU (:data:`CPU_DISABLED_OPTIMIZERS`);
* onnxruntime's CPU memory arena, so activation buffers are reused from run to run. Without it
  every run maps fresh buffers and the kernel faults and zeroes them page by page, which the
  server's malloc tuning (:mod:`reward_server.service.memory`, large blocks always mapped) makes
  the rule; small runs also keep the arena's high-water mark small;
* each stream's run gets its share of the intra-op threads, and they do not spin: the reward
  server shares its CPUs with request handling and often with a trainer.

On CUDA the fp16 graph runs through IO binding, with the unfused attention kernel
(:data:`CUDA_ATTENTION_KERNEL`) and each run padded to a repeating shape
(:meth:`OnnxEncoder._run_shape`): new shapes are what costs there. onnxruntime silently falls back
to the CPU provider when CUDA cannot be initialised; :class:`OnnxEncoder` checks the provider
actually in use and raises :class:`ProviderUnavailableError` instead of quietly serving at a
fraction of the speed.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import EncoderUnavailableError, Provider
from reward_server.encoders.batched import MIN_ROW_FILL, BatchedEncoder, graph_feeds
from reward_server.encoders.model_store import EXPORT_AGAIN, MODEL_FILE, ModelLoadError

log = logging.getLogger(__name__)

_ORT_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: Default budget of padded tokens per batch on CPU: the fastest on the standard GRPO step
#: (``benchmarks/README.md``). Machines with more cache per core may prefer more:
#: ``--encoder-batch-tokens``.
DEFAULT_MAX_BATCH_TOKENS = 512
#: Default on CUDA, where larger batches keep the GPU busy.
DEFAULT_MAX_BATCH_TOKENS_CUDA = 65536
#: Session fusions left out on CPU: the export keeps each residual ``Add`` apart from its
#: ``LayerNormalization`` there (:func:`onnx_export.fusion_options`), and the session's own
#: ``SkipLayerNormFusion`` would join them again into the slow fused kernel. onnxruntime
#: ignores a name it does not know, so ``tests/test_onnx_encoder.py`` reads the session's
#: optimized graph to check that this one still applies.
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
#: onnxruntime's attention kernel on CUDA, its ``sdpa_kernel`` option (a bit mask; 16 is the
#: unfused kernel, plain matrix products and a softmax). Left to choose, onnxruntime 1.31 takes a
#: kernel that prepares itself for each new (rows, length) of a run, 40-75 ms on an H200, and a
#: reward step's runs are nearly all new shapes: a standard step encoded in 415 ms, and in 11-16
#: when the same texts came again. The unfused kernel prepares nothing: 15.2 ms a fresh step and
#: 1.57M tokens/s in bulk; 4, the TensorRT fused kernel, 14.9 ms and 1.51M; 2, memory-efficient,
#: 57 ms (``benchmarks/README.md``, GPU pass). The gpu extra's floor, onnxruntime-gpu 1.19, has
#: the option.
CUDA_ATTENTION_KERNEL = "16"
#: On CUDA (``pad_shapes``) each run's rows and length are rounded up to these multiples, within
#: ``max_batch_tokens`` (:meth:`OnnxEncoder._run_shape`). New shapes still cost with the unfused
#: kernel (a fresh standard step encoded in 43 ms, the same step again in 12); rounded, the shapes
#: repeat from step to step and a fresh step took 17 ms on an H200 (``benchmarks/README.md``, GPU
#: pass). On CPU, where the padding would be paid in FLOPs, runs keep their exact shapes.
CUDA_ROW_MULTIPLE = 16
CUDA_LENGTH_MULTIPLE = 32


def pad_to_shape(
    ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64], rows: int, width: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``ids`` and ``mask`` grown to ``rows`` x ``width``. New columns are masked out, so the
    real rows' embeddings do not change; a new row attends to its first token alone, so that it
    pools over something (its embedding is dropped).

    >>> ids, mask = pad_to_shape(np.ones((3, 5), np.int64), np.ones((3, 5), np.int64), 4, 8)
    >>> ids.shape, int(mask[:3].sum()), mask[3].tolist()
    ((4, 8), 15, [1, 0, 0, 0, 0, 0, 0, 0])
    >>> pad_to_shape(ids, mask, 4, 8)[0] is ids
    True
    """
    if ids.shape == (rows, width):
        return ids, mask
    n, length = ids.shape
    new_ids = np.zeros((rows, width), dtype=ids.dtype)
    new_mask = np.zeros((rows, width), dtype=mask.dtype)
    new_ids[:n, :length] = ids
    new_mask[:n, :length] = mask
    new_mask[n:, 0] = 1
    return new_ids, new_mask


class ProviderUnavailableError(EncoderUnavailableError):
    """The execution provider that was asked for is not the one onnxruntime would run."""


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


def load_cuda_libraries(ort: Any) -> None:
    """Load the CUDA and cuDNN libraries of NVIDIA's pip wheels (``nvidia-*``, as
    ``onnxruntime-gpu[cuda,cudnn]`` installs them), when there are such wheels, before a CUDA
    session: onnxruntime's CUDA provider names them without a path that reaches the wheels'
    folders, and finds them only when something loaded them first (``import torch`` does; this
    server imports no torch, so the provider could not start). A CUDA base image's system
    libraries need nothing: without the wheels this does nothing. What ``preload_dlls`` prints
    about a library it cannot load goes to the log."""
    import importlib.util

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is None or importlib.util.find_spec("nvidia") is None:
        return
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        preload()
    if printed.getvalue().strip():
        log.warning("loading CUDA from NVIDIA's wheels: %s", " ".join(printed.getvalue().split()))


def check_session_provider(provider: Provider, session_providers: Sequence[str]) -> None:
    """Raise unless the session really runs on ``provider`` (ORT falls back silently)."""
    wanted = _ORT_PROVIDER[provider]
    if not session_providers or session_providers[0] != wanted:
        raise ProviderUnavailableError(
            f"asked for {wanted} but onnxruntime is running {list(session_providers)}; "
            "the provider failed to initialise (check the CUDA/cuDNN libraries and the GPU)"
        )


class OnnxEncoder(BatchedEncoder):
    """all-MiniLM-L6-v2 (or any export of :mod:`onnx_export`) on onnxruntime.

    Thread-safe: onnxruntime sessions may be run concurrently.
    """

    backend = "onnx"

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
        pad_shapes: bool | None = None,
    ) -> None:
        """``model_dir``, ``provider``, threads, streams and runs as every export encoder's
        (:class:`BatchedEncoder`); the rest are onnxruntime's session settings, and
        ``pad_shapes``: round each run's rows and length up (:meth:`_run_shape`; default:
        on CUDA only)."""
        self.pad_shapes = provider == "cuda" if pad_shapes is None else pad_shapes
        # Made once the threads and streams are known (they size the session's thread pool).
        self._options = partial(
            self._session_options,
            sequential=sequential,
            graph_optimization=graph_optimization,
            allow_spinning=allow_spinning,
            memory_arena=memory_arena,
        )
        self._device_id = device_id
        super().__init__(
            model_dir,
            provider=provider,
            intra_op_threads=intra_op_threads,
            streams=streams,
            max_batch_tokens=max_batch_tokens,
            min_row_fill=min_row_fill,
        )

    def _default_batch_tokens(self) -> int:
        return (
            DEFAULT_MAX_BATCH_TOKENS_CUDA if self.provider == "cuda" else DEFAULT_MAX_BATCH_TOKENS
        )

    def _open(self) -> None:
        ort_provider = self._check_provider()
        self._session = self._open_session(self._options(), ort_provider, self._device_id)
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._output_name = self._session.get_outputs()[0].name

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
            [
                (ort_provider, {"device_id": device_id, "sdpa_kernel": CUDA_ATTENTION_KERNEL}),
                "CPUExecutionProvider",
            ]
            if self.provider == "cuda"
            else [ort_provider]
        )
        disabled = list(CPU_DISABLED_OPTIMIZERS) if self.provider == "cpu" else []
        if self.provider == "cuda":
            load_cuda_libraries(ort)
        graph = self.model_dir / MODEL_FILE
        try:
            session = ort.InferenceSession(
                str(graph), sess_options=options, providers=providers, disabled_optimizers=disabled
            )
        except _load_errors(ort) as exc:
            # A damaged graph with no manifest to check it against (a bare model.onnx).
            raise ModelLoadError(
                f"onnxruntime cannot load {graph} ({exc}): {EXPORT_AGAIN}"
            ) from None
        check_session_provider(self.provider, session.get_providers())
        fused_residuals = "SkipLayerNormalization" in self.manifest.get("graph_ops", {})
        if self.provider == "cpu" and fused_residuals:
            log.warning(
                "%s was exported by an older sde2: its graph fuses each residual into its layer "
                "norm, which encodes about 12%% slower on CPU; export it again (sde2-reward "
                "export) for the faster graph",
                self.model_dir,
            )
        return session

    def _run(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        n = len(ids)
        padded = pad_to_shape(ids, mask, *self._run_shape(*ids.shape))
        feeds = graph_feeds(*padded, self._input_names)
        if self.provider != "cuda":
            return self._session.run([self._output_name], feeds)[0][:n]
        binding = self._session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output(self._output_name, "cuda", self._device_id)
        self._session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0][:n]

    def _run_width(self, width: int) -> int:
        """On CUDA (``pad_shapes``) the length rounded up to :data:`CUDA_LENGTH_MULTIPLE`, so that
        shapes repeat from step to step; never past the model's ``max_seq_length`` (a model may
        have no positions beyond it) nor ``max_batch_tokens``, the padded tokens a run may
        compute (the batches are planned at this length)."""
        if not self.pad_shapes:
            return width
        rounded = _round_up(width, CUDA_LENGTH_MULTIPLE)
        return max(width, min(rounded, self.max_seq_length, self.max_batch_tokens))

    def _run_shape(self, rows: int, width: int) -> tuple[int, int]:
        """On CUDA (``pad_shapes``) the rows are also rounded up, to :data:`CUDA_ROW_MULTIPLE`,
        but only while the run fits ``max_batch_tokens`` (a full batch keeps its rows, which
        its length decides)."""
        width = self._run_width(width)
        rounded = _round_up(rows, CUDA_ROW_MULTIPLE)
        fits = self.pad_shapes and rounded * width <= self.max_batch_tokens
        return (rounded if fits else rows), width


def _round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``.

    >>> _round_up(33, 32), _round_up(32, 32), _round_up(1, 16)
    (64, 32, 16)
    """
    return -(-value // multiple) * multiple


def _load_errors(ort: Any) -> tuple[type[Exception], ...]:
    """What onnxruntime raises for a graph it cannot load (each a bare ``Exception`` subclass
    of its binding)."""
    state = ort.capi.onnxruntime_pybind11_state
    return (state.Fail, state.InvalidProtobuf, state.InvalidArgument, state.InvalidGraph,
            state.NoSuchFile)  # fmt: skip
