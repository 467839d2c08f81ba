"""The fp32 export on CTranslate2's CPU runtime (``--backend ctranslate2``; its extra).

Why a third CPU engine: on the 2-core AVX-512 machine it encodes a standard GRPO step's needed
texts 1.06-1.07× faster than onnxruntime (its fp32 products run on oneMKL's packed GEMM, and
it stays efficient on runs of a couple of texts, where onnxruntime's per-run cost grows), at
the same fidelity (max |diff| against onnxruntime 2e-7) and in less memory than onnxruntime's
encoder; figures in ``benchmarks/README.md`` (twelfth pass). It is opt-in because the product
ships onnxruntime, which also runs the CUDA and int8 graphs, and because its model is a second
file: converted once from the export's own graph (:mod:`ctranslate2_convert`, cached by
:func:`~reward_server.encoders.model_store.ensure_ctranslate2_model`), never downloaded.

What matters in its configuration:

* ``compute_type="float32"``: the export's fidelity was measured in fp32;
* its replicas are this encoder's streams (``inter_threads``), each with its share of the
  threads (``intra_threads``); the replicas share the weights, and each call of
  ``forward_batch`` from a stream thread runs on a free replica;
* the graph ends at BERT's last hidden states: the mean over each text's tokens and the unit
  length are taken here (:func:`mean_pooled_units`), as sentence-transformers does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import EncoderUnavailableError
from reward_server.encoders.batched import BatchedEncoder
from reward_server.encoders.model_store import ensure_ctranslate2_model

#: Padded tokens per run: the fastest on the standard step (128 to 512 measured; see
#: ``benchmarks/README.md``, twelfth pass).
DEFAULT_MAX_BATCH_TOKENS = 192


class CTranslate2UnavailableError(EncoderUnavailableError):
    """The ``ctranslate2`` backend was asked for where it cannot run (not installed, not a
    CPU, not the fp32 export, a graph it cannot convert)."""


def mean_pooled_units(
    hidden: npt.NDArray[np.float32], lengths: npt.NDArray[np.int64]
) -> npt.NDArray[np.float32]:
    """Each row's mean over its first ``lengths`` positions, scaled to unit length: the
    sentence embedding of mean pooling then normalization (positions past a text's length are
    padding and never read, whatever the engine left there).

    >>> h = np.array([[[3.0, 0.0], [0.0, 4.0], [9.0, 9.0]]], dtype=np.float32)
    >>> mean_pooled_units(h, np.array([2]))
    array([[0.6, 0.8]], dtype=float32)
    """
    sums = np.stack([hidden[row, :n].sum(axis=0) for row, n in enumerate(lengths)])
    means = sums / np.maximum(lengths, 1)[:, None].astype(np.float32)
    norms = np.linalg.norm(means, axis=1, keepdims=True)
    return (means / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class CTranslate2Encoder(BatchedEncoder):
    """all-MiniLM-L6-v2 (the fp32 export of :mod:`onnx_export`) on CTranslate2, on the CPU.

    Thread-safe: concurrent calls of ``forward_batch`` run on the model's replicas.
    """

    backend = "ctranslate2"

    def _default_batch_tokens(self) -> int:
        return DEFAULT_MAX_BATCH_TOKENS

    def _open(self) -> None:
        self._require_cpu_fp32(CTranslate2UnavailableError)
        try:
            import ctranslate2
            import onnx  # noqa: F401  (the conversion reads the graph with it, in a child)
        except ImportError as exc:
            raise CTranslate2UnavailableError(
                "the ctranslate2 backend needs the optional extra: pip install "
                f"'sde2[ctranslate2]' ({exc})"
            ) from exc
        self._storage = ctranslate2.StorageView
        self._model = ctranslate2.Encoder(
            str(ensure_ctranslate2_model(self.model_dir)),
            device="cpu",
            compute_type="float32",
            inter_threads=self.streams,
            intra_threads=max(1, self.intra_op_threads // self.streams),
        )

    def _run(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        lengths = mask.sum(axis=1)
        output = self._model.forward_batch(
            self._storage.from_array(ids.astype(np.int32)),
            self._storage.from_array(lengths.astype(np.int32)),
        )
        return mean_pooled_units(np.asarray(output.last_hidden_state), lengths)
