"""Retry policy of the reward client: what is retried, and how long to wait before the next try.

Scoring is a pure function of the request, so repeating a request is always safe; the only
question is whether a failure is *transient*. Connection errors, timeouts, an undecodable body,
408 (the body did not arrive in time: the network, not the request), 429 (the server shed load),
500 (the server's encoder failed: never bad input, and another replica or a moment later may
succeed) and 502/503/504 (restarting, not ready, or a proxy in between) are transient; any other
4xx is an answer about the request itself and is raised at once (a batch refused for its size
alone is split by the client instead, see :attr:`Attempt.too_large`). A trainer must never proceed
on invented rewards, so when the retries run out the caller gets :class:`RewardServiceError`
naming every attempt, never a default value.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from dataclasses import dataclass, field, fields
from typing import Any

#: HTTP statuses worth another try (see the module docstring).
RETRYABLE_STATUSES: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Attempt:
    """One failed try, kept for the final error message."""

    url: str
    status: int | None
    error: str
    #: The server refused the batch for its size alone (items, estimated encoder tokens or
    #: body bytes over its limits): smaller requests with the same items may pass.
    too_large: bool = False
    #: A 422's issues (``loc``, ``field``, ``msg``, ``type``), item indexes counted in the
    #: caller's batch (a split batch's pieces count from 0 each on the wire).
    issues: tuple[dict[str, Any], ...] = ()

    def __str__(self) -> str:
        what = f"HTTP {self.status}" if self.status is not None else "no response"
        return f"{self.url}: {what} ({self.error})"


#: An error's message lists this many attempts at each end (``attempts`` keeps them all).
_LISTED_ENDS = 3


class RewardServiceError(RuntimeError):
    """The reward service could not score a batch; no reward was produced.

    ``attempts`` lists every failed try (URL, status, error); ``status`` is the last HTTP status
    seen (``None`` when the server never answered).
    """

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        self.attempts = list(attempts)
        self.status = next((a.status for a in reversed(self.attempts) if a.status), None)
        numbered = [f"#{i + 1} {a}" for i, a in enumerate(self.attempts)]
        if len(numbered) > 2 * _LISTED_ENDS + 1:  # retrying to a deadline makes thousands
            left_out = len(numbered) - 2 * _LISTED_ENDS
            numbered[_LISTED_ENDS:-_LISTED_ENDS] = [f"({left_out} more)"]
        super().__init__(f"{message} after {len(self.attempts)} attempt(s): {'; '.join(numbered)}")


class RewardRequestError(RewardServiceError):
    """The server rejected the request itself (e.g. 422): repeating it cannot help."""


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


#: Seconds a trainer's reward call keeps retrying by default (``sde2-train --reward-deadline``,
#: the verl and OpenRLHF hooks): a replica's restart or a load-shedding server's backlog fits
#: (a 2,048-sample verl step on a 2-core server was refused with 429 for 60-80 s, past a fixed
#: six tries), and a server that stays down stops the training after it.
TRAINER_DEADLINE = 600.0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, bounded by attempts and by total time.

    The ``k``-th retry waits ``d/2 + U(0, d/2)`` with ``d = min(backoff_max, backoff_base·2^k)``
    ("equal jitter": replicas restarted together are not hit by every trainer rank at the same
    instant, yet the wait never collapses to zero). A ``Retry-After`` from the server lengthens the
    wait when it asks for more than the backoff (it knows its queue), capped at
    ``retry_after_max`` and stretched by up to ``retry_after_jitter`` of itself for the same herd
    reason; it never shortens it.
    """

    #: Tries per request; None: as many as :attr:`deadline` allows (which must then be set).
    max_attempts: int | None = 6
    backoff_base: float = 0.5
    backoff_max: float = 20.0
    retry_after_max: float = 60.0
    retry_after_jitter: float = 0.1
    #: Give up once this much time has passed since the first try (None: attempts only).
    deadline: float | None = None
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its generator: each process of a trainer unpickles the policy it was
        handed (spawned ranks, Ray workers), and copies of one generator would draw the same
        jitter in every one of them, the herd the jitter is there to break up. (``copy`` and
        ``deepcopy`` go this way too; ``dataclasses.replace`` keeps the generator.)"""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rng"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """An unpickled policy draws from a generator of its own, seeded afresh."""
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "rng", random.Random())

    def __post_init__(self) -> None:
        if self.max_attempts is None and self.deadline is None:
            raise ValueError("max_attempts=None needs a deadline (else retries never end)")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        durations = {
            "backoff_base": self.backoff_base,
            "backoff_max": self.backoff_max,
            "retry_after_max": self.retry_after_max,
            "retry_after_jitter": self.retry_after_jitter,
        }
        if self.deadline is not None:
            durations["deadline"] = self.deadline
        for name, value in durations.items():  # NaN or a negative wait would reach time.sleep
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def allows(self, attempts: int) -> bool:
        """Whether another try may follow ``attempts`` tries (the deadline aside)."""
        return self.max_attempts is None or attempts < self.max_attempts

    def delay(self, retry_index: int, retry_after: float | None = None) -> float:
        """Seconds to sleep before retry number ``retry_index`` (0 for the first retry): the
        larger of the backoff and the server's ``Retry-After``. The header may lengthen the
        wait, never shorten it: ``Retry-After: 0`` (or a date gone by) from an overloaded proxy
        took the backoff away, and a client retried thousands of times a second.

        >>> p = RetryPolicy(backoff_base=1.0, retry_after_jitter=0.0)
        >>> 0.5 <= p.delay(0, retry_after=0.0) <= 1.0, p.delay(0, retry_after=7.0)
        (True, 7.0)
        """
        backoff = self.backoff(retry_index)
        return backoff if retry_after is None else max(backoff, self.held(retry_after))

    def backoff(self, retry_index: int) -> float:
        """The policy's own wait before retry number ``retry_index``: ``d/2 + U(0, d/2)``.

        >>> p = RetryPolicy(backoff_base=0.5, backoff_max=20.0)
        >>> 0.25 <= p.backoff(0) <= 0.5, 10.0 <= p.backoff(5000) <= 20.0
        (True, True)
        """
        # The exponent is capped: retrying to a deadline reaches indexes where 2.0**k overflows.
        d = min(self.backoff_max, self.backoff_base * (2.0 ** min(retry_index, 64)))
        return d / 2.0 + self.rng.uniform(0.0, d / 2.0)

    def held(self, retry_after: float) -> float:
        """The wait a ``Retry-After`` of ``retry_after`` seconds asks for: capped at
        :attr:`retry_after_max`, stretched by up to :attr:`retry_after_jitter` of itself.

        >>> RetryPolicy(retry_after_max=60.0, retry_after_jitter=0.0).held(3600.0)
        60.0
        """
        base = min(retry_after, self.retry_after_max)
        return base + self.rng.uniform(0.0, self.retry_after_jitter * base)


#: A reward server checked before a command loads its model (``sde2-train``, ``sde2-eval``): a
#: few tries, so that a wrong URL stops the command in seconds (the commands' own deadlines are
#: for servers that go away during the work).
PROBE_RETRY = RetryPolicy(max_attempts=3)
