"""The one interface every encoder backend implements, and every wrapper forwards.

The reward core only needs "texts in, unit vectors out". The service needs a little more of an
encoder: a warm-up before it reports ready, a description for ``/v1/info`` (backend, variant,
provider, where the model lies, how many tokens one model run takes) and counters for
``/metrics``. All of it is declared here, so a new backend or wrapper is checked by mypy against
the whole contract, and :func:`check_encoder` refuses at load time an object that lacks a member,
instead of the server silently losing its warm-up, its ``/v1/info`` fields or its metrics.

A wrapper (the LRU cache, a test double that adds a delay) derives from :class:`EncoderWrapper`,
which forwards every member to what it wraps, and overrides only what it changes: the service
never looks through wrappers for attributes, and a wrapper cannot forget a member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

import numpy as np
import numpy.typing as npt


class EncoderUnavailableError(RuntimeError):
    """The backend or provider asked for cannot run here (a missing extra, no CUDA in this
    onnxruntime build, a variant it does not run): the message says what to install or use."""


#: Output dimension of all-MiniLM-L6-v2.
EMBEDDING_DIM = 384


def dimension_problem(size: int | None, model: object) -> str | None:
    """Why ``model``, whose embeddings are ``size`` long, cannot be served (None: it can).
    The graph optimization, the batcher's checks and the embedding cache are built for
    :data:`EMBEDDING_DIM`: another size failed after export or at the first request.

    >>> dimension_problem(384, "m") is None, dimension_problem(256, "m")[:31]
    (True, 'm embeds texts in 256 dimension')
    """
    if size == EMBEDDING_DIM:
        return None
    return (
        f"{model} embeds texts in {size} dimensions; sde2 serves sentence encoders of "
        f"{EMBEDDING_DIM} (all-MiniLM-L6-v2's, over which SPEC §3 defines the reward)"
    )


#: Token budget per text including [CLS] and [SEP] (the model's ``max_seq_length``).
MAX_SEQ_LENGTH = 256

#: Where an encoder runs: on the CPU, or on a CUDA GPU.
Provider = Literal["cpu", "cuda"]
PROVIDERS: tuple[Provider, ...] = get_args(Provider)


@dataclass(frozen=True)
class EncoderDescription:
    """What an encoder is and how it runs: ``/v1/info`` reports it, the service sizes its work
    by it."""

    #: The backend that computes the embeddings (``"onnx"``, ``"torch"``, a test double's name).
    backend: str
    #: The weights' numeric form (``"fp32"``, ``"fp16"``, ``"int8"``).
    variant: str
    provider: Provider
    #: The model's folder on this machine, when it has one.
    model_dir: Path | None = None
    #: Padded tokens per model run, for a backend that cuts its input by tokens (``None``: it
    #: does not): the service's deadline checks need not be finer than one run.
    max_batch_tokens: int | None = None
    #: Model runs the backend makes at once (the ONNX encoder's streams): the service's chunks
    #: of work between deadline checks grow with it, so that every stream has runs to make.
    streams: int = 1


@dataclass
class EncodeStats:
    """What encoding cost: one call's figures, or a backend's running totals."""

    texts: int = 0
    tokens: int = 0  # real tokens, [CLS]/[SEP] included
    padded_tokens: int = 0  # tokens actually computed (rows × padded length, over batches)
    batches: int = 0
    tokenize_seconds: float = 0.0
    inference_seconds: float = 0.0

    def add(self, other: EncodeStats) -> None:
        """Accumulate ``other`` into this object."""
        self.texts += other.texts
        self.tokens += other.tokens
        self.padded_tokens += other.padded_tokens
        self.batches += other.batches
        self.tokenize_seconds += other.tokenize_seconds
        self.inference_seconds += other.inference_seconds


@dataclass(frozen=True)
class CacheCounts:
    """Lookups of an embedding cache since it was built."""

    hits: int
    misses: int


@dataclass(frozen=True)
class EncoderStats:
    """An encoder's counters, read by ``/metrics`` at scrape time."""

    #: The embedding cache's lookups (``None``: no cache in front of the model).
    cache: CacheCounts | None = None
    #: The model's work so far (``None``: the backend does not count it).
    work: EncodeStats | None = None


@runtime_checkable
class Encoder(Protocol):
    """Maps texts to an ``(n, d)`` float32 matrix whose rows have unit L2 norm, and tells the
    service what it needs to know about itself."""

    @property
    def name(self) -> str:
        """Human-readable description, e.g. ``"all-MiniLM-L6-v2 onnx fp32"``."""
        ...

    @property
    def dimension(self) -> int:
        """``d``, the length of each embedding."""
        ...

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embed ``texts`` in order; an empty sequence gives an ``(0, d)`` matrix."""
        ...

    def warmup(self) -> None:
        """Run at least one real inference (the model's, never a cache's answer), so the first
        request does not pay for lazy initialisation; called once before the service is ready."""
        ...

    def describe(self) -> EncoderDescription:
        """What this encoder is and how it runs (see :class:`EncoderDescription`)."""
        ...

    def stats(self) -> EncoderStats:
        """A snapshot of this encoder's counters (see :class:`EncoderStats`)."""
        ...

    def peek(self, texts: Sequence[str]) -> npt.NDArray[np.float32] | None:
        """The embeddings of ``texts`` when every one is at hand without model work (an
        embedding cache's hits), else None, counting nothing. The service then answers the
        request without the encoder worker's queue; a model backend has nothing at hand and
        answers None."""
        ...


#: Every member of :class:`Encoder`, in declaration order.
ENCODER_MEMBERS: tuple[str, ...] = tuple(n for n in vars(Encoder) if not n.startswith("_"))


def check_encoder(candidate: object) -> Encoder:
    """``candidate`` itself when it has every member of :class:`Encoder`, else a
    :class:`TypeError` that names the missing ones (a wrapper that forgot to forward them)."""
    missing = [name for name in ENCODER_MEMBERS if not hasattr(candidate, name)]
    if missing or not isinstance(candidate, Encoder):
        raise TypeError(
            f"{type(candidate).__name__} is not an Encoder: it lacks {', '.join(missing)} "
            "(see reward_server.encoders.base.Encoder; wrappers forward every member)"
        )
    return candidate


class EncoderWrapper:
    """Base of an encoder that wraps another (``inner``, checked to be an :class:`Encoder`):
    every member is forwarded, so a subclass overrides only what it changes."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = check_encoder(inner)  # forwarding to a member it lacks would fail later

    @property
    def name(self) -> str:
        """The inner encoder's: wrapping does not change what is computed."""
        return self.inner.name

    @property
    def dimension(self) -> int:
        """The inner encoder's."""
        return self.inner.dimension

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """The inner encoder's embeddings."""
        return self.inner.encode(texts)

    def warmup(self) -> None:
        """The inner encoder's warm-up: a wrapper's own answer would warm nothing."""
        self.inner.warmup()

    def describe(self) -> EncoderDescription:
        """The inner encoder's description."""
        return self.inner.describe()

    def stats(self) -> EncoderStats:
        """The inner encoder's counters."""
        return self.inner.stats()

    def peek(self, texts: Sequence[str]) -> npt.NDArray[np.float32] | None:
        """What the inner encoder has at hand."""
        return self.inner.peek(texts)
