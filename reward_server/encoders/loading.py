"""Build the encoder a command asked for: one place that maps (backend, model) to an Encoder.

``onnx`` (the default) resolves ``model`` through the model store (an export folder, a Hugging
Face folder or hub id, or the embedded default) and runs it on onnxruntime, optionally behind the
LRU embedding cache; ``torch`` is the sentence-transformers reference. Imports are lazy so that
choosing ONNX never imports torch.
"""

from __future__ import annotations

from typing import Literal

from reward_server.encoders.base import Encoder

Backend = Literal["onnx", "torch"]


def load_encoder(
    backend: Backend = "onnx",
    model: str | None = None,
    *,
    provider: Literal["cpu", "cuda"] = "cpu",
    intra_op_threads: int | None = None,
    max_batch_tokens: int | None = None,
    cache_size: int = 0,
) -> Encoder:
    """The encoder for ``backend`` and ``model`` (``None``: the embedded default)."""
    if backend == "torch":
        from reward_server.encoders.reference import SentenceTransformerEncoder

        return SentenceTransformerEncoder(model, device="cuda" if provider == "cuda" else "cpu")
    from reward_server.encoders.model_store import resolve_model
    from reward_server.encoders.onnx_runtime import OnnxEncoder

    encoder: Encoder = OnnxEncoder(
        resolve_model(model),
        provider=provider,
        intra_op_threads=intra_op_threads,
        max_batch_tokens=max_batch_tokens,
    )
    if cache_size > 0:
        from reward_server.encoders.cache import CachedEncoder

        encoder = CachedEncoder(encoder, cache_size)
    return encoder
