"""The fp32 export on OpenVINO's CPU runtime (``--backend openvino``; the ``openvino`` extra).

Why a second CPU engine: its kernels fuse what onnxruntime's run op by op, and on the graph
of the first export recipe it ran 1.14× onnxruntime, nearer the matrix-product floor, with the
same embeddings to SPEC §3's fidelity (benchmarks/README.md, fifth pass); since the export keeps
residuals apart from layer norms on CPU (seventh pass) the two are level on the 2-core AVX-512
machine, and which is faster depends on the CPU. OpenVINO reads the export's ``model.onnx``
itself, onnxruntime's fused operators included, so there is one export for both engines. It is
opt-in because it holds the model about twice over (the server's memory grows past its budget)
and its wheel is large.

What matters in its configuration:

* ``INFERENCE_PRECISION_HINT = f32``: on CPUs with AMX or AVX-512 BF16, OpenVINO would
  otherwise run in bfloat16, not the fp32 whose fidelity the export measured;
* its streams are this encoder's streams: ``NUM_STREAMS`` runs at once, the threads
  (``INFERENCE_NUM_THREADS``) shared out between them, each stream thread with an infer request
  of its own (a request is not shared between threads);
* no pinning of its threads to cores: the server shares its CPUs with request handling.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import EncoderUnavailableError
from reward_server.encoders.batched import BatchedEncoder, graph_feeds
from reward_server.encoders.model_store import MODEL_FILE

#: Padded tokens per run: the fastest on the standard step (512, 1024 and 2048 measured; see
#: ``benchmarks/README.md``). OpenVINO's fused kernels keep larger runs efficient longer than
#: onnxruntime's (512).
DEFAULT_MAX_BATCH_TOKENS = 1024


class OpenVinoUnavailableError(EncoderUnavailableError):
    """The ``openvino`` backend was asked for where it cannot run (not installed, not a CPU,
    not the fp32 export)."""


class OpenVinoEncoder(BatchedEncoder):
    """all-MiniLM-L6-v2 (the fp32 export of :mod:`onnx_export`) on OpenVINO, on the CPU.

    Thread-safe: each thread that runs a batch has its own infer request on the one compiled
    model.
    """

    backend = "openvino"

    def _default_batch_tokens(self) -> int:
        return DEFAULT_MAX_BATCH_TOKENS

    def _open(self) -> None:
        self._require_cpu_fp32(OpenVinoUnavailableError)
        self._compiled = self._compile()
        self._input_names = {port.get_any_name() for port in self._compiled.inputs}
        self._requests = threading.local()
        # A first inference here, on the one thread that opens the encoder. OpenVINO's Python
        # binding initializes function-local statics the first time a request's tensors are
        # filled and read; when two stream threads did that at once, one waited for the
        # static's guard holding the GIL while the other waited for the GIL inside the guard
        # (seen once in CI: a test process hung in `__cxa_guard_acquire` under
        # `InferRequest.infer`, every other thread waiting). Afterwards the statics are set.
        # Any token ids do: the output is dropped.
        ids = np.zeros((1, 2), dtype=np.int64)
        self._compiled.create_infer_request().infer(
            graph_feeds(ids, np.ones_like(ids), self._input_names)
        )

    def _compile(self) -> Any:
        """The export compiled for this machine's CPU in fp32, with this encoder's streams."""
        try:
            import openvino as ov
        except ImportError as exc:
            raise OpenVinoUnavailableError(
                "the openvino backend needs the optional extra: pip install 'sde2[openvino]'"
            ) from exc
        core = ov.Core()
        model = core.read_model(str(self.model_dir / MODEL_FILE))
        config = {
            "INFERENCE_PRECISION_HINT": "f32",
            "NUM_STREAMS": str(self.streams),
            "INFERENCE_NUM_THREADS": str(max(self.streams, self.intra_op_threads)),
            "ENABLE_CPU_PINNING": "NO",
        }
        return core.compile_model(model, "CPU", config)

    def _run(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self._compiled.create_infer_request()
        return request.infer(graph_feeds(ids, mask, self._input_names))[0]
