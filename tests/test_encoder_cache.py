"""CachedEncoder: hits skip the inner encoder, order is preserved, LRU bounds memory."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from reward_server.encoders.base import EMBEDDING_DIM, Encoder
from reward_server.encoders.cache import CachedEncoder, text_key
from tests.doubles import DoubleEncoder


class CountingEncoder(DoubleEncoder):
    """Deterministic unit vectors from a hash of the text; records every call."""

    name = "counting double"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        with self._lock:
            self.calls.append(list(texts))
        out = np.empty((len(texts), EMBEDDING_DIM), dtype=np.float32)
        for i, t in enumerate(texts):
            seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
            v = np.random.default_rng(seed).standard_normal(EMBEDDING_DIM)
            out[i] = v / np.linalg.norm(v)
        return out


def test_is_an_encoder_and_keeps_the_name() -> None:
    cached = CachedEncoder(CountingEncoder(), 10)
    assert isinstance(cached, Encoder)
    assert cached.name == "counting double"


def test_hits_misses_and_order() -> None:
    inner = CountingEncoder()
    cached = CachedEncoder(inner, 100)
    first = cached.encode(["a", "b", "c"])
    assert (cached.hits, cached.misses) == (0, 3)
    # Mixed call: only the two new texts reach the inner encoder, in one call.
    texts = ["c", "d", "a", "e", "b"]
    second = cached.encode(texts)
    assert inner.calls[-1] == ["d", "e"]
    assert len(inner.calls) == 2
    assert (cached.hits, cached.misses) == (3, 5)
    np.testing.assert_array_equal(second, inner.encode(texts))
    np.testing.assert_array_equal(second[[2, 4, 0]], first)


def test_duplicates_within_a_call_are_encoded_once() -> None:
    inner = CountingEncoder()
    cached = CachedEncoder(inner, 100)
    out = cached.encode(["x", "y", "x", "x"])
    assert inner.calls == [["x", "y"]]
    np.testing.assert_array_equal(out[0], out[2])
    np.testing.assert_array_equal(out[0], out[3])
    assert (cached.hits, cached.misses) == (2, 2)


def test_lru_eviction() -> None:
    inner = CountingEncoder()
    cached = CachedEncoder(inner, 2)
    cached.encode(["a", "b"])
    cached.encode(["a"])  # touch a: b is now least recently used
    cached.encode(["c"])  # evicts b
    assert len(cached) == 2
    inner.calls.clear()
    cached.encode(["a", "b", "c"])
    assert inner.calls == [["b"]]


def test_zero_disables() -> None:
    inner = CountingEncoder()
    cached = CachedEncoder(inner, 0)
    cached.encode(["a"])
    cached.encode(["a"])
    assert inner.calls == [["a"], ["a"]]
    assert len(cached) == 0
    assert cached, "an empty cache is still a (truthy) encoder"
    assert (cached.hits, cached.misses) == (0, 2)
    with pytest.raises(ValueError):
        CachedEncoder(inner, -1)


def test_empty_input() -> None:
    inner = CountingEncoder()
    out = CachedEncoder(inner, 4).encode([])
    assert out.shape == (0, EMBEDDING_DIM)
    assert inner.calls == []


def test_returned_arrays_do_not_alias_the_cache() -> None:
    cached = CachedEncoder(CountingEncoder(), 4)
    out = cached.encode(["a"])
    out[:] = 0.0
    assert np.linalg.norm(cached.encode(["a"])[0]) == pytest.approx(1.0, abs=1e-6)


def test_thread_safety_under_concurrency() -> None:
    inner = CountingEncoder()
    cached = CachedEncoder(inner, 50)  # smaller than the key space: constant eviction
    expected = {f"t{i}": inner.encode([f"t{i}"])[0] for i in range(80)}
    errors: list[str] = []
    requested: list[int] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            texts = [f"t{int(i)}" for i in rng.integers(0, 80, size=int(rng.integers(1, 12)))]
            out = cached.encode(texts)
            requested.append(len(texts))
            for t, row in zip(texts, out, strict=True):
                if not np.array_equal(row, expected[t]):
                    errors.append(t)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cached) <= 50
    # Every requested text was counted once; every miss (and only misses) reached the inner encoder.
    assert cached.hits + cached.misses == sum(requested)
    assert cached.misses == sum(len(c) for c in inner.calls[80:])
    assert cached.hits > 0


def test_key_is_a_fixed_size_digest() -> None:
    assert len(text_key("x" * 100_000)) == 16
    assert text_key("a") != text_key("b")
    assert text_key("\udcff") != text_key("")  # lone surrogates do not crash
