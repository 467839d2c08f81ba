"""A zero-cost encoder for measuring everything *but* the encoder: embeddings from a table.

:class:`TableEncoder` answers ``encode`` by looking each text up in a table of embeddings that the
real encoder computed beforehand (an unknown text is a ``KeyError``, never a made-up vector), so
the rewards are the real ones and the Uniq walk sees real cosines. Everything else a step costs
still runs: JSON parsing and validation, answers, geometry, components, normalization, the
response's JSON and HTTP.

By default the table also answers the service's ``peek`` (as an embedding cache holding every
text of a request would), so requests take the cached path: no encoder queue, the reward on the
event loop. With ``--worker-path`` it answers ``encode`` only, as the model does, so each
request goes the way a training step with fresh completions goes: submitted to the batcher,
embedded by its worker thread, the reward in the pool.

``python -m benchmarks.table_server --table FILE.npz --port N [--worker-path]`` serves the
standard app (:func:`reward_server.service.serve.serve_async`, the code ``sde2-reward serve``
runs) with that encoder; ``bench_score.py`` starts it. It is a benchmark tool, not a server
backend.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_server.encoders.base import (
    EMBEDDING_DIM,
    Encoder,
    EncoderDescription,
    EncoderStats,
)


class TableEncoder:
    """Texts -> rows of a precomputed ``(n, d)`` float32 table (an :class:`Encoder`)."""

    name = "table (precomputed embeddings, benchmark)"

    def __init__(
        self, texts: Sequence[str], rows: npt.NDArray[np.float32], *, cached: bool = True
    ) -> None:
        if len(texts) != rows.shape[0]:
            raise ValueError(f"{len(texts)} texts for {rows.shape[0]} rows")
        self._index = {text: i for i, text in enumerate(texts)}
        self._rows = np.ascontiguousarray(rows, dtype=np.float32)
        #: Whether :meth:`peek` answers (the cached path) or not (the worker's path).
        self.cached = cached

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """The stored rows of ``texts``, in order (``KeyError`` for a text not in the table)."""
        if not texts:
            return np.zeros((0, EMBEDDING_DIM), np.float32)
        return self._rows[[self._index[t] for t in texts]]

    def peek(self, texts: Sequence[str]) -> npt.NDArray[np.float32] | None:
        """The stored rows of ``texts`` without model work (as an embedding cache's hits), or
        None when one is not in the table: the service then answers from the table as it does
        from a cache that holds every text. Always None when not :attr:`cached`."""
        if not self.cached:
            return None
        try:
            return self.encode(texts)  # one pass over the texts: the table should cost nothing
        except KeyError:
            return None

    @property
    def dimension(self) -> int:
        """The table's row length."""
        return int(self._rows.shape[1])

    def warmup(self) -> None:
        """Nothing to warm: the table is in memory."""

    def describe(self) -> EncoderDescription:
        """A lookup, not a model."""
        return EncoderDescription(backend="table", variant="precomputed", provider="cpu")

    def stats(self) -> EncoderStats:
        """No counters: a lookup costs nothing worth counting."""
        return EncoderStats()

    def save(self, path: Path) -> None:
        """Write the table as ``.npz`` (texts and rows)."""
        texts = np.array(list(self._index), dtype=object)
        np.savez(path, texts=texts, rows=self._rows)

    @classmethod
    def of_steps(cls, steps: Sequence[Sequence[dict[str, Any]]], encoder: Encoder) -> TableEncoder:
        """The texts that scoring ``steps`` (lists of request items) needs, embedded once by
        ``encoder``."""
        from reward_server.core import ScoreItem, prepare_batch

        needed = (prepare_batch([ScoreItem(**i) for i in step]).texts for step in steps)
        texts = list(dict.fromkeys(t for step_texts in needed for t in step_texts))
        return cls(texts, encoder.encode(texts))

    @classmethod
    def load(cls, path: Path, *, cached: bool = True) -> TableEncoder:
        """Read a table written by :meth:`save`."""
        with np.load(path, allow_pickle=True) as data:
            return cls([str(t) for t in data["texts"]], data["rows"], cached=cached)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the app with a :class:`TableEncoder` until SIGTERM."""
    import logging

    from reward_server.service.config import Settings
    from reward_server.service.memory import tune_malloc
    from reward_server.service.serve import serve_async

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, required=True, help=".npz written by save()")
    parser.add_argument("--port", type=int, default=18732)
    parser.add_argument(
        "--worker-path",
        action="store_true",
        help="answer encode() only, as the model does: requests go through the batcher's worker",
    )
    args = parser.parse_args(argv)
    tune_malloc()  # as `sde2-reward serve` does
    logging.basicConfig(level="WARNING")
    settings = Settings(port=args.port, cache_size=0, log_level="warning")
    encoder = TableEncoder.load(args.table, cached=not args.worker_path)
    return asyncio.run(serve_async(settings, encoder=encoder))


if __name__ == "__main__":
    sys.exit(main())
