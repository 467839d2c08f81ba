"""The scoring pipeline shared by the HTTP and gRPC front ends.

One request goes: admission (or an immediate :class:`Overloaded`) -> parse + validate + server
limits + :func:`prepare_batch` -> the shared :class:`Batcher` (queue, coalesced encoder call) ->
:func:`finish_batch` (a request whose embeddings are all cached is rewarded in the trip that
prepared it, without the batcher's queue). Both front ends call :meth:`ScoringService.score`
with the same request model, so they return identical numbers and reject the same inputs with
the same field paths. What a request must pass beyond its schema is
:mod:`~reward_server.service.request_checks`'; what the service answers,
:mod:`~reward_server.service.scored`'s :class:`Scored`.

CPU-bound phases (validation of a large body, parsing, the reward) run in a small thread pool so
the event loop keeps answering ``/healthz`` and rejecting overload quickly while they run. A
small body (``--inline-bytes``, 256 KiB) is parsed on the loop itself: the pool's two thread
hand-offs cost more than they protect there (see :meth:`ScoringService._parse_and_prepare`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
from pydantic import ValidationError

from reward_server import __version__
from reward_server.core import (
    BatchScore,
    InvalidBatch,
    NonFiniteRewardError,
    PreparedBatch,
    RewardParams,
    finish_batch,
    prepare_batch,
)
from reward_server.core.answers import MathJudge, math_available, math_equivalent
from reward_server.core.explain import explain_batch
from reward_server.encoders.base import EMBEDDING_DIM, Encoder, check_encoder
from reward_server.encoders.model_store import EXPLAINED_LOAD_ERRORS
from reward_server.math_judge import (
    IsolatedMathJudge,
    MathCheckerUnavailable,
    MathDeadlineExceeded,
    RequestJudge,
)
from reward_server.service.batcher import CHUNK_TOKENS_PER_STREAM, Batcher, EncodeResult
from reward_server.service.config import Settings
from reward_server.service.credentials import key_matches
from reward_server.service.errors import (
    ClientGone,
    DeadlineExceeded,
    MathUnavailable,
    NotReady,
    RequestInvalid,
    ShuttingDown,
    Unauthorized,
    issue,
)
from reward_server.service.metrics import Metrics
from reward_server.service.request_checks import (
    LocMap,
    check_encoder_budget,
    check_explanation_size,
    issues_from_validation,
    mapped_loc,
    size_issues,
)
from reward_server.service.schemas import ScoreRequest
from reward_server.service.scored import Scored, nothing_scored

log = logging.getLogger(__name__)

T = TypeVar("T")


#: Runs each stream makes in a chunk at least, when there are several streams, for the same
#: reason (OpenVINO's 1024-token runs left a stream idle in 4096-token chunks).
RUNS_PER_STREAM = 4


def _chunk_tokens(encoder: Encoder) -> int:
    """The default ``chunk_tokens``: :data:`CHUNK_TOKENS_PER_STREAM` for each of the backend's
    streams, or :data:`RUNS_PER_STREAM` of its runs per stream when larger; one stream (a GPU,
    which runs big batches in milliseconds) needs one of its runs."""
    described = encoder.describe()
    runs = RUNS_PER_STREAM if described.streams > 1 else 1
    per_stream = max(CHUNK_TOKENS_PER_STREAM, runs * (described.max_batch_tokens or 0))
    return per_stream * described.streams


#: The phases a request with nothing to score skips (its answer still times every phase).
_NO_WORK = {"queue": 0.0, "encode": 0.0, "reward": 0.0}


def _refused(exc: NonFiniteRewardError) -> RequestInvalid:
    """A non-finite reward, refused naming the parameter that made it (never returned)."""
    return RequestInvalid.one((exc.field,), exc.reason, "non_finite")


def _constant(encoder: Encoder | None) -> Callable[[], Encoder]:
    assert encoder is not None

    def load() -> Encoder:
        return encoder

    return load


@dataclass(frozen=True)
class _CachedReward:
    """A request rewarded in the pool trip that prepared it (every embedding cached), with the
    :func:`time.monotonic` instants its phases ended."""

    prepared: float
    found: EncodeResult
    embedded: float
    score: BatchScore
    rewarded: float


class ScoringService:
    """Owns the encoder, the batcher and the metrics; front ends only translate wire formats."""

    def __init__(
        self,
        settings: Settings,
        *,
        encoder: Encoder | None = None,
        loader: Callable[[], Encoder] | None = None,
        metrics: Metrics | None = None,
        unenforced: Collection[str] = (),
        loading_since: float | None = None,
    ) -> None:
        """``unenforced``: settings the transport in front of this service does not apply
        (under Ray, uvicorn's connection limits): ``/v1/info`` leaves them out of ``limits``
        rather than report a limit nothing enforces. ``loading_since``: when ``loader``'s work
        began (``time.monotonic``), where that was before :meth:`start` (the server begins it
        first thing), so that the "ready in" log counts all of it."""
        if (encoder is None) == (loader is None):
            raise ValueError("pass exactly one of encoder and loader")
        self.settings = settings
        self.unenforced = frozenset(unenforced)
        self.metrics = metrics or Metrics()
        if encoder is not None:
            check_encoder(encoder)  # a wrapper that forgot a member fails here, not in service
        self._loader: Callable[[], Encoder] = loader if loader is not None else _constant(encoder)
        self.encoder: Encoder | None = None
        self.batcher: Batcher | None = None
        self.load_error: str | None = None
        self._ready = threading.Event()
        self._loaded = threading.Event()  # set when loading ended, successfully or not
        self._started = False
        self._loading_since = loading_since
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sde2-cpu")
        # answer_type=math requests wait on their checks in threads of their own, so they never
        # hold the CPU pool every other request needs. Each such request checks one pair at a
        # time, and waiting requests take the next free child in turn (first come first served):
        # one request cannot take every child, and a one-item request waits for one check, not
        # for another request's hundred.
        # A thread for every admitted request: a request waits for its checks in its thread,
        # so with fewer threads than requests a few heavy requests would hold them all and a
        # one-item request would queue behind their whole work, never reaching the children's
        # fair hand-out. (Threads start only when needed; measurements: benchmarks/README.md,
        # the service's design.)
        self._math_pool = ThreadPoolExecutor(
            max_workers=max(2 * settings.math_workers, settings.queue_capacity),
            thread_name_prefix="sde2-math",
        )
        self._math_judge: IsolatedMathJudge | None = None
        self._math_lock = threading.Lock()
        # The scoring requests running now (their tasks), and those the drain's end cut.
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._drain_over = False

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, background: bool = True) -> None:
        """Load and warm the encoder (in a thread: ``/healthz`` answers meanwhile)."""
        if self._started:
            return
        self._started = True
        if background:
            threading.Thread(target=self._load, name="sde2-load", daemon=True).start()
        else:
            self._load()

    def _load(self) -> None:
        try:
            t0 = time.monotonic() if self._loading_since is None else self._loading_since
            encoder = check_encoder(self._loader())
            encoder.warmup()
            self.metrics.attach_encoder(encoder)
            self.encoder = encoder
            self.batcher = Batcher(
                encoder,
                capacity=self.settings.queue_capacity,
                batch_tokens=self.settings.batch_tokens,
                max_backlog_seconds=self.settings.request_timeout,
                observer=self.metrics,
                chunk_tokens=self.settings.chunk_tokens or _chunk_tokens(encoder),
            )
            self.metrics.ready.set(1)
            self._ready.set()
            log.info("encoder %s ready in %.1f s", encoder.name, time.monotonic() - t0)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, EXPLAINED_LOAD_ERRORS):  # its message says what to do
                log.error("loading the encoder failed: %s", self.load_error)
            else:
                log.exception("loading the encoder failed")
        finally:
            self._loaded.set()

    @property
    def ready(self) -> bool:
        """Model loaded and one warm-up inference done."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (tests; the server waits on :meth:`wait_loaded`)."""
        return self._ready.wait(timeout)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until loading ended (check :attr:`ready` / :attr:`load_error`)."""
        return self._loaded.wait(timeout)

    def end_drain(self) -> int:
        """The drain's time is over: every scoring request still running answers
        :class:`ShuttingDown` (HTTP 503, gRPC UNAVAILABLE) now, and any later one at once;
        returns how many were cut. Called on the event loop when ``drain_timeout`` has passed
        since the stop, before the transports cancel what is left themselves (uvicorn's
        cancelled request would answer a bare 500); its texts are abandoned as a departed
        client's are."""
        self._drain_over = True
        for task in self._in_flight - self._cut:
            self._cut.add(task)
            task.cancel()
        return len(self._cut)

    def close(self) -> None:
        """Stop the worker after the queued work."""
        if self.batcher is not None:
            self.batcher.close(timeout=self.settings.drain_timeout)
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._math_pool.shutdown(wait=False, cancel_futures=True)
        if self._math_judge is not None:
            self._math_judge.close()

    def math_judge(self, deadline: float) -> RequestJudge:
        """The isolated ``math`` matcher bounded by ``deadline`` (its processes start on first
        use: most servers never see ``answer_type = "math"``)."""
        with self._math_lock:
            if self._math_judge is None:
                self._math_judge = IsolatedMathJudge(
                    time_limit=self.settings.math_timeout,
                    workers=self.settings.math_workers,
                    on_timeout=self.metrics.math_timeouts.inc,
                )
            return self._math_judge.bounded(deadline)

    # -- scoring ------------------------------------------------------------------------------

    @property
    def encoder_name(self) -> str:
        """The ``encoder`` field of responses."""
        return self.encoder.name if self.encoder is not None else "loading"

    def is_authorized(self, authorization: str | None) -> bool:
        """:func:`key_matches` with this server's key."""
        return key_matches(self.settings.api_key, authorization)

    def authorize(self, authorization: str | None) -> None:
        """:meth:`is_authorized`, or :class:`Unauthorized`: the one key check of every
        transport (they only hand over the credential)."""
        if not self.is_authorized(authorization):
            raise Unauthorized()

    def check_limits(self, request: ScoreRequest, loc_map: LocMap | None = None) -> None:
        """What this server can score and its size limits (:func:`size_issues`; the schema's
        own constraints are already checked), every issue at once."""
        issues: list[dict[str, Any]] = []
        if request.answer_type == "math" and not math_available():
            msg = "'math' needs the server's optional extra sde2[math], not installed here"
            issues.append(issue(mapped_loc(loc_map, ("answer_type",)), msg, "unsupported"))
        issues += size_issues(request.items, self.settings, loc_map)
        if issues:
            raise RequestInvalid(issues)

    async def _in_pool(self, fn: Callable[[], T], pool: ThreadPoolExecutor | None = None) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool or self._cpu, fn)

    async def score(
        self,
        parse: Callable[[], ScoreRequest | None],
        *,
        authorization: str | None = None,
        receive: Callable[[], Awaitable[object]] | None = None,
        gone: Callable[[], Awaitable[object]] | None = None,
        size: Callable[[], int] | None = None,
        loc_map: LocMap | None = None,
        timeout: float | None = None,
        explain: bool = False,
    ) -> Scored:
        """Authorize, admit, parse, encode through the batcher, reward. Raises a
        :class:`~reward_server.service.errors.ServiceError` (each transport converts it once).

        ``parse`` returns None for a valid request with nothing to score (OpenRLHF's empty
        lists): the answer is then an empty score. ``authorization`` is the caller's credential
        (see :meth:`authorize`), checked before anything else. ``receive`` is awaited once the
        request is admitted and before ``parse``: HTTP reads its body there, so a full server
        answers 429 at once without buffering the body, and the bodies held in memory are
        bounded by the queue's capacity. ``gone`` returns once the caller has gone (HTTP: the
        client closed its connection; gRPC cancels the handler itself): while the texts wait
        for the encoder, that abandons them (:class:`ClientGone`), freeing the admission slot
        and the encoder's time. ``size`` gives the request's size in bytes once
        received: up to ``inline_bytes`` it is parsed on the event loop (see
        :meth:`_parse_and_prepare`), else (or without ``size``) in the CPU pool. ``timeout``
        (seconds) tightens the server's ``request_timeout`` for this request. ``explain``
        embeds ``H`` of every item (as ``diagnostics`` does; the rewards are the same) and adds
        the explanation. Once the drain's time is over (:meth:`end_drain`), it raises
        :class:`ShuttingDown`.
        """
        if self._drain_over:
            raise ShuttingDown("the server is shutting down")
        task = asyncio.current_task()
        assert task is not None, "score runs in a task"
        self._in_flight.add(task)
        try:
            return await self._score(
                parse, authorization, receive, gone, size, loc_map, timeout, explain
            )
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()  # the cut's cancel ends here, as the answer below
            raise ShuttingDown("the server is shutting down: the drain timeout passed") from None
        finally:
            self._in_flight.discard(task)
            self._cut.discard(task)

    async def _score(
        self,
        parse: Callable[[], ScoreRequest | None],
        authorization: str | None,
        receive: Callable[[], Awaitable[object]] | None,
        gone: Callable[[], Awaitable[object]] | None,
        size: Callable[[], int] | None,
        loc_map: LocMap | None,
        timeout: float | None,
        explain: bool,
    ) -> Scored:
        """:meth:`score`'s work, in the task it registers."""
        t0 = time.monotonic()
        self.authorize(authorization)
        batcher = self._ready_batcher()
        deadline = t0 + self._budget(timeout)
        with batcher.admit():
            if receive is not None:
                await receive()
            inline = size is not None and size() <= self.settings.inline_bytes
            parsed = await self._parse_and_prepare(
                parse, loc_map, deadline, explain, batcher, inline, gone
            )
            if parsed is None:
                spent = time.monotonic() - t0
                timings = dict.fromkeys(("parse", "total"), spent) | _NO_WORK
                self._observe(timings, items=0)
                return Scored(nothing_scored(), timings, self.encoder_name)
            request, prepared, cached = parsed
            if explain:
                check_explanation_size(prepared, self.settings.max_explain_cells, loc_map)
            if request.answer_type == "math":  # the others' was checked in their preparing trip
                check_encoder_budget(prepared.texts, self.settings.max_request_tokens, loc_map)
            scored = await self._score_prepared(
                batcher, request, prepared, cached, t0, deadline, explain, inline, gone
            )
        if not scored.score.warnings:
            return scored
        warnings = tuple(
            str(w._replace(loc=mapped_loc(loc_map, w.loc))) for w in scored.score.warnings
        )
        log.warning("scored with %d warning(s), the first: %s", len(warnings), warnings[0])
        return replace(scored, warnings=warnings)

    async def _score_prepared(
        self,
        batcher: Batcher,
        request: ScoreRequest,
        prepared: PreparedBatch,
        cached: _CachedReward | None,
        t0: float,
        deadline: float,
        explain: bool,
        inline: bool,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> Scored:
        """Encode, reward (and explain) an admitted, prepared request; time every phase. A
        request rewarded in its preparing trip (``cached``: every embedding was cached) has
        the same answer and phases, without the encoder's queue. ``inline``: a small body,
        prepared on the event loop, is rewarded there too (:meth:`_parse_and_prepare` says
        why)."""
        if cached is None:
            t1 = time.monotonic()
            embeddings, queue_s, encode_s = await self._embed(
                batcher, prepared.texts, deadline, gone
            )
            t2 = time.monotonic()
            score = await self._reward(request, prepared, embeddings, inline)
            t3 = time.monotonic()
        else:
            t1, t2, t3 = cached.prepared, cached.embedded, cached.rewarded
            embeddings, score = cached.found.embeddings, cached.score
            queue_s, encode_s = 0.0, cached.found.encode_seconds
        explanation = None
        if explain:
            explanation = await self._explain(request, prepared, embeddings, score, deadline, gone)
            t3 = time.monotonic()
            if t3 > deadline:  # its size is bounded, its time only by the deadline
                raise DeadlineExceeded("request deadline passed while explaining")
        timings = {
            "parse": t1 - t0,
            "queue": queue_s,
            "encode": encode_s,
            "reward": t3 - t2,
            "total": t3 - t0,
        }
        self._observe(timings, items=len(request.items))
        return Scored(score, timings, self.encoder_name, explanation)

    def _observe(self, timings: dict[str, float], items: int) -> None:
        """A scored request's phases and items (a refused request's are not: each scored
        request is one count of every phase histogram and of the items')."""
        self.metrics.observe_phases(timings)
        self.metrics.items.observe(items)

    def _ready_batcher(self) -> Batcher:
        """The batcher, or :class:`NotReady` while the model loads (or after it failed to)."""
        if self.batcher is None or self.encoder is None:
            raise NotReady(self.load_error or "the model is loading")
        return self.batcher

    def _budget(self, timeout: float | None) -> float:
        """Seconds this request may take: the server's ``request_timeout``, or the client's
        own deadline (gRPC) when sooner."""
        budget = self.settings.request_timeout
        return budget if timeout is None else min(budget, max(0.0, timeout))

    async def _parse_and_prepare(
        self,
        parse: Callable[[], ScoreRequest | None],
        loc_map: LocMap | None,
        deadline: float,
        explain: bool,
        batcher: Batcher,
        inline: bool,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[ScoreRequest, PreparedBatch, _CachedReward | None] | None:
        """Validation, limits and parsing in one trip to the CPU pool, or on the event loop
        itself when ``inline`` (a small body). When every embedding the request needs is
        cached, the same trip also looks them up and computes the reward
        (:meth:`_reward_if_cached`). A math request is prepared in threads of its own instead:
        its checks wait on the judge's children and must not hold the pool every request
        shares; when ``gone`` returns first, its checks stop (:class:`ClientGone`).

        Why a small body stays on the loop: the trip there and back is two thread wake-ups, a
        visible share of a standard step on an idle machine, and the pool does not keep the
        loop free during such work anyway: a pool thread running Python holds the GIL, which
        the loop gets back only after the interpreter's 5 ms switch interval. Work under that
        interval stalls the loop about as long either way; a larger body (up to
        ``max_body_bytes``) goes to the pool, where the loop gets the GIL every 5 ms
        (measurements: benchmarks/README.md, the service's design).
        """

        def prepare(request: ScoreRequest, judge: MathJudge | None = None) -> PreparedBatch:
            return prepare_batch(
                request.items,
                recipe=request.recipe,
                answer_type=request.answer_type,
                params=request.params,
                diagnostics=request.diagnostics or explain,
                math_judge=math_equivalent if judge is None else judge,  # only math asks it
            )

        def parse_and_prepare() -> (
            tuple[ScoreRequest, PreparedBatch | None, _CachedReward | None] | None
        ):
            request = parse()
            if request is None:
                return None
            self.check_limits(request, loc_map)
            if request.answer_type == "math":
                return request, None, None
            prepared = prepare(request)
            check_encoder_budget(prepared.texts, self.settings.max_request_tokens, loc_map)
            return request, prepared, self._reward_if_cached(batcher, request, prepared, deadline)

        try:
            parsed = parse_and_prepare() if inline else await self._in_pool(parse_and_prepare)
            if parsed is None:
                return None
            request, prepared, cached = parsed
            if prepared is None:
                judge = self.math_judge(deadline)
                checks = self._in_pool(partial(prepare, request, judge), self._math_pool)
                prepared = await _unless_gone(checks, gone, judge.cancel)
        except ValidationError as exc:
            raise RequestInvalid(issues_from_validation(exc, loc_map)) from None
        except InvalidBatch as exc:
            loc = mapped_loc(loc_map, exc.loc)
            raise RequestInvalid.one(loc, exc.message, "invalid_batch") from None
        except MathDeadlineExceeded as exc:
            raise DeadlineExceeded(str(exc)) from None
        except MathCheckerUnavailable as exc:
            raise MathUnavailable(str(exc)) from None
        except NonFiniteRewardError as exc:
            raise _refused(exc) from None
        return request, prepared, cached

    def _reward_if_cached(
        self, batcher: Batcher, request: ScoreRequest, prepared: PreparedBatch, deadline: float
    ) -> _CachedReward | None:
        """The reward, computed on this (pool) thread, when the encoder has every embedding
        ``prepared`` needs without model work (:meth:`Batcher.lookup`); else None, and the
        texts go through the batcher. Runs only where the reward would run anyway (a pool
        thread, never the event loop), and only before ``deadline`` (past it the batcher's
        path answers 503 as before)."""
        looked_up = time.monotonic()
        if looked_up > deadline or not prepared.texts:
            return None
        found = batcher.lookup(prepared.texts)
        if found is None:
            return None
        embedded = time.monotonic()
        score = finish_batch(prepared, found.embeddings, normalize=request.normalize)
        return _CachedReward(looked_up, found, embedded, score, time.monotonic())

    async def _embed(
        self,
        batcher: Batcher,
        texts: list[str],
        deadline: float,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[np.ndarray, float, float]:
        """The texts' embeddings through the shared batcher, with the seconds they queued and
        were encoded; :class:`DeadlineExceeded` when ``deadline`` passes first, and
        :class:`ClientGone` when ``gone`` returns first (the worker then skips the texts, or
        stops encoding for this request at its next chunk)."""
        if not texts:
            return np.zeros((0, EMBEDDING_DIM), np.float32), 0.0, 0.0
        future = batcher.submit(texts, deadline)
        embedded = asyncio.wrap_future(future)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            waiting: set[asyncio.Future[Any]] = {embedded} if watch is None else {embedded, watch}
            await asyncio.wait(
                waiting,
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if embedded.done():
                result = embedded.result()
            elif watch is not None and watch.done():
                raise ClientGone("client disconnected while its texts waited for the encoder")
            else:
                raise DeadlineExceeded("request deadline passed while encoding")
        finally:
            future.abandon()  # no-op once done
            embedded.cancel()  # likewise: nobody waits for a later answer
            if watch is not None:
                watch.cancel()
        return result.embeddings, result.queue_seconds, result.encode_seconds

    async def _reward(
        self, request: ScoreRequest, prepared: PreparedBatch, embeddings: np.ndarray, inline: bool
    ) -> BatchScore:
        """The rewards (a non-finite one is refused naming its parameter, never returned), on
        the event loop when ``inline``, else in the CPU pool."""
        reward = partial(finish_batch, prepared, embeddings, normalize=request.normalize)
        try:
            return reward() if inline else await self._in_pool(reward)
        except NonFiniteRewardError as exc:
            raise _refused(exc) from None

    async def _explain(
        self,
        request: ScoreRequest,
        prepared: PreparedBatch,
        embeddings: np.ndarray,
        score: BatchScore,
        deadline: float,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> dict[str, Any]:
        """Why each item got its reward (:mod:`reward_server.core.explain`). A ``math``
        request's explanation checks its answers again, so it waits on them in the math pool,
        as its preparation did, never in the CPU pool every request shares (and stops them
        when ``gone`` returns first)."""
        pool = self._math_pool if request.answer_type == "math" else None
        judge = self.math_judge(deadline)
        try:
            explaining = self._in_pool(
                partial(
                    explain_batch,
                    request.items,
                    prepared,
                    embeddings,
                    score,
                    normalize=request.normalize,
                    math_judge=judge,
                ),
                pool,
            )
            return await _unless_gone(explaining, gone if pool is not None else None, judge.cancel)
        except MathDeadlineExceeded as exc:
            raise DeadlineExceeded(str(exc)) from None
        except MathCheckerUnavailable as exc:
            raise MathUnavailable(str(exc)) from None

    # -- info ---------------------------------------------------------------------------------

    def info_for(self, authorization: str | None) -> dict[str, Any]:
        """``/v1/info`` and gRPC ``Info`` for a caller holding ``authorization``: open to all
        once ready (:class:`NotReady` before), the model's path only with the key when one is
        set."""
        if not self.ready:
            raise NotReady("loading")
        return self.info(reveal_paths=self.is_authorized(authorization))

    def info(self, reveal_paths: bool = True) -> dict[str, Any]:
        """``/v1/info`` and gRPC ``Info``; ``reveal_paths=False`` (a caller without the key,
        when one is set) leaves out where the model lies on the server's disk."""
        s = self.settings
        described = self.encoder.describe() if self.encoder is not None else None
        model_dir = described.model_dir if described is not None else None
        return {
            "encoder": self.encoder_name,
            "variant": described.variant if described is not None else "unknown",
            "provider": described.provider if described is not None else s.provider,
            "model_path": None if model_dir is None or not reveal_paths else str(model_dir),
            "version": __version__,
            "defaults": {
                "recipe": "sde2",
                "answer_type": "numeric",
                "normalize": True,
                "diagnostics": False,
                "params": RewardParams().model_dump(),
            },
            "limits": s.public(self.unenforced),
        }


async def _unless_gone(
    work: Awaitable[T], gone: Callable[[], Awaitable[object]] | None, stop: Callable[[], None]
) -> T:
    """``work``'s result, or :class:`ClientGone` when ``gone`` returns first; either way, or
    when this is cancelled (a gRPC call the client ended, the drain's end), ``stop`` is
    called first (a request's math checks: its thread ends within one check, its admission
    slot is freed now). Otherwise a client that hangs up during its checks would hold its slot
    and a thread for every check left, and be counted as answered."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone()) if gone is not None else None
    try:
        await asyncio.wait(
            {task} if watch is None else {task, watch}, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        _abandon(task, stop)
        raise
    finally:
        if watch is not None:
            watch.cancel()
    if task.done():
        return task.result()
    _abandon(task, stop)
    raise ClientGone("client disconnected while its math answers were checked")


def _abandon(task: asyncio.Future[Any], stop: Callable[[], None]) -> None:
    """Stop ``task``'s work; its outcome (MathChecksCancelled, or whatever ends it) unread."""
    stop()
    task.add_done_callback(_ignore_outcome)


def _ignore_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
