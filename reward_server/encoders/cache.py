"""An LRU cache of embeddings in front of any encoder.

Why: GRPO samples several completions per prompt and models repeat themselves, so the same
``<reasoning>`` text is often embedded many times across a training run (and across the
``G`` completions of one group). Embeddings of a frozen encoder never change, so a hit is free.

Keys are a blake2b digest of the UTF-8 text, not the text itself: a reasoning block can be
kilobytes long and the cache should cost a fixed ~1.6 KB per entry (384 float32 + a 16-byte key),
whatever the texts are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import CacheCounts, Encoder, EncoderStats, EncoderWrapper


def text_key(text: str) -> bytes:
    """16-byte blake2b digest of ``text`` (collisions are out of reach at any realistic size)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class CachedEncoder(EncoderWrapper):
    """Wraps ``inner`` with a thread-safe LRU of at most ``max_entries`` embeddings (0 disables).

    Each :meth:`encode` call looks every text up, then sends the distinct misses to ``inner`` in
    ONE call (so the inner backend still batches them efficiently) and stores the results. The
    lock is not held while ``inner`` runs, so concurrent requests encode in parallel; two requests
    missing the same text may both encode it, which costs time but never correctness.
    """

    def __init__(self, inner: Encoder, max_entries: int) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        super().__init__(inner)
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, npt.NDArray[np.float32]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def stats(self) -> EncoderStats:
        """The inner encoder's counters, with this cache's lookups."""
        with self._lock:
            counts = CacheCounts(self.hits, self.misses)
        return dataclasses.replace(self.inner.stats(), cache=counts)

    def __bool__(self) -> bool:
        """Always true: an empty cache is still an encoder (``__len__`` alone would make a fresh
        one falsy, and ``encoder or default`` would silently drop it)."""
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (counters are kept: they describe traffic, not contents)."""
        with self._lock:
            self._entries.clear()

    def peek(self, texts: Sequence[str]) -> npt.NDArray[np.float32] | None:
        """Embeddings of ``texts`` in input order when every one is cached, else None (and
        nothing counted: the :meth:`encode` that follows counts them). Never runs the model,
        so the service answers a fully cached request without the encoder worker's queue."""
        if self.max_entries == 0:
            return None
        keys: list[bytes] = []
        rows: list[npt.NDArray[np.float32]] = []
        with self._lock:  # hashing as it goes: a request with a miss costs one digest or so
            entries = self._entries
            for text in texts:
                key = text_key(text)
                row = entries.get(key)
                if row is None:
                    return None
                keys.append(key)
                rows.append(row)
            for key in keys:
                entries.move_to_end(key)
            self.hits += len(keys)
        if not rows:
            return np.empty((0, self.inner.dimension), dtype=np.float32)
        return np.stack(rows)

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embeddings of ``texts`` in input order; only texts not cached reach ``inner``."""
        if self.max_entries == 0:
            with self._lock:
                self.misses += len(texts)
            return self.inner.encode(texts)
        out = np.empty((len(texts), self.inner.dimension), dtype=np.float32)
        keys = [text_key(t) for t in texts]
        # miss key -> (text, positions in the input that want it); duplicates encoded once.
        missing: dict[bytes, tuple[str, list[int]]] = {}
        with self._lock:
            for i, key in enumerate(keys):
                vec = self._entries.get(key)
                if vec is not None:
                    self._entries.move_to_end(key)
                    out[i] = vec
                    self.hits += 1
                elif key in missing:
                    missing[key][1].append(i)
                    self.hits += 1  # served by the encode of its first occurrence
                else:
                    missing[key] = (texts[i], [i])
                    self.misses += 1
        if not missing:
            return out
        fresh = self.inner.encode([text for text, _ in missing.values()])
        with self._lock:
            for (key, (_, positions)), vec in zip(missing.items(), fresh, strict=True):
                stored = np.array(vec, dtype=np.float32)  # own copy: callers may mutate `out`
                stored.setflags(write=False)
                out[positions] = stored
                if not np.isfinite(stored).all():  # returned (the caller refuses it), not kept
                    continue
                self._entries[key] = stored
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return out
