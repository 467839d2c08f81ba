"""The ``math`` matcher run in child processes, each check under a hard time limit.

Why a process: ``math-verify`` hands model output to sympy, and some strings models do emit
(``$9^{9^{9^{9}}}$``) start an integer power that runs in C for hours while holding the GIL. In
the server's threads math-verify's own (signal-based) timeouts cannot run at all, and even on a
main thread a signal cannot interrupt that C loop: the only safe stop is to kill the process
doing it. :class:`IsolatedMathJudge` sends each ``(prediction, gold)`` pair to a small pool of
child processes and kills a child whose check outlives ``time_limit``.

A check that times out counts as *not equivalent*, which is what math-verify itself answers when
its own timeout fires; every such case is logged and counted (``on_timeout``). It is never
cached, nor is a crash: a verdict nobody reached must not outlive the fault (a paused or starved
child would otherwise turn a correct ``\\frac{21}{28}`` vs ``0.75`` into a permanent wrong
reward). A check whose child got less than half of its time limit in CPU time was starved (an
overloaded machine, a paused process), not slow, and is retried once in a fresh child. A check
that runs into the caller's deadline raises :class:`MathDeadlineExceeded` instead, so the request
fails rather than score on a verdict nobody reached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from reward_server.parent_death import die_with_parent

log = logging.getLogger(__name__)

#: Pairs longer than this (characters, both sides) are not cached: the cache stays small.
_CACHEABLE_CHARS = 512


class MathDeadlineExceeded(TimeoutError):
    """The caller's deadline passed before a math equivalence check finished."""


def serve_checks(requests: IO[str], replies: IO[str]) -> None:
    """The child's loop: one JSON ``[prediction, gold]`` line in, one JSON verdict line out."""
    from reward_server.core.answers import math_available, math_equivalent

    if not math_available():
        message = "answer_type 'math' needs the optional extra: pip install sde2[math]"
        replies.write(json.dumps({"error": message}) + "\n")
        replies.flush()
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        prediction, gold = json.loads(line)
        try:
            reply: dict[str, Any] = {"equivalent": math_equivalent(prediction, gold)}
        except Exception as exc:  # math-verify catches its own; anything else is reported
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class _ChildDied(Exception):
    """The child's pipe closed: it exited or was killed."""


class _DiedStarting(_ChildDied):
    """The child exited before its hello: killed while it started, or unable to start."""


class MathCheckerUnavailable(RuntimeError):
    """No child can start (twice in a row): math answers cannot be checked here. Never a
    verdict: counting every answer *not equivalent* would train on silently wrong rewards."""


class _Child:
    """One ``python -m reward_server.math_judge`` process and its pipes."""

    def __init__(self) -> None:
        """Start the process; it imports sympy while the caller goes on (see :meth:`started`)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reward_server.math_judge", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C on the terminal is the parent's to handle
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self._buffer = b""
        self._started = False

    def started(self, timeout: float) -> _Child:
        """Wait (once) for the child's hello; raise if it cannot check math answers."""
        if self._started:
            return self
        # A child that exits before its hello (killed while it starts: the OOM killer) is
        # retried in a fresh child, as a death mid-check is; a second is no such accident.
        try:
            hello = self.read(timeout)
        except _ChildDied:
            raise _DiedStarting(f"the math checker exited with {self.process.wait()}") from None
        if hello is None or "error" in hello:
            self.kill()
            why = "did not start in time" if hello is None else hello["error"]
            raise MathCheckerUnavailable(f"cannot check math answers: {why}")
        self._started = True
        return self

    def send(self, prediction: str, gold: str) -> None:
        try:
            self._stdin.write(json.dumps([prediction, gold]).encode() + b"\n")
            self._stdin.flush()
        except OSError as exc:
            raise _ChildDied from exc

    def read(self, timeout: float) -> dict[str, Any] | None:
        """The next reply, or ``None`` when none came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self._stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _ChildDied
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def alive(self) -> bool:
        return self.process.poll() is None

    def cpu_seconds(self) -> float | None:
        """CPU time the child has used so far (None where it cannot be read)."""
        try:
            import psutil

            times = psutil.Process(self.process.pid).cpu_times()
        except Exception:  # no psutil, or the process is gone
            return None
        return float(times.user + times.system)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        for pipe in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):  # unsent bytes to a dead child: nothing to do
                pipe.close()


class _FairSlots:
    """The children, handed out first come first served. A :class:`queue.Queue` lets a thread
    that just returned a child take it straight back ahead of threads already waiting, so one
    request checking answer after answer could keep a child from every other request; here a
    returned child goes to the longest waiting caller (requests take turns)."""

    def __init__(self, n: int) -> None:
        self._free: deque[_Child | None] = deque([None] * n)
        self._waiters: deque[list[Any]] = deque()  # [event, handed child or _NONE]
        self._lock = threading.Lock()

    def get(self, timeout: float | None = None) -> _Child | None:
        """A child (None: start one), or :class:`queue.Empty` after ``timeout`` seconds."""
        with self._lock:
            if self._free and not self._waiters:
                return self._free.popleft()
            waiter: list[Any] = [threading.Event(), _NONE]
            self._waiters.append(waiter)
        waiter[0].wait(timeout)
        with self._lock:
            if waiter[1] is _NONE:  # timed out before a child was handed over
                self._waiters.remove(waiter)
                raise queue.Empty
        child: _Child | None = waiter[1]
        return child

    def get_nowait(self) -> _Child | None:
        with self._lock:
            if not self._free:
                raise queue.Empty
            return self._free.popleft()

    def put(self, child: _Child | None) -> None:
        with self._lock:
            if self._waiters:
                waiter = self._waiters.popleft()
                waiter[1] = child
                waiter[0].set()
            else:
                self._free.append(child)


_NONE = object()


@dataclass
class _Check:
    """One pair's check in progress: the child in hand (back to the pool at the end), the time
    limit, whether that limit is the caller's deadline, and why the check failed so far."""

    prediction: str
    gold: str
    limit: float
    by_deadline: bool
    deadline: float | None
    child: _Child | None
    why: str = ""
    cpu_before: float | None = None


class IsolatedMathJudge:
    """``(prediction, gold) -> bool`` by math-verify, in ``workers`` killable child processes.

    Thread-safe: concurrent callers use different children (and wait for a free one, first
    come first served: callers that each check one pair at a time take turns). Children start
    on first use (importing sympy takes a second or two) and are replaced when killed. Verdicts
    of short pairs are cached; timeouts and crashes never are (see the module docstring).
    """

    def __init__(
        self,
        *,
        time_limit: float = 2.0,
        workers: int = 1,
        cache_size: int = 4096,
        start_timeout: float = 60.0,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        if time_limit <= 0 or workers < 1 or cache_size < 0:
            raise ValueError("time_limit must be > 0, workers >= 1, cache_size >= 0")
        self.time_limit = time_limit
        self.start_timeout = start_timeout
        self.on_timeout = on_timeout
        self.timeouts = 0
        # FIFO: a successor still booting after a kill waits its turn behind a ready child.
        self._slots = _FairSlots(workers)
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, prediction: str, gold: str, deadline: float | None = None) -> bool:
        """Whether ``prediction`` equals ``gold``; ``deadline`` is a ``time.monotonic()`` time."""
        return self.check(prediction, gold, deadline)[0]

    def bounded(self, deadline: float | None) -> RequestJudge:
        """This judge for one request, with ``deadline`` fixed: what
        :func:`~reward_server.core.prepare_batch` takes. A pair that timed out is not checked
        again within the request (128 copies of one slow answer cost ``time_limit`` once), but
        the next request checks it afresh."""
        return RequestJudge(self, deadline)

    def close(self) -> None:
        """Stop the children (idle ones now; busy ones when their check returns)."""
        self._closed = True
        while True:
            try:
                child = self._slots.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()

    # -- internals ------------------------------------------------------------------------------

    def check(self, prediction: str, gold: str, deadline: float | None = None) -> tuple[bool, bool]:
        """``(verdict, reached)``: like calling the judge, also saying whether the verdict was
        reached (False: the check timed out or crashed and counts as not equivalent)."""
        key = (prediction, gold)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key], True
        limit, by_deadline = self.time_limit, False
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MathDeadlineExceeded("request deadline passed while checking math answers")
            limit, by_deadline = min(limit, remaining), remaining < limit
        verdict, reached = self._check(prediction, gold, limit, by_deadline, deadline)
        if reached:  # a timeout or crash is not a verdict: never remembered
            self._remember(key, verdict)
        return verdict, reached

    def _check(
        self, prediction: str, gold: str, limit: float, by_deadline: bool, deadline: float | None
    ) -> tuple[bool, bool]:
        """``(verdict, reached)``: ``reached`` is False for a timeout or crash."""
        check = _Check(prediction, gold, limit, by_deadline, deadline, self._take_child(deadline))
        try:
            if self._closed:
                raise RuntimeError("the math checker is closed")
            verdict = self._first_verdict(check)
            if verdict is not None:
                return verdict, True
            self._replace_child(check)
        finally:
            self._return_child(check)
        return self._unreached(check)

    def _take_child(self, deadline: float | None) -> _Child | None:
        """A free child (None: start one), waiting at most until ``deadline``."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return self._slots.get(timeout=wait)
        except queue.Empty:
            raise MathDeadlineExceeded(
                "request deadline passed waiting for the math checker"
            ) from None

    def _first_verdict(self, check: _Check) -> bool | None:
        """The verdict, from a second try in a fresh child when the first child died or was
        starved of CPU; ``None`` when the check ran out of time or killed its process twice."""
        for retry in (False, True):
            try:
                verdict = self._ask(check, retry)
            except _ChildDied as exc:
                # Killed mid-check: by the check itself (memory), or because the thread that
                # started it ended (PR_SET_PDEATHSIG follows the thread). A fresh child tells the
                # two apart; a second death is the check's doing. Two children that die before
                # their hello: no child can start here.
                self._drop_child(check)
                if retry and isinstance(exc, _DiedStarting):
                    raise MathCheckerUnavailable(f"cannot check math answers: {exc}") from None
                check.why = "crashed its process twice"
                continue
            if verdict is not None:
                return verdict
            if retry or check.by_deadline or not self._starved(check):
                return None
            # Not the check's doing (paused, or no CPU to run on): a fresh child.
            log.warning("math check starved of CPU: retrying it in a fresh child")
            self._drop_child(check)
        return None

    def _ask(self, check: _Check, retry: bool) -> bool | None:
        """One try: the child's verdict, or ``None`` when it gave none within the limit."""
        if check.child is None or not check.child.alive():
            check.child = _Child()
        child = check.child.started(self.start_timeout)
        if retry and check.deadline is not None:  # a retry has what is left
            remaining = max(0.0, check.deadline - time.monotonic())
            if remaining < check.limit:
                check.limit, check.by_deadline = remaining, True
        check.cpu_before = child.cpu_seconds()
        child.send(check.prediction, check.gold)
        reply = child.read(check.limit)
        if reply is None:
            check.why = f"exceeded {check.limit:.1f} s"
            return None
        if "error" in reply:
            raise RuntimeError(f"math check failed: {reply['error']}")
        return bool(reply["equivalent"])

    @staticmethod
    def _starved(check: _Check) -> bool:
        """Whether the child ran less than half of the limit: it was kept off the CPU."""
        assert check.child is not None
        after = check.child.cpu_seconds()
        return (
            check.cpu_before is not None
            and after is not None
            and after - check.cpu_before < 0.5 * check.limit
        )

    @staticmethod
    def _drop_child(check: _Check) -> None:
        if check.child is not None:
            check.child.kill()
        check.child = None

    def _replace_child(self, check: _Check) -> None:
        """After a failed check: its child is killed and a successor boots meanwhile."""
        self._drop_child(check)
        check.child = None if self._closed else _Child()

    def _return_child(self, check: _Check) -> None:
        if self._closed:
            self._drop_child(check)
        self._slots.put(check.child)

    def _unreached(self, check: _Check) -> tuple[bool, bool]:
        """A check that reached no verdict: a deadline error, or *not equivalent* (counted)."""
        if check.by_deadline:
            raise MathDeadlineExceeded("request deadline passed while checking math answers")
        self.timeouts += 1
        if self.on_timeout is not None:
            self.on_timeout()
        log.warning(
            "math check of %r against %r %s: counted as not equivalent",
            _preview(check.prediction),
            _preview(check.gold),
            check.why,
        )
        return False, False

    def _remember(self, key: tuple[str, str], verdict: bool) -> None:
        if self._cache_size == 0 or len(key[0]) + len(key[1]) > _CACHEABLE_CHARS:
            return
        with self._lock:
            self._cache[key] = verdict
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)


class MathChecksCancelled(Exception):
    """The request's checks were cancelled (:meth:`RequestJudge.cancel`): its caller left."""


class RequestJudge:
    """One request's view of the judge (see :meth:`IsolatedMathJudge.bounded`)."""

    def __init__(self, judge: IsolatedMathJudge, deadline: float | None) -> None:
        self.judge = judge
        self.deadline = deadline
        self.timed_out: set[tuple[str, str]] = set()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Start no further check for this request (one running ends within its limit):
        :class:`MathChecksCancelled` from the next call on."""
        self._cancelled.set()

    def __call__(self, prediction: str, gold: str) -> bool:
        if self._cancelled.is_set():
            raise MathChecksCancelled("the request's math checks were cancelled")
        key = (prediction, gold)
        if key in self.timed_out:
            return False
        verdict, reached = self.judge.check(prediction, gold, self.deadline)
        if not reached:
            self.timed_out.add(key)
        return verdict


def _preview(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _reply_channel() -> IO[str]:
    """The pipe to the parent, taken off fd 1 so that anything the libraries print goes to
    stderr instead of into the protocol."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


if __name__ == "__main__":  # the child process of :class:`IsolatedMathJudge`
    die_with_parent(int(sys.argv[1]))
    serve_checks(sys.stdin, _reply_channel())
