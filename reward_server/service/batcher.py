"""Admission control and the single encoder worker that coalesces concurrent requests.

Why one worker: the encoder is the only expensive step and onnxruntime already uses every core
for one batch, so running two batches at once only makes both slower. Instead, while one batch
runs, newly arriving requests wait in an explicit queue; when the worker comes back it takes
every waiting request that fits the token budget, embeds the *distinct* texts of all of them in
one call (GRPO steps repeat strategies; concurrent requests share texts) and hands each request
its rows. Under load batches grow, which is what makes throughput scale; idle, a request starts
at once (no batching delay).

Why admission is explicit and fails fast: a server that accepts everything turns a burst into
unbounded latency for everyone. At most ``capacity`` requests are admitted at a time (from
parsing to response), and none while the queued work is estimated (from the measured encoder
throughput) to outlast a request's deadline; the next one is refused at once with an estimate
of when to retry (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED), as text-embeddings-inference
does. Each admitted request also carries a deadline: a request still queued at its deadline is
dropped without being encoded, so a stalled client never makes the queue grow.

Why the worker encodes in chunks: one request may bring minutes of encoder work (a request of
1024 items × 256 strategies). The worker runs a batch's distinct texts ``chunk_tokens`` estimated
tokens at a time and, between chunks, drops the requests that are past their deadline or whose
caller gave up (:meth:`JobFuture.abandon`), so the encoder stops working for a request within one
chunk (well under a second) of its 503, and the next requests run right after.

The worker is a plain thread with a lock-protected deque, not an asyncio task, so that the HTTP
app (any event loop, including test clients' private loops) and the gRPC server share one
batcher; callers await the returned :class:`concurrent.futures.Future` with
:func:`asyncio.wrap_future`.
"""

from __future__ import annotations

import logging
import math
import string
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from reward_server.encoders.base import EMBEDDING_DIM, MAX_SEQ_LENGTH, Encoder
from reward_server.service.errors import (  # re-exported: the batcher raises them
    DeadlineExceeded,
    EncoderFailed,
    Overloaded,
    ShuttingDown,
)

log = logging.getLogger(__name__)

#: Characters per WordPiece token of English prose (GSM8K solutions', rounded down); used only
#: to estimate a batch's size before tokenizing, so being a bit off only changes batch sizes.
CHARS_PER_TOKEN = 4


#: Estimated tokens per encoder stream between deadline checks on CPU. Per stream, because each
#: chunk is one encoder call and a chunk of too few runs leaves a stream idle at its end, so
#: smaller chunks cost a standard step time (measurements: benchmarks/README.md, the service's
#: design). The service sizes a batcher's chunks from it and the encoder's streams.
CHUNK_TOKENS_PER_STREAM = 4096


#: ASCII punctuation, deleted by ``bytes.translate``: what is gone was that many WordPiece
#: tokens. (``str.translate`` with a deletion map looks every character up in a dict, and a
#: standard step's texts are estimated three times a request; measurements:
#: benchmarks/README.md, the service's design.)
_PUNCTUATION = string.punctuation.encode("ascii")


def estimate_tokens(text: str) -> int:
    """Rough token count of ``text`` ([CLS] and [SEP] included, capped at the model's limit).

    Prose runs about :data:`CHARS_PER_TOKEN` characters a token, but BERT's pre-tokenizer
    makes every punctuation character a token of its own and most CJK characters one each: a
    text of 254 "!" is 256 tokens, estimated at 66 by length alone, so one request could hold
    the encoder far longer than its estimate (and its deadline checks that far apart). So a
    text is also counted by its words, punctuation and half its non-ASCII characters, and the
    larger count is taken (measurements: benchmarks/README.md, the service's design).

    >>> estimate_tokens("a" * 40), estimate_tokens("!" * 254), estimate_tokens("中文" * 50)
    (12, 256, 53)
    """
    ascii_part = text.encode("ascii", "ignore")
    punctuation = len(ascii_part) - len(ascii_part.translate(None, _PUNCTUATION))
    pieces = text.count(" ") + 1 + punctuation + (len(text) - len(ascii_part)) // 2
    return min(MAX_SEQ_LENGTH, 2 + max(math.ceil(len(text) / CHARS_PER_TOKEN), pieces))


#: No embeddings: what a batch whose every request is gone before its first chunk holds.
_NO_ROWS = np.zeros((0, EMBEDDING_DIM), np.float32)


def embedding_problem(embeddings: npt.NDArray[np.float32], n: int) -> str | None:
    """Why an encoder's answer for ``n`` texts cannot be used, or None: a wrong shape, or a
    non-finite row (a NaN row would decide Uniq silently)."""
    if embeddings.shape != (n, EMBEDDING_DIM):
        return f"encoder returned shape {embeddings.shape}"
    if not np.isfinite(embeddings).all():
        return "encoder returned non-finite embeddings"
    return None


@dataclass(frozen=True)
class EncodeResult:
    """What one request gets back from the worker."""

    embeddings: npt.NDArray[np.float32]  # rows aligned with the submitted texts
    queue_seconds: float  # from submission to the start of its batch
    encode_seconds: float  # the batch's encoder call (shared with the batch's other requests)
    batch_requests: int
    batch_texts: int  # distinct texts in the batch


class JobFuture(Future[EncodeResult]):
    """The future :meth:`Batcher.submit` returns; :meth:`abandon` also stops a running job."""

    abandoned = False
    #: Takes the queued job out of its batcher's queue (set by :meth:`Batcher.submit`).
    withdraw: Callable[[], None] | None = None

    def abandon(self) -> None:
        """The caller gave up (deadline, disconnect): take the job out of the queue, and stop
        encoding its texts at the next chunk if it is running (a running future cannot be
        cancelled). Left queued until the worker reaches it, its work would count in the
        backlog that admission and ``Retry-After`` read (refusing live requests for it) and in
        the queue gauges."""
        self.abandoned = True
        if self.cancel() and self.withdraw is not None:
            self.withdraw()


@dataclass(eq=False)  # one job is one submission: found in the queue by identity
class _Job:
    texts: list[str]
    #: :func:`estimate_tokens` of each text, once: admission, chunking and the throughput
    #: estimate all read them.
    estimates: list[int]
    tokens: int
    deadline: float
    submitted: float
    future: JobFuture = field(default_factory=JobFuture)

    def gone(self, now: float) -> bool:
        """Past its deadline or abandoned by its caller: encoding more for it is waste."""
        return self.future.abandoned or now > self.deadline


@dataclass
class BatchRecord:
    """One coalesced encoder call, reported to the observer (metrics)."""

    requests: int
    texts: int
    distinct_texts: int
    tokens: int
    seconds: float


class BatchObserver:
    """Hooks the batcher calls; the default does nothing (metrics subclass it)."""

    def on_batch(self, record: BatchRecord) -> None:
        """Called after each encoder call."""

    def on_dropped(self, jobs: int) -> None:
        """Called when queued jobs are skipped: their deadline passed or their caller gave up
        (taken out of the queue, or stopped in a batch)."""

    def on_depth(self, admitted: int, queued_requests: int, queued_tokens: int) -> None:
        """Called whenever the admitted or queued counts change."""


class Ticket:
    """An admitted request's place; release it exactly once (use it as a context manager)."""

    def __init__(self, batcher: Batcher) -> None:
        self._batcher = batcher
        self._released = False

    def release(self) -> None:
        """Give the place back."""
        if not self._released:
            self._released = True
            self._batcher._release()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _fail(jobs: Iterable[_Job], reason: str) -> None:
    """Fail each of ``jobs`` not already answered with :class:`EncoderFailed` (``reason``)."""
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(EncoderFailed(reason))


class Batcher:
    """Bounded admission + one worker thread coalescing the encoder work of admitted requests."""

    def __init__(
        self,
        encoder: Encoder,
        *,
        capacity: int,
        batch_tokens: int,
        max_backlog_seconds: float | None = None,
        observer: BatchObserver | None = None,
        chunk_tokens: int = CHUNK_TOKENS_PER_STREAM,
    ) -> None:
        if capacity < 1 or batch_tokens < 1 or chunk_tokens < 1:
            raise ValueError("capacity, batch_tokens and chunk_tokens must be >= 1")
        self.encoder = encoder
        self.capacity = capacity
        self.batch_tokens = batch_tokens
        #: Estimated tokens encoded between two checks for requests that are gone.
        self.chunk_tokens = chunk_tokens
        #: Refuse new requests while the queued work is estimated to take longer than this:
        #: they would only wait and then miss their deadline, so refusing now is kinder.
        self.max_backlog_seconds = max_backlog_seconds
        self.observer = observer or BatchObserver()
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._queued_tokens = 0
        self._admitted = 0
        self._stopping = False
        self._stopped = False  # the worker has returned (set under the lock as it does)
        self._busy_until = 0.0  # monotonic estimate of when the running batch ends
        self._running: list[_Job] = []  # the running batch's jobs
        #: Exponential moving average of encoder throughput (estimated tokens per second);
        #: seeds the Retry-After estimate. Starts pessimistic (2 cores, fp32 ~ 5k tokens/s).
        self._tokens_per_second = 5000.0
        self._thread = threading.Thread(target=self._run, name="sde2-encoder", daemon=True)
        self._thread.start()

    # -- admission ----------------------------------------------------------------------------

    def admit(self) -> Ticket:
        """A place for one request, or :class:`Overloaded` at once when all are taken."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if self._admitted >= self.capacity or (
                self.max_backlog_seconds is not None
                and self._backlog_seconds_locked() > self.max_backlog_seconds
            ):
                raise Overloaded(self._retry_after_locked())
            self._admitted += 1
            self._notify_depth_locked()
        return Ticket(self)

    def _release(self) -> None:
        with self._cond:
            self._admitted -= 1
            self._notify_depth_locked()
            self._cond.notify_all()

    def _backlog_seconds_locked(self) -> float:
        """Estimated seconds until the queued and running work is done."""
        now = time.monotonic()
        queued = self._queued_tokens / self._tokens_per_second
        running = max(0.0, self._busy_until - now)
        if all(job.gone(now) for job in self._running):  # the worker stops after this chunk
            running = min(running, self.chunk_tokens / self._tokens_per_second)
        return queued + running

    def _retry_after_locked(self) -> int:
        """Seconds until the queued work is likely done (at least 1)."""
        return max(1, math.ceil(self._backlog_seconds_locked()))

    @property
    def admitted(self) -> int:
        """Requests currently admitted."""
        return self._admitted

    @property
    def queued(self) -> int:
        """Requests waiting for the encoder."""
        return len(self._jobs)

    # -- work ---------------------------------------------------------------------------------

    def submit(self, texts: Sequence[str], deadline: float) -> JobFuture:
        """Queue ``texts`` for embedding; ``deadline`` is a :func:`time.monotonic` instant.

        :class:`Overloaded` when the work queued before it and its own would outlast
        ``deadline``. The future fails with :class:`DeadlineExceeded` if its texts are not
        encoded by then (checked before each chunk); abandoning it (the caller gave up) makes
        the worker skip the job, or stop encoding for it at the next chunk.
        """
        estimates = list(map(estimate_tokens, texts))
        job = _Job(list(texts), estimates, sum(estimates), deadline, submitted=time.monotonic())
        with self._cond:
            if self._stopped:
                raise ShuttingDown("the encoder worker has stopped")
            # Admission sees the backlog before this request's own work is known: a burst of
            # large requests would all be admitted, then answered 503 at the deadline, after
            # waiting it out. Work queued behind others that would outlast the deadline is a
            # 429 now, while waiting can still help (alone, it is tried: it may be quicker).
            backlog = self._backlog_seconds_locked()
            own = job.tokens / self._tokens_per_second
            if backlog > 0 and job.submitted + backlog + own > deadline:
                wait = self._retry_after_locked()
                msg = (
                    f"server busy: the queued work (~{backlog:.0f} s) and this request's "
                    f"(~{own:.0f} s) would outlast its deadline; retry after {wait} s"
                )
                if job.submitted + own > deadline:  # over it even alone: a retry may not help
                    msg += (
                        f" (its own work alone is estimated over the {deadline - job.submitted:.0f}"
                        " s its deadline leaves: send fewer or shorter texts, or a later deadline)"
                    )
                raise Overloaded(wait, msg)
            self._jobs.append(job)
            self._queued_tokens += job.tokens
            self._notify_depth_locked()
            self._cond.notify_all()
        job.future.withdraw = lambda: self._withdraw(job)
        return job.future

    def _withdraw(self, job: _Job) -> None:
        """Take an abandoned ``job`` out of the queue (a no-op once the worker took it)."""
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                return
            job.future.withdraw = None  # it held the job, which holds the future: a cycle
            self._queued_tokens -= job.tokens
            self._notify_depth_locked()
        self._report_dropped(1)

    def lookup(self, texts: Sequence[str]) -> EncodeResult | None:
        """The embeddings of ``texts`` when the encoder has them all without model work (every
        one cached), answered on the caller's thread; None when any needs the encoder (then
        :meth:`submit` them). Such a request takes nothing from the encoder, so it neither
        waits in the queue nor joins a batch; its ``encode_seconds`` is the lookup's time."""
        with self._cond:
            if self._stopped:
                return None  # submit() says why
        start = time.monotonic()
        found = self.encoder.peek(texts)
        if found is None:
            return None
        embeddings = np.asarray(found, dtype=np.float32)
        if embedding_problem(embeddings, len(texts)) is not None:
            return None  # as the worker would fail it: let the worker say so
        return EncodeResult(
            embeddings,
            queue_seconds=0.0,
            encode_seconds=time.monotonic() - start,
            batch_requests=1,
            batch_texts=len(texts),
        )

    def _take_locked(self) -> list[_Job]:
        """The oldest job plus every following one that fits the token budget."""
        taken = [self._jobs.popleft()]
        budget = self.batch_tokens - taken[0].tokens
        while self._jobs and self._jobs[0].tokens <= budget:
            job = self._jobs.popleft()
            budget -= job.tokens
            taken.append(job)
        self._queued_tokens -= sum(j.tokens for j in taken)
        for job in taken:  # out of the queue: nothing to withdraw, and no cycle to collect
            job.future.withdraw = None
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:  # stopping and nothing left
                    # Under the lock: a job submitted from now on is refused, never left
                    # queued for a worker that has returned.
                    self._stopped = True
                    return
                taken = self._take_locked()
                tokens = sum(j.tokens for j in taken)
                self._busy_until = time.monotonic() + tokens / self._tokens_per_second
                self._running = taken
                self._notify_depth_locked()
            try:
                self._encode(taken)
            except Exception as exc:  # the worker must outlive any batch: fail it, go on
                log.exception("the encoder worker failed a batch of %d requests", len(taken))
                _fail(taken, f"{type(exc).__name__}: {exc}")
            except BaseException as exc:  # SystemExit or KeyboardInterrupt in engine code
                self._die(taken, exc)
                raise
            with self._cond:  # it may have ended early (requests gone)
                self._busy_until = time.monotonic()
                self._running = []

    def _die(self, taken: list[_Job], exc: BaseException) -> None:
        """The worker's thread is ending on ``exc``: its batch and every queued request fail,
        and later ones are refused (queued for a thread that is gone, they would be answered
        only by their own deadlines)."""
        with self._cond:
            self._stopped = True
            jobs = [*taken, *self._jobs]
            self._jobs.clear()
            self._queued_tokens = 0
            self._running = []
            self._notify_depth_locked()
        log.critical("the encoder worker stopped: %s", type(exc).__name__)
        _fail(jobs, f"the encoder worker stopped: {exc!r}")

    def _encode(self, taken: list[_Job]) -> None:
        start = time.monotonic()
        live: list[_Job] = []
        for job in taken:
            if not job.future.set_running_or_notify_cancel():
                continue  # the caller gave up (its own deadline or a disconnect)
            if start > job.deadline:
                job.future.set_exception(DeadlineExceeded("deadline passed while queued"))
                continue
            live.append(job)
        served = len(live)
        failed = 0
        # Each embedded text's row in the chunks' embeddings, concatenated: a request's rows are
        # then taken by one fancy index, cheaper than stacking a row view a text (measurements:
        # benchmarks/README.md, the service's design).
        row: dict[str, int] = {}
        chunks: list[npt.NDArray[np.float32]] = []
        tokens = 0
        estimates: dict[str, int] = {}
        for job in live:
            estimates.update(zip(job.texts, job.estimates, strict=True))
        # Longest first, as the encoder plans its runs: chunks of similar lengths pad little.
        todo = sorted(estimates, key=len, reverse=True)
        pos = 0
        while pos < len(todo) and live:
            chunk = self._next_chunk(todo, pos, estimates)
            pos += len(chunk)
            try:
                embeddings = np.asarray(self.encoder.encode(chunk), dtype=np.float32)
                if (problem := embedding_problem(embeddings, len(chunk))) is not None:
                    raise ValueError(problem)
            except Exception as exc:  # a broken encoder fails its requests, never the worker
                log.exception("encoder failed on a batch of %d texts", len(chunk))
                _fail(live, str(exc))
                failed, live = len(live), []  # reported below: the jobs dropped before count
                break
            row.update(zip(chunk, range(len(row), len(row) + len(chunk)), strict=True))
            chunks.append(embeddings)
            tokens += sum(map(estimates.__getitem__, chunk))
            now = time.monotonic()
            gone = [j for j in live if j.gone(now)]
            for job in gone:
                live.remove(job)
                job.future.set_exception(DeadlineExceeded("deadline passed while encoding"))
            if gone:  # skip the texts only the dropped requests needed
                needed = {t for job in live for t in job.texts}
                todo, pos = [t for t in todo[pos:] if t in needed], 0
        seconds = time.monotonic() - start
        if seconds > 0 and tokens >= 64:  # tiny batches say little about throughput
            rate = tokens / seconds
            self._tokens_per_second = 0.8 * self._tokens_per_second + 0.2 * rate
        embedded = chunks[0] if len(chunks) == 1 else np.concatenate(chunks or [_NO_ROWS])
        for job in live:
            job.future.set_result(
                EncodeResult(
                    embedded[[row[t] for t in job.texts]],
                    queue_seconds=start - job.submitted,
                    encode_seconds=seconds,
                    batch_requests=served,
                    batch_texts=len(row),
                )
            )
        record = BatchRecord(
            requests=len(live),
            texts=sum(len(j.texts) for j in live),
            # of the live requests' texts (``row`` also holds those of requests dropped midway)
            distinct_texts=len({t for job in live for t in job.texts}),
            tokens=tokens,
            seconds=seconds,
        )
        try:
            self.observer.on_batch(record)
        except Exception:  # metrics must never break serving
            log.exception("batch observer failed")
        self._report_dropped(len(taken) - len(live) - failed)

    def _report_dropped(self, jobs: int) -> None:
        if not jobs:
            return
        try:
            self.observer.on_dropped(jobs)
        except Exception:  # metrics must never break serving
            log.exception("batch observer failed")

    def _next_chunk(self, todo: list[str], pos: int, estimates: dict[str, int]) -> list[str]:
        """The texts of ``todo`` from ``pos`` on that fit ``chunk_tokens`` (at least one), by
        their ``estimates``."""
        budget = self.chunk_tokens
        end = pos
        while end < len(todo):
            budget -= estimates[todo[end]]
            if budget < 0 and end > pos:
                break
            end += 1
        return todo[pos:end]

    def _notify_depth_locked(self) -> None:
        try:
            self.observer.on_depth(self._admitted, len(self._jobs), self._queued_tokens)
        except Exception:  # metrics must never break serving
            log.exception("batch observer failed")

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued ones, stop the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is admitted, or ``timeout`` passes; True if idle (tests)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._admitted:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True
