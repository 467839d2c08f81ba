"""Keep the server's resident memory flat under load (glibc malloc tuning).

onnxruntime allocates activation buffers of tens of MB per batch. With glibc's defaults those
land in per-thread arenas below a *dynamic* mmap threshold, and freed memory is kept for reuse,
so the server's resident memory grows step after step. Fixing the mmap threshold at 1 MiB
(large buffers are mapped and returned on free) and capping arenas at 2 keeps it flat.
``mallopt`` is applied in-process at start-up, before worker threads exist, so
``sde2-reward serve`` needs no environment variables for it.

The price of a fixed threshold: a large block freed and allocated again is faulted in (and zeroed
by the kernel) page by page each time. The encoder's activation buffers are exactly that, so they
must be kept by onnxruntime's own arena, which ``OnnxEncoder`` enables by default
(``tests/test_memory.py`` counts the faults).

Fixing the mmap threshold also stops glibc from raising its *trim* threshold with it (128 KiB
stays), so the heap's top would be given back to the kernel and faulted in again at every step
for the reward's arrays. The trim threshold is set to twice the mmap threshold, as glibc's own
dynamic rule does: at most 2 MiB of free heap kept per arena (8 MiB under CTranslate2's
threshold, below).

CTranslate2 (``--backend ctranslate2``) has no arena: it takes each operator's buffers from
malloc and frees them, and at its default run size the largest (the feed-forward's, the
attention scores) are over 1 MiB, so a 1 MiB threshold would fault them in at every run; a
4 MiB one keeps them in the heap. :func:`mmap_threshold_for` picks the threshold by backend,
and :func:`tune_malloc_for` applies the tuning with it (what every server process runs; nothing
on CUDA, where the encoder's activations live on the GPU).

(measurements: benchmarks/README.md, the service's design)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("sde2.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


#: The fixed mmap threshold: 1 MiB, where the engine keeps its buffers in an arena of its own.
DEFAULT_MMAP_THRESHOLD = 1 << 20
#: Backends that take each operator's buffers from malloc, and the threshold that keeps them
#: in the heap at their default run size.
_MMAP_THRESHOLD_BY_BACKEND = {"ctranslate2": 4 << 20}


def mmap_threshold_for(backend: str) -> int:
    """The mmap threshold for the server's encoder backend (see the module docstring).

    >>> mmap_threshold_for("onnx") >> 20, mmap_threshold_for("ctranslate2") >> 20
    (1, 4)
    """
    return _MMAP_THRESHOLD_BY_BACKEND.get(backend, DEFAULT_MMAP_THRESHOLD)


def tune_malloc(arena_max: int = 2, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Apply the tuning above; ``False`` (and nothing changed) where glibc is not the allocator."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends have no mallopt
        return False
    ok = (
        mallopt(_M_ARENA_MAX, arena_max) == 1
        and mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        and mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1
    )
    if not ok:
        log.warning("mallopt refused the memory tuning; resident memory may grow under load")
    return bool(ok)


def tune_malloc_for(backend: str, provider: str = "cpu") -> bool:
    """:func:`tune_malloc` with the mmap threshold of the server's encoder ``backend``; nothing
    on CUDA, where the activations it is for live on the GPU and the tuning only slows the
    encoder (measurements: benchmarks/README.md, the service's design)."""
    if provider == "cuda":
        return False
    return tune_malloc(mmap_threshold=mmap_threshold_for(backend))
