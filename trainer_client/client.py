"""HTTP clients of the SD-E² reward service (SPEC §6, ``POST /v1/score``).

:class:`RewardClient` (blocking) and :class:`AsyncRewardClient` (asyncio) share everything but the
I/O: request building, sharding across replicas and merging (:mod:`trainer_client.sharding`),
the retry policy (:mod:`trainer_client.retry`), reading the answers
(:mod:`trainer_client.responses`) and each answer's due time
(:mod:`trainer_client.answer_deadline`). Both keep one pooled ``httpx`` client so a trainer
reuses connections across steps instead of paying a TCP handshake per batch.

Failure semantics: transient failures are retried with backoff (and on the next replica, when
there are several — scoring is idempotent); when the retries run out
:class:`~trainer_client.retry.RewardServiceError` is raised. No method ever returns a reward the
server did not compute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from reward_server.core.params import RewardParams
from reward_server.field_names import not_utf8, shown_path, unencodable
from trainer_client.answer_deadline import DUE_EXTENSION, AnswerDue, due_by_time
from trainer_client.responses import (
    WARNING_HEADER,
    answer_reader,
    check_response,
    shifted_warnings,
)
from trainer_client.results import ScoreResult, warning_kind
from trainer_client.retry import (
    PROBE_RETRY,
    Attempt,
    RetryPolicy,
    RewardRequestError,
    RewardServiceError,
    parse_retry_after,
)
from trainer_client.sharding import (
    ItemLike,
    check_groups,
    distinct_encoders,
    halve,
    item_to_json,
    merge,
    mixed_encoders,
    params_to_json,
    split,
)

log = logging.getLogger(__name__)

SCORE_PATH = "/v1/score"
_JSON = {"content-type": "application/json"}
DEFAULT_TIMEOUT = 180.0  # seconds; a large step on a CPU server can take a while (OpenRLHF: 180)


#: Seconds ``ready()`` waits for a replica's answer.
READY_TIMEOUT = 5.0


def check_timeout(seconds: float, name: str = "timeout") -> None:
    """Refuse a request timeout that no request could meet (``ValueError`` naming ``name``).

    >>> check_timeout(0.0, "--reward-timeout")
    Traceback (most recent call last):
    ...
    ValueError: --reward-timeout must be a number of seconds > 0, got 0.0
    """
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, got {seconds}")


class ItemError(ValueError):
    """A value of one item that cannot be sent: :attr:`item` is its index in the caller's
    batch, :attr:`field` the item's field (``sde2-eval`` names the file and line from them)."""

    def __init__(self, item: int, field: str, reason: str) -> None:
        super().__init__(f"items.{item}.{field}: {reason}")
        self.item, self.field, self.reason = item, field, reason


def encode_body(body: Any, first: int = 0) -> bytes | None:
    """``body`` as the JSON httpx would send (``None``: no body), encoded once for every try.

    A string that is not valid UTF-8 (a lone surrogate, as a broken tokenizer's decoding can
    leave) made httpx raise a bare ``UnicodeEncodeError`` naming nothing; it is a
    ``ValueError`` naming the field that holds it instead (an :class:`ItemError` within an
    item, counted from ``first``: the index of the body's first item in the caller's batch, a
    split batch's pieces each counting from 0 on the wire), and nothing is sent.

    >>> encode_body({"items": [{"completion": "a", "answer": 1}]})
    b'{"items":[{"completion":"a","answer":1}]}'
    >>> encode_body({"items": [{"completion": "ok"}, {"completion": "x\\ud800"}]}, first=256)
    Traceback (most recent call last):
    ...
    trainer_client.client.ItemError: items.257.completion: not valid UTF-8 at character 1: ...
    """
    if body is None:
        return None
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        path, at = unencodable(body) or ((), 0)
        reason = f"{not_utf8(at)}; not sent"
        if len(path) > 2 and path[0] == "items" and isinstance(path[1], int):
            raise ItemError(first + path[1], shown_path(path[2:]), reason) from None
        raise ValueError(f"{shown_path(path)}: {reason}") from None


def normalize_urls(urls: str | Sequence[str]) -> list[str]:
    """One or several base URLs (``http://host:port``), without trailing slashes."""
    listed = [urls] if isinstance(urls, str) else list(urls)
    # A comma-separated string is accepted too: environment variables carry one string.
    flat = [u.strip().rstrip("/") for entry in listed for u in entry.split(",") if u.strip()]
    if not flat:
        raise ValueError("at least one reward server URL is required")
    for u in flat:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"reward server URL must start with http:// or https://: {u!r}")
    return flat


@dataclass(frozen=True)
class _Plan:
    """One ``score`` call: the request bodies per shard and how to put the answers together."""

    #: (preferred replica, index of the body's first item in the batch, request body)
    shards: list[tuple[int, int, dict[str, Any]]]
    sharded: bool
    normalize: bool
    groups: list[str] | None

    @classmethod
    def build(
        cls,
        n_replicas: int,
        items: Sequence[ItemLike],
        *,
        max_items: int,
        recipe: str,
        answer_type: str,
        params: RewardParams | Mapping[str, Any] | None,
        normalize: bool,
        diagnostics: bool,
        first: int = 0,
    ) -> _Plan:
        """The plan; shard ``i`` goes first to replica ``first + i`` (modulo the replicas): a
        caller turning ``first`` spreads one-shard batches (one sample each, as verl's and
        OpenRLHF's hooks send) over every replica."""
        wire = [item_to_json(it, i) for i, it in enumerate(items)]
        if not wire:
            raise ValueError("nothing to score: items is empty")
        groups = check_groups(wire)
        common: dict[str, Any] = {"recipe": recipe, "answer_type": answer_type}
        p = params_to_json(params)
        if p:
            common["params"] = p
        if diagnostics:
            common["diagnostics"] = True
        # One shard per replica, more when a shard would exceed the server's item limit (the
        # client-side merge makes the split invisible in the numbers either way).
        n_shards = max(n_replicas, -(-len(wire) // max_items))
        ranges = split(len(wire), n_shards)
        if len(ranges) == 1:
            body = {"items": wire, **common, "normalize": normalize}
            return cls([(first % n_replicas, 0, body)], False, normalize, groups)
        shards = [
            (
                (first + i) % n_replicas,
                r.start,
                {"items": wire[r.start : r.stop], **common, "normalize": False},
            )
            for i, r in enumerate(ranges)
        ]
        return cls(shards, True, normalize, groups)

    def finish(self, results: list[list[ScoreResult]]) -> ScoreResult:
        """One result from each shard's pieces (more than one where a server refused a shard
        for its size and its halves were scored instead), in batch order."""
        pieces = [piece for shard in results for piece in shard]
        if not self.sharded and len(pieces) == 1:
            return pieces[0]  # the server normalized the whole batch itself
        return merge(pieces, normalize=self.normalize, groups=self.groups)


#: Kinds of warning a client logs at most (each once).
_MAX_WARNED = 1000


class _Attempts:
    """One request's retry loop without its I/O, shared by the blocking and asyncio clients:
    which URL to try next (each retry moves to the next replica), what failed, how long to
    wait, and when to give up with an error that lists every attempt."""

    def __init__(
        self,
        client: _Base,
        method: str,
        path: str,
        replica: int,
        what: str,
        policy: RetryPolicy | None = None,
        first: int = 0,
        started: float | None = None,
    ) -> None:
        """``started``: when the request's batch was first tried (``time.monotonic``), for the
        halves of a batch refused for its size: the policy's deadline counts from the batch's
        first try, not from each half's (halves went on for a whole deadline each)."""
        self.client, self.path, self.replica = client, path, replica
        #: The answer's warnings (:data:`WARNING_HEADER`), items named in the caller's batch.
        self.warnings: list[str] = []
        #: The index of the request's first item in the caller's batch (errors name items so).
        self.first = first
        self.policy = policy or client.retry
        self.what = what or f"{method} {path}"
        self.failures: list[Attempt] = []
        self.started = time.monotonic() if started is None else started
        self.number = 0
        self.data: Any = None
        #: The base URL of the replica that answered (once :meth:`succeeded`).
        self.answered_by = ""
        self._retryable = True
        #: Each replica whose latest answer carried ``Retry-After``: when it answered (monotonic)
        #: and the wait it asked for. The wait holds for that replica only: a retry going to
        #: another (idle) one waits only the backoff.
        self._held: dict[str, tuple[float, float]] = {}

    def url(self) -> str:
        """Where the current attempt goes."""
        return self.client._url(self.replica, self.number) + self.path

    def timeout(self) -> httpx.Timeout:
        """The current attempt's timeout: the client's, cut to what the policy's deadline
        leaves (a try begun just before the deadline ran the whole request timeout past it:
        8 s against a deadline of 2)."""
        configured = self.client._timeout
        deadline = self.policy.deadline
        if deadline is None:
            return configured
        left = max(0.001, deadline - (time.monotonic() - self.started))
        read = configured.read if configured.read is not None else left
        connect = configured.connect if configured.connect is not None else left
        return httpx.Timeout(min(read, left), connect=min(connect, left))

    def request(
        self, http: httpx.Client | httpx.AsyncClient, method: str, url: str, content: bytes | None
    ) -> httpx.Request:
        """The current attempt's request to ``url``: JSON, with :meth:`timeout`, its whole
        answer due that long after it is sent (:class:`AnswerDue`; both clients build it alike)."""
        timeout = self.timeout()
        due = AnswerDue(math.inf if timeout.read is None else timeout.read)
        tracer = due.atrace if isinstance(http, httpx.AsyncClient) else due.trace
        return http.build_request(
            method,
            url,
            content=content,
            headers=_JSON,
            timeout=timeout,
            extensions={DUE_EXTENSION: due, "trace": tracer},
        )

    def succeeded(self, url: str, outcome: httpx.Response | httpx.RequestError) -> bool:
        """Record the attempt's outcome; True when :attr:`data` holds the decoded answer.

        A :class:`httpx.RequestError` is no answer: the connection failed or timed out, or the
        body could not be decoded (a corrupt compressed body from a proxy), all transient."""
        self._held.pop(url, None)  # only the replica's latest answer counts
        if isinstance(outcome, httpx.RequestError):
            failure = Attempt(url, None, f"{type(outcome).__name__}: {outcome}")
            retryable = True
        else:
            self.data, maybe_failure, retryable = check_response(url, outcome, self.first)
            if maybe_failure is None:
                self.answered_by = url.removesuffix(self.path)
                self.warnings = shifted_warnings(
                    outcome.headers.get_list(WARNING_HEADER), self.first
                )
                return True
            failure = maybe_failure
            retry_after = parse_retry_after(outcome.headers.get("retry-after"))
            if retry_after is not None:
                self._held[url] = (time.monotonic(), self.policy.delay(self.number, retry_after))
        return self._failed(failure, retryable)

    def _failed(self, failure: Attempt, retryable: bool) -> bool:
        """Record a failed try (False, what :meth:`succeeded` and :meth:`read` then answer)."""
        self.failures.append(failure)
        self.client.failed_attempts += 1
        self._retryable = retryable
        return False

    def read(self, url: str, reader: Callable[[Any, str], Any] | None) -> bool:
        """Read the answer :meth:`succeeded` decoded with ``reader`` (into :attr:`data`); False,
        the try failed (retryable), when ``reader`` finds it is not the answer expected."""
        if reader is None:
            return True
        try:
            self.data = reader(self.data, self.answered_by)
        except ValueError as exc:
            return self._failed(Attempt(url, 200, str(exc)), retryable=True)
        return True

    def check_stop(self, stop: threading.Event | None) -> None:
        """Give up (:class:`RewardServiceError`) when ``stop`` is set: the batch this request
        belongs to has already failed, so further tries would only load the servers."""
        if stop is not None and stop.is_set():
            raise RewardServiceError(
                f"stopped trying to {self.what}: another part of the batch failed", self.failures
            )

    def _wait_for(self, url: str, retry_index: int) -> float:
        """The wait before trying ``url``: the backoff, or what it asked for with
        ``Retry-After`` when longer (less the time gone since, when other replicas were tried
        in between: never less than the backoff, though)."""
        if url not in self._held:
            return self.policy.delay(retry_index)
        answered, asked = self._held[url]
        if url == self.failures[-1].url:
            return asked  # already the larger of the two (RetryPolicy.delay)
        return max(self.policy.delay(retry_index), answered + asked - time.monotonic())

    def next_wait(self) -> float:
        """Seconds to wait before the next attempt; raises the give-up error when there is none
        (not retryable, attempts used up, or the policy's deadline would pass)."""
        policy = self.policy
        attempt, self.number = self.number, self.number + 1
        if self._retryable and policy.allows(self.number):
            wait = self._wait_for(self.url(), attempt)
            deadline = policy.deadline
            if deadline is None or time.monotonic() - self.started + wait <= deadline:
                log.warning(
                    "%s: try %d failed (%s); next try in %.1f s",
                    self.what,
                    self.number,
                    self.failures[-1],
                    wait,
                )
                return wait
        status = self.failures[-1].status
        if not self._retryable and status == 401:
            url = self.failures[-1].url.removesuffix(self.path)
            raise RewardRequestError(
                f"reward service refused to {self.what}: {key_problem(url, self.client.has_key)}",
                self.failures,
            )
        if not self._retryable and status is not None and 400 <= status < 500:
            raise RewardRequestError(
                f"reward service rejected the request to {self.what}", self.failures
            )
        raise RewardServiceError(f"reward service failed to {self.what}", self.failures)


def _halves_or_raise(
    exc: RewardRequestError, body: Mapping[str, Any], first: int
) -> list[tuple[int, dict[str, Any]]]:
    """The two requests to send instead of ``body`` (whose first item is the batch's item
    ``first``), each with its own first item's index, when the server refused it for its size
    alone (and it holds more than one item); else ``exc`` itself is raised."""
    halves = halve(body) if exc.attempts[-1].too_large else None
    if halves is None:
        raise exc
    return [(first, halves[0]), (first + len(halves[0]["items"]), halves[1])]


def _scoring(body: Mapping[str, Any]) -> str:
    """What a score request does, for error messages."""
    return f"score {len(body['items'])} items"


class _Base:
    """Configuration shared by the blocking and the asyncio client."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        max_connections: int = 32,
        max_items_per_request: int = 1024,
    ) -> None:
        if max_items_per_request < 1:
            raise ValueError("max_items_per_request must be >= 1")
        self.urls = normalize_urls(urls)
        #: Larger batches are split into several requests (the server's default ``max_items``).
        self.max_items_per_request = max_items_per_request
        self.retry = retry or RetryPolicy()
        #: Failed attempts so far (retried or not): a cheap health signal for logs and tests.
        self.failed_attempts = 0
        check_timeout(timeout)
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._headers = {"accept": "application/json"}
        if api_key is None:  # the same variable the server reads its key from
            api_key = os.environ.get("SDE2_API_KEY") or None
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._turns = 0
        self._turns_lock = threading.Lock()
        #: Whether the server's warnings are logged as answers come (each kind once); off for a
        #: caller that reports them itself: sde2-eval names each run file's line, and the TRL
        #: adapter logs each step's (over several processes, named in the merged step).
        self.logs_warnings = True
        self._warned: set[str] = set()

    def _told(self, result: ScoreResult) -> ScoreResult:
        """``result``, its warnings logged (:meth:`_tell`)."""
        self._tell(result.warnings)
        return result

    def _tell(self, warnings: Sequence[str]) -> None:
        """:meth:`log_warnings` of an answer's ``warnings``, unless :attr:`logs_warnings` is off."""
        if self.logs_warnings:
            self.log_warnings(warnings)

    def log_warnings(self, warnings: Sequence[str]) -> None:
        """Log the server's ``warnings``, each kind once by this client (a training run with a
        wrong answer column would log one a step otherwise)."""
        for warning in warnings:
            kind = warning_kind(warning)
            if kind not in self._warned and len(self._warned) < _MAX_WARNED:
                self._warned.add(kind)
                log.warning("the reward service warns: %s", warning)

    @property
    def has_key(self) -> bool:
        """Whether requests carry a bearer key (given, or from ``SDE2_API_KEY``)."""
        return "authorization" in self._headers

    def next_replica(self) -> int:
        """The replica the next batch goes to first, in turn (thread-safe): every request of a
        hook sending one sample at a time went to the first URL, the others idle but for
        failover."""
        with self._turns_lock:
            turn, self._turns = self._turns, self._turns + 1
        return turn % len(self.urls)

    def _url(self, replica: int, attempt: int) -> str:
        # Each retry moves to the next replica: a dead replica costs one attempt, not all.
        return self.urls[(replica + attempt) % len(self.urls)]


class RewardClient(_Base):
    """Blocking client; thread-safe (one pooled ``httpx.Client``).

    Usage (needs running servers)::

        with RewardClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"]) as rc:
            result = rc.score([{"completion": text, "answer": "18"}], recipe="sde2")
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        max_connections: int = 32,
        max_items_per_request: int = 1024,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            urls,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retry=retry,
            api_key=api_key,
            max_connections=max_connections,
            max_items_per_request=max_items_per_request,
        )
        self._sleep = sleep
        self._http = httpx.Client(
            timeout=self._timeout,
            limits=self._limits,
            headers=self._headers,
            transport=transport,
            event_hooks={"response": [due_by_time]},
        )

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        replica: int = 0,
        what: str = "",
        retry: RetryPolicy | None = None,
    ) -> Any:
        """One JSON request with retries and replica failover; returns the decoded body (the
        server's warnings logged: OpenRLHF's /get_reward names a label no answer matches).
        ``retry`` replaces the client's policy for this request."""
        done = self._exchange(method, path, body, replica=replica, what=what, retry=retry)
        self._tell(done.warnings)
        return done.data

    def _exchange(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        replica: int = 0,
        what: str = "",
        retry: RetryPolicy | None = None,
        stop: threading.Event | None = None,
        reader: Callable[[Any, str], Any] | None = None,
        first: int = 0,
        started: float | None = None,
    ) -> _Attempts:
        """:meth:`request`'s loop, returning its record (the answer, read by ``reader`` when
        given, and who gave it); gives up before its next try once ``stop`` is set (another
        shard of the batch failed). ``first``: the index in the caller's batch of the body's
        first item, which errors name items by; ``started``: as for :class:`_Attempts`."""
        attempts = _Attempts(self, method, path, replica, what, retry, first, started)
        content = encode_body(body, first)
        while True:
            attempts.check_stop(stop)
            url = attempts.url()
            outcome: httpx.Response | httpx.RequestError
            try:
                outcome = self._http.send(attempts.request(self._http, method, url, content))
            except httpx.RequestError as exc:
                outcome = exc
            if attempts.succeeded(url, outcome) and attempts.read(url, reader):
                return attempts
            # Before the retry is logged: a try the batch's failure cut short (the caller has
            # its error, and may have closed the client under this try) is no retry to tell.
            attempts.check_stop(stop)
            self._sleep(attempts.next_wait())

    def score(
        self,
        items: Sequence[ItemLike],
        *,
        recipe: str = "sde2",
        answer_type: str = "numeric",
        params: RewardParams | Mapping[str, Any] | None = None,
        normalize: bool = True,
        diagnostics: bool = False,
    ) -> ScoreResult:
        """Score a batch (SPEC §6). With several URLs the batch is split across them and
        normalized here over the whole batch, giving the numbers one server would. A shard a
        server refuses for its size is scored in halves; when one shard fails for good, the
        others stop at their next try and its error is raised at once."""
        plan = _Plan.build(
            len(self.urls),
            items,
            max_items=self.max_items_per_request,
            recipe=recipe,
            answer_type=answer_type,
            params=params,
            normalize=normalize,
            diagnostics=diagnostics,
            first=self.next_replica(),
        )
        stop = threading.Event()

        def one(
            shard: tuple[int, int, dict[str, Any]], started: float | None = None
        ) -> list[ScoreResult]:
            replica, first, body = shard
            started = time.monotonic() if started is None else started
            try:
                done = self._exchange(
                    "POST", SCORE_PATH, body, replica=replica, what=_scoring(body), stop=stop,
                    reader=answer_reader(body, first), first=first, started=started,
                )  # fmt: skip
            except RewardRequestError as exc:
                halves = _halves_or_raise(exc, body, first)
                return [piece for at, half in halves for piece in one((replica, at, half), started)]
            return [dataclasses.replace(done.data, warnings=done.warnings)]

        if len(plan.shards) == 1:
            return self._told(plan.finish([one(plan.shards[0])]))
        results: list[list[ScoreResult]] = [[] for _ in plan.shards]
        finished: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

        def run(k: int) -> None:
            try:
                results[k] = one(plan.shards[k])
            except BaseException as exc:  # handed to the caller's thread
                finished.put(exc)
            else:
                finished.put(None)

        # Daemon threads: a caller stopped (Ctrl-C) leaves at once, where a pool's threads held
        # the process until their request's timeout ran out, still logging retries.
        for k in range(len(plan.shards)):
            threading.Thread(target=run, args=(k,), name="sde2-shard", daemon=True).start()
        try:
            for _ in plan.shards:
                failure = finished.get()
                if failure is not None:
                    raise failure
            return self._told(plan.finish(results))
        finally:
            stop.set()  # the other shards stop at their next try

    def info(self, replica: int = 0, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """``GET /v1/info`` of one replica (encoder, limits, defaults)."""
        return dict(self.request("GET", "/v1/info", replica=replica, what="get info", retry=retry))

    def ready(self) -> bool:
        """Whether every replica answers ``GET /readyz`` with 200 right now (no retries, at most
        :data:`READY_TIMEOUT` seconds a replica: a wedged one is not ready, not a wait of the
        request timeout)."""
        for url in self.urls:
            try:
                if self._http.get(url + "/readyz", timeout=READY_TIMEOUT).status_code != 200:
                    return False
            except httpx.TransportError:
                return False
        return True


class AsyncRewardClient(_Base):
    """asyncio client (one pooled ``httpx.AsyncClient``); shards are scored concurrently.

    An ``httpx.AsyncClient`` belongs to the event loop it first ran on: create and use one
    instance per loop (the TRL adapter does this for you).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        max_connections: int = 32,
        max_items_per_request: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(
            urls,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retry=retry,
            api_key=api_key,
            max_connections=max_connections,
            max_items_per_request=max_items_per_request,
        )
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            timeout=self._timeout,
            limits=self._limits,
            headers=self._headers,
            transport=transport,
        )

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        replica: int = 0,
        what: str = "",
        retry: RetryPolicy | None = None,
    ) -> Any:
        """One JSON request with retries and replica failover; returns the decoded body (the
        server's warnings logged). ``retry`` replaces the client's policy for this request."""
        done = await self._exchange(method, path, body, replica=replica, what=what, retry=retry)
        self._tell(done.warnings)
        return done.data

    async def _exchange(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        replica: int = 0,
        what: str = "",
        retry: RetryPolicy | None = None,
        reader: Callable[[Any, str], Any] | None = None,
        first: int = 0,
        started: float | None = None,
    ) -> _Attempts:
        """:meth:`request`'s loop, returning its record (the answer, read by ``reader`` when
        given, and who gave it); ``first`` and ``started`` as for
        :meth:`RewardClient._exchange`."""
        attempts = _Attempts(self, method, path, replica, what, retry, first, started)
        content = encode_body(body, first)
        while True:
            url = attempts.url()
            outcome: httpx.Response | httpx.RequestError
            request = attempts.request(self._http, method, url, content)
            due: AnswerDue = request.extensions[DUE_EXTENSION]
            try:
                async with asyncio.timeout(None) as due.cut:  # set when the request is sent
                    outcome = await self._http.send(request)
            except httpx.RequestError as exc:
                outcome = exc
            except TimeoutError:  # the cut (a cancellation from outside stays one)
                outcome = due.overdue(request)
            if attempts.succeeded(url, outcome) and attempts.read(url, reader):
                return attempts
            await self._sleep(attempts.next_wait())

    async def score(
        self,
        items: Sequence[ItemLike],
        *,
        recipe: str = "sde2",
        answer_type: str = "numeric",
        params: RewardParams | Mapping[str, Any] | None = None,
        normalize: bool = True,
        diagnostics: bool = False,
    ) -> ScoreResult:
        """Score a batch (SPEC §6); see :meth:`RewardClient.score` (a failed shard cancels the
        others at once)."""
        plan = _Plan.build(
            len(self.urls),
            items,
            max_items=self.max_items_per_request,
            recipe=recipe,
            answer_type=answer_type,
            params=params,
            normalize=normalize,
            diagnostics=diagnostics,
            first=self.next_replica(),
        )

        async def one(
            replica: int, first: int, body: dict[str, Any], started: float | None = None
        ) -> list[ScoreResult]:
            started = time.monotonic() if started is None else started
            try:
                done = await self._exchange(
                    "POST", SCORE_PATH, body, replica=replica, what=_scoring(body),
                    reader=answer_reader(body, first), first=first, started=started,
                )  # fmt: skip
            except RewardRequestError as exc:
                halves = _halves_or_raise(exc, body, first)
                return [
                    piece for at, half in halves for piece in await one(replica, at, half, started)
                ]
            return [dataclasses.replace(done.data, warnings=done.warnings)]

        tasks = [asyncio.ensure_future(one(*shard)) for shard in plan.shards]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception()), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            return self._told(plan.finish([t.result() for t in tasks]))
        finally:
            for task in tasks:
                task.cancel()  # a no-op for the finished ones
            await asyncio.gather(*tasks, return_exceptions=True)

    async def ready(self) -> bool:
        """:meth:`RewardClient.ready`, the replicas asked concurrently."""

        async def one(url: str) -> bool:
            try:
                answer = await self._http.get(url + "/readyz", timeout=READY_TIMEOUT)
            except httpx.TransportError:
                return False
            return answer.status_code == 200

        return all(await asyncio.gather(*map(one, self.urls)))

    async def info(self, replica: int = 0, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """``GET /v1/info`` of one replica."""
        info = await self.request("GET", "/v1/info", replica=replica, what="get info", retry=retry)
        return dict(info)


def probe_each(urls: str | Sequence[str], api_key: str | None = None) -> list[dict[str, Any]]:
    """``GET /v1/info`` of every replica on its own, as a command's start-up check: a wrong
    URL is an error in seconds. A client's request fails over to the next replica, so a dead
    second URL passed a probe of the first and surfaced only as a retry at every request.
    A replica that wants a key (``limits.api_key_required``) is sent one cheap scoring request
    with the client's key (:func:`check_key`): a missing or wrong key is an error now, not a 401
    after minutes of loading and generation. Replicas with different encoders are logged
    (:func:`~trainer_client.sharding.mixed_encoders`), before any step mixes them."""
    infos = []
    for url in normalize_urls(urls):
        # A replica that accepts and never answers is an error in seconds too.
        with RewardClient(url, api_key=api_key, retry=PROBE_RETRY, timeout=READY_TIMEOUT) as one:
            info = one.info()
            if (info.get("limits") or {}).get("api_key_required"):
                check_key(one)
            infos.append(info)
    for warning in mixed_encoders(distinct_encoders(i.get("encoder") for i in infos)):
        log.warning("the reward service warns: %s", warning)
    return infos


#: The cheapest request a key guards: one empty completion, nothing to encode.
_KEY_CHECK = {"items": [{"completion": "", "answer": "0"}], "normalize": False}


#: The key check's policy: one try (only its answer's status matters).
_ONE_TRY = RetryPolicy(max_attempts=1)


def check_key(client: RewardClient) -> None:
    """One scoring request to ``client``'s first replica with its key, tried once; a refusal
    (401) is a :class:`RewardRequestError` saying what to set: ``SDE2_API_KEY``, missing or
    wrong. Any other answer passes: the server checks the key before anything else (before its
    readiness and its queue), so a 429 from a server busy with another job, or a 503, has
    accepted the key (retried, they failed the start next to a busy server). The refusal's
    words are the request's own (:func:`key_problem`, as for any request refused so)."""
    try:
        client.request("POST", SCORE_PATH, _KEY_CHECK, what="check the API key", retry=_ONE_TRY)
    except RewardServiceError as exc:
        if isinstance(exc, RewardRequestError) and exc.status == 401:
            raise


def key_problem(url: str, has_key: bool) -> str:
    """What a 401 from ``url`` means, and what to set (a bare "HTTP 401" named neither).

    >>> key_problem("http://h:8000", False)  # doctest: +ELLIPSIS
    "http://h:8000 requires an API key (...) and this client has none: set SDE2_API_KEY ..."
    """
    problem = (
        "refused the API key this client sends"
        if has_key
        else "requires an API key (it answered 401) and this client has none"
    )
    return f"{url} {problem}: set SDE2_API_KEY to the server's key (or pass api_key=)"
