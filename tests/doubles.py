"""Deterministic encoder doubles for testing the pure reward core.

The core takes any :class:`~reward_server.encoders.base.Encoder`; these let tests choose the
geometry exactly (``TableEncoder``) or get stable pseudo-random unit vectors (``HashEncoder``).
They are never used where a test claims fidelity to the real model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import EMBEDDING_DIM, EncoderDescription, EncoderStats


def _unit(v: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    return (v / np.linalg.norm(v)).astype(np.float32)


class DoubleEncoder:
    """What every leaf double says of itself beyond ``name`` and ``encode``: the model's
    dimension, a one-text warm-up, a ``test`` backend, no counters and nothing at hand without
    model work. Wrappers do not inherit it: they derive from ``EncoderWrapper``."""

    dimension = EMBEDDING_DIM

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        raise NotImplementedError

    def warmup(self) -> None:
        self.encode(["warm up"])

    def describe(self) -> EncoderDescription:
        return EncoderDescription(backend="test", variant="exact", provider="cpu")

    def stats(self) -> EncoderStats:
        return EncoderStats()

    def peek(self, texts: Sequence[str]) -> None:
        return None


class TableEncoder(DoubleEncoder):
    """Looks each text up in a table of vectors (padded to the model's dimension)."""

    name = "table"

    def __init__(self, table: Mapping[str, Sequence[float]]) -> None:
        self.table = {
            k: np.pad(np.asarray(v, float), (0, EMBEDDING_DIM - len(v))) for k, v in table.items()
        }
        self.calls: list[list[str]] = []

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.calls.append(list(texts))
        return (
            np.stack([_unit(self.table[t]) for t in texts])
            if texts
            else np.zeros((0, EMBEDDING_DIM), np.float32)
        )


class HashEncoder(DoubleEncoder):
    """A stable pseudo-random unit vector per text, mixed with a shared direction so that
    cosines spread over roughly [0.2, 1] like real sentence embeddings do."""

    name = "hash"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self._shared = np.random.default_rng(0).normal(size=EMBEDDING_DIM)

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.calls.append(list(texts))
        rows = []
        for t in texts:
            seed = int.from_bytes(
                hashlib.blake2b(t.encode("utf-8", "surrogatepass")).digest()[:8], "little"
            )
            rng = np.random.default_rng(seed)
            rows.append(
                _unit(rng.normal(size=EMBEDDING_DIM) + rng.uniform(0.3, 3.0) * self._shared)
            )
        return np.stack(rows) if rows else np.zeros((0, EMBEDDING_DIM), np.float32)
