"""Trainer client: retries, backoff, Retry-After, exhaustion, failover, and sharded scoring.

Transport-level behaviour is tested with ``httpx.MockTransport`` (what a socket does is not the
point there). The mock "server" scores with the real reward core (and a deterministic encoder
double), so sharding is checked on real numbers; the last tests repeat the sharding check against
two real server processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import math
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reward_server.core import RewardParams, ScoreItem, score_batch
from tests.client_fixtures import REPO, ServerProcess, two_reward_servers  # noqa: F401 - fixture
from tests.doubles import HashEncoder
from trainer_client import (
    AsyncRewardClient,
    RetryPolicy,
    RewardClient,
    RewardRequestError,
    RewardServiceError,
    ScoreResult,
)
from trainer_client.client import encode_body
from trainer_client.retry import parse_retry_after
from trainer_client.sharding import split

A, B = "http://replica-a:8000", "http://replica-b:8000"


def completion(outcomes: list[str], final: str | None, reasons: list[str] | None = None) -> str:
    """A schema completion with one strategy per outcome."""
    reasons = reasons or [f"approach {i}: compute carefully step {i}" for i in range(len(outcomes))]
    body = "".join(
        f'<strategy id="{i + 1}"><reasoning>{r}</reasoning>'
        f"<strategy_outcome>{o}</strategy_outcome></strategy>"
        for i, (r, o) in enumerate(zip(reasons, outcomes, strict=True))
    )
    return body + (f"<final_answer>{final}</final_answer>" if final is not None else "")


def batch(n_groups: int = 3, per_group: int = 4) -> list[dict[str, Any]]:
    """A GRPO-like step: groups of completions of mixed quality, with group ids."""
    rng = random.Random(7)
    items = []
    for g in range(n_groups):
        gold = str(10 + g)
        for k in range(per_group):
            m = rng.randint(0, 4)
            outs = [str(rng.choice([gold, "3", "99"])) for _ in range(m)]
            reasons = [f"group {g} try {k} idea {j} {rng.random():.3f}" for j in range(m)]
            final = rng.choice([gold, "5", None])
            items.append(
                {
                    "completion": completion(outs, final, reasons),
                    "answer": f"#### {gold}",
                    "group": f"q{g}",
                    "num_tokens": rng.randint(10, 900),
                }
            )
    return items


def core_handler(calls: list[dict[str, Any]]) -> Callable[[httpx.Request], httpx.Response]:
    """A mock server that scores with the real core (HashEncoder) and records each body."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append({"url": str(request.url), **body})
        result = score_batch(
            [ScoreItem(**it) for it in body["items"]],
            HashEncoder(),
            recipe=body.get("recipe", "sde2"),
            answer_type=body.get("answer_type", "numeric"),
            params=RewardParams.model_validate(body.get("params", {})),
            normalize=body.get("normalize", True),
            diagnostics=body.get("diagnostics", False),
        )
        return httpx.Response(200, json={**result.as_dict(), "encoder": "hash"})

    return handle


class Scripted:
    """A transport that plays a script of responses/exceptions, then delegates to the core."""

    def __init__(self, script: list[httpx.Response | Exception]) -> None:
        self.script = list(script)
        self.urls: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._core = core_handler(self.calls)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(str(request.url))
        if self.script:
            step = self.script.pop(0)
            if isinstance(step, Exception):
                raise step
            return step
        return self._core(request)


def policy(**kw: Any) -> RetryPolicy:
    return RetryPolicy(rng=random.Random(0), **kw)


ONE = [{"completion": completion(["18"], "18"), "answer": "18"}]


def test_each_unpickled_policy_draws_its_own_jitter() -> None:
    """Trainer ranks and Ray workers unpickle the policy they were handed: each copy keeps the
    settings but draws from a generator of its own, or every rank would retry in step."""
    import pickle

    policy = RetryPolicy(backoff_base=1.0, backoff_max=1.0, rng=random.Random(0))
    blob = pickle.dumps(policy)
    copies = [pickle.loads(blob) for _ in range(2)]
    assert copies[0] == policy and copies[1] == policy  # the settings travel
    draws = [[c.backoff(0) for _ in range(8)] for c in copies]
    assert draws[0] != draws[1]
    assert all(0.5 <= d <= 1.0 for row in draws for d in row)


def test_connection_errors_are_retried_with_growing_jittered_backoff() -> None:
    refused = httpx.ConnectError("connection refused")
    transport = Scripted([refused, refused, refused])
    sleeps: list[float] = []
    rc = RewardClient(
        A,
        retry=policy(max_attempts=5, backoff_base=1.0, backoff_max=3.0),
        transport=httpx.MockTransport(transport),
        sleep=sleeps.append,
    )
    result = rc.score(ONE, normalize=False)
    assert result.rewards == pytest.approx([1.0 + 1.0 + (0.2 + 0.3 + 0.1) + 1.0])  # oc re fa sd
    assert len(transport.urls) == 4
    # equal jitter: the k-th retry waits in [d/2, d] with d = min(3, 1·2^k)
    assert [1.0 / 2 <= sleeps[0] <= 1.0, 1.0 <= sleeps[1] <= 2.0, 1.5 <= sleeps[2] <= 3.0] == [
        True
    ] * 3
    assert len(set(sleeps)) == 3  # jittered, not a fixed ladder


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_seconds_is_honoured(status: int) -> None:
    busy = httpx.Response(status, headers={"retry-after": "7"}, json={"detail": "busy"})
    transport = Scripted([busy])
    sleeps: list[float] = []
    rc = RewardClient(
        A,
        retry=policy(backoff_base=0.01),
        transport=httpx.MockTransport(transport),
        sleep=sleeps.append,
    )
    assert len(rc.score(ONE)) == 1
    assert len(sleeps) == 1 and 7.0 <= sleeps[0] <= 7.0 * 1.1


def test_retry_after_holds_for_the_replica_that_sent_it() -> None:
    """A busy replica's Retry-After does not delay a retry going to another, idle one; a retry
    coming back to the busy one waits what is left of it."""
    busy = httpx.Response(429, headers={"retry-after": "45"}, json={"detail": "busy"})

    def waits(urls: list[str], script: list[httpx.Response | Exception]) -> list[float]:
        """The client's waits scoring one item through ``script`` (replicas in ``urls`` order)."""
        transport = Scripted(script)
        sleeps: list[float] = []
        rc = RewardClient(
            urls,
            retry=policy(backoff_base=0.2, retry_after_jitter=0.0),
            transport=httpx.MockTransport(transport),
            sleep=sleeps.append,
        )
        assert len(rc.score(ONE)) == 1
        assert [u.split("/v1")[0] for u in transport.urls] == (urls * 3)[: len(script) + 1]
        return sleeps

    first = waits([A, B], [busy])
    assert len(first) == 1 and 0.1 <= first[0] <= 0.2  # the backoff of a first retry
    # A asks for 45 s, B fails at once, the third try (back on A) waits what is left of the 45 s.
    backoff, rest = waits([A, B], [busy, httpx.ConnectError("refused")])
    assert 0.1 <= backoff <= 0.2 and 44.0 <= rest <= 45.0
    # A later answer of the same replica without the header ends its hold (backoff again).
    held, backoff = waits([A], [busy, httpx.Response(500, text="failed")])
    assert held == 45.0 and 0.2 <= backoff <= 0.4


def test_retry_policy_bounds_and_long_runs() -> None:
    """Retrying to a deadline runs through thousands of tries: the backoff stays bounded (2**k
    overflowed a float at k = 1024) and the error lists the first and last attempts."""
    p = policy(max_attempts=None, deadline=1e9, backoff_base=0.5, backoff_max=20.0)
    assert 10.0 <= p.delay(5000) <= 20.0
    for bad in ({"backoff_base": float("nan")}, {"retry_after_jitter": -1.0}, {"deadline": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)
    transport = Scripted([httpx.Response(503, text=f"down {i}") for i in range(1500)])
    rc = RewardClient(
        A,
        retry=policy(max_attempts=1200, backoff_base=0.0),
        transport=httpx.MockTransport(transport),
        sleep=lambda s: None,
    )
    with pytest.raises(RewardServiceError, match="after 1200 attempt") as err:
        rc.score(ONE)
    assert len(err.value.attempts) == 1200
    message = str(err.value)
    assert "#1 " in message and "#1200 " in message and "(1194 more)" in message
    assert "#600 " not in message and len(message) < 1000


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_an_answer_for_other_items_is_refused(client: str) -> None:
    """An answer holding fewer results than items sent (a misrouting proxy) would shift every
    reward after the gap onto other completions: it is an error."""
    calls: list[dict[str, Any]] = []
    score = core_handler(calls)

    def short(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        fewer = {**body, "items": body["items"][:-1]}
        return score(httpx.Request("POST", request.url, json=fewer))

    items = batch(1, 3)
    once = RetryPolicy(max_attempts=1)
    if client == "blocking":
        with pytest.raises(RewardServiceError, match="2 results for 3"):
            RewardClient(A, transport=httpx.MockTransport(short), retry=once).score(items)
    else:

        async def run() -> None:
            transport = httpx.MockTransport(short)
            async with AsyncRewardClient(A, transport=transport, retry=once) as rc:
                await rc.score(items)

        with pytest.raises(RewardServiceError, match="2 results for 3"):
            asyncio.run(run())


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_an_answer_of_another_shape_is_a_failed_try(client: str) -> None:
    """A 200 that is not a scoring answer (another service on the port, a misrouting proxy)
    was a bare ``KeyError``, with a healthy replica beside it: now it is a failed try, and the
    next replica answers."""
    calls: list[dict[str, Any]] = []
    score = core_handler(calls)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "replica-a":
            return httpx.Response(200, json={"detail": "not a reward service"})
        return score(request)

    items, urls = batch(1, 3), [A, B]
    if client == "blocking":
        rc = RewardClient(urls, transport=httpx.MockTransport(handler), sleep=lambda s: None)
        result = rc.score(items, normalize=False)
    else:

        async def run() -> Any:
            transport = httpx.MockTransport(handler)
            async with AsyncRewardClient(urls, transport=transport, sleep=_no_wait) as arc:
                return await arc.score(items, normalize=False)

        result = asyncio.run(run())
    assert len(result) == 3 and calls
    with pytest.raises(RewardServiceError, match=r"not a scoring answer \(KeyError"):
        RewardClient(A, transport=httpx.MockTransport(handler), sleep=lambda s: None,
                     retry=RetryPolicy(max_attempts=2)).score(items)  # fmt: skip


async def _no_wait(seconds: float) -> None:
    return None


def test_retry_after_http_date_and_cap() -> None:
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(30, abs=1.0)
    assert parse_retry_after("garbage") is None and parse_retry_after(None) is None
    busy = httpx.Response(503, headers={"retry-after": "3600"})
    sleeps: list[float] = []
    rc = RewardClient(
        A,
        retry=policy(retry_after_max=5.0, retry_after_jitter=0.0),
        transport=httpx.MockTransport(Scripted([busy])),
        sleep=sleeps.append,
    )
    rc.score(ONE)
    assert sleeps == [5.0]


def test_exhausted_retries_raise_with_url_status_and_attempts() -> None:
    transport = Scripted([httpx.Response(503, text="warming up")] * 10)
    rc = RewardClient(
        A,
        retry=policy(max_attempts=3, backoff_base=0.0),
        transport=httpx.MockTransport(transport),
        sleep=lambda s: None,
    )
    with pytest.raises(RewardServiceError) as info:
        rc.score(ONE)
    err = info.value
    assert not isinstance(err, RewardRequestError)
    assert len(err.attempts) == 3 and err.status == 503
    message = str(err)
    assert f"{A}/v1/score" in message and "HTTP 503" in message and "3 attempt(s)" in message
    assert "warming up" in message
    assert len(transport.urls) == 3


def test_validation_error_is_not_retried() -> None:
    transport = Scripted([httpx.Response(422, json={"detail": "params.eps: out of range"})])
    rc = RewardClient(A, transport=httpx.MockTransport(transport), sleep=lambda s: None)
    with pytest.raises(RewardRequestError, match=r"HTTP 422.*params\.eps"):
        rc.score(ONE)
    assert len(transport.urls) == 1


def test_server_faults_are_retried_then_raised_as_service_errors() -> None:
    """500 is the server's own failure (its encoder), never the request's: retried, and when
    it persists the error is a service error, not a rejection of the request."""
    flaky = Scripted([httpx.Response(500, text="encoder failed")])
    rc = RewardClient(A, transport=httpx.MockTransport(flaky), sleep=lambda s: None)
    assert len(rc.score(ONE)) == 1 and len(flaky.urls) == 2
    for status in (500, 501):
        transport = Scripted([httpx.Response(status, text="broken")] * 5)
        rc = RewardClient(
            A,
            retry=policy(max_attempts=3, backoff_base=0.0),
            transport=httpx.MockTransport(transport),
            sleep=lambda s: None,
        )
        with pytest.raises(RewardServiceError, match=f"HTTP {status}") as info:
            rc.score(ONE)
        assert not isinstance(info.value, RewardRequestError)
        assert len(transport.urls) == (3 if status == 500 else 1)


@pytest.mark.parametrize(
    ("env", "given", "sent"),
    [
        ({"SDE2_API_KEY": "k-env"}, None, "Bearer k-env"),
        ({"SDE2_API_KEY": "k-env"}, "k-arg", "Bearer k-arg"),
        ({"SDE2_API_KEY": ""}, None, None),
        ({}, None, None),
    ],
)
def test_the_key_comes_from_the_argument_or_sde2_api_key(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], given: str | None, sent: str | None
) -> None:
    monkeypatch.delenv("SDE2_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen: list[str | None] = []
    core = core_handler([])

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return core(request)

    with RewardClient(A, api_key=given, transport=httpx.MockTransport(handler)) as rc:
        rc.score(ONE)
    assert seen == [sent]


def test_non_json_200_is_transient() -> None:
    transport = Scripted([httpx.Response(200, text="<html>proxy</html>")])
    rc = RewardClient(A, transport=httpx.MockTransport(transport), sleep=lambda s: None)
    assert len(rc.score(ONE)) == 1 and len(transport.urls) == 2


def test_deadline_stops_retrying() -> None:
    transport = Scripted([httpx.ConnectError("down")] * 10)
    rc = RewardClient(
        A,
        retry=policy(max_attempts=10, backoff_base=4.0, deadline=5.0),
        transport=httpx.MockTransport(transport),
        sleep=lambda s: None,
    )
    with pytest.raises(RewardServiceError, match="ConnectError"):
        rc.score(ONE)
    assert len(transport.urls) < 10


def test_failover_moves_to_the_next_replica() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "replica-a":
            raise httpx.ConnectError("connection refused")
        return core_handler([])(request)

    sleeps: list[float] = []
    rc = RewardClient([A, B], transport=httpx.MockTransport(handle), sleep=sleeps.append)
    items = batch()
    result = rc.score(items, normalize=True)
    with RewardClient(B, transport=httpx.MockTransport(handle)) as single:
        assert result.rewards == pytest.approx(single.score(items).rewards, abs=1e-12)
    assert len(sleeps) == 1  # the shard meant for A retried once, on B


def test_never_returns_partial_results_when_one_shard_fails() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "replica-b":
            return httpx.Response(503, headers={"retry-after": "0"})
        return core_handler([])(request)

    rc = RewardClient(
        [A, B],
        retry=policy(max_attempts=2),
        transport=httpx.MockTransport(handle),
        sleep=lambda s: None,
    )
    # both attempts of shard B: B (503) then A (ok) -> succeeds through failover
    assert len(rc.score(batch())) == 12
    rc1 = RewardClient(
        [A, B],
        retry=policy(max_attempts=1),
        transport=httpx.MockTransport(handle),
        sleep=lambda s: None,
    )
    with pytest.raises(RewardServiceError, match="replica-b"):
        rc1.score(batch())


def test_split_is_balanced_and_contiguous() -> None:
    assert [list(r) for r in split(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split(2, 4)] == [[0], [1]]
    assert sum(len(r) for r in split(1001, 7)) == 1001


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("recipe", ["sde2", "cfee", "cfl"])
def test_sharded_mock_equals_single_server(normalize: bool, recipe: str) -> None:
    calls: list[dict[str, Any]] = []
    mock = httpx.MockTransport(core_handler(calls))
    items = batch()
    params = {"similarity_threshold": 0.75, "weights": {"oc": 2.0}, "length_target": 300}
    with RewardClient(A, transport=mock) as one:
        single = one.score(items, recipe=recipe, params=params, normalize=normalize)
    with RewardClient([A, B, "http://replica-c:8000"], transport=mock) as three:
        sharded = three.score(items, recipe=recipe, params=params, normalize=normalize)
    shard_calls = calls[1:]
    assert len(shard_calls) == 3 and all(c["normalize"] is False for c in shard_calls)
    assert {c["url"].split("/v1")[0] for c in shard_calls} == {A, B, "http://replica-c:8000"}
    assert sharded.rewards == pytest.approx(single.rewards, abs=1e-12)
    assert sharded.components == single.components
    for k in single.normalized:
        assert sharded.normalized[k] == pytest.approx(single.normalized[k], abs=1e-12)
    assert single.advantages is not None and sharded.advantages is not None
    assert sharded.advantages == pytest.approx(single.advantages, abs=1e-9)
    assert sharded.batch_mean == pytest.approx(single.batch_mean)
    assert sharded.items == single.items
    # the batch is not degenerate: normalization really changed the numbers
    assert max(single.batch_std.values()) > 0.1


def test_batches_over_the_item_limit_are_split_and_merged() -> None:
    calls: list[dict[str, Any]] = []
    mock = httpx.MockTransport(core_handler(calls))
    items = batch()  # 12 items
    with RewardClient(A, transport=mock) as one:
        single = one.score(items)
    with RewardClient([A, B], transport=mock, max_items_per_request=5) as limited:
        chunked = limited.score(items)
    shard_calls = calls[1:]
    assert [len(c["items"]) for c in shard_calls] == [4, 4, 4]  # ceil(12 / 5) = 3 shards
    assert sorted(c["url"].split("/v1")[0] for c in shard_calls) == [A, A, B]
    assert chunked.rewards == pytest.approx(single.rewards, abs=1e-12)
    assert chunked.advantages == pytest.approx(single.advantages, abs=1e-9)


def test_sharded_overflow_is_an_error_not_inf() -> None:
    """Finite raw sums on each replica can still overflow once z-scored over the whole batch."""
    mock = httpx.MockTransport(core_handler([]))
    items = [{k: v for k, v in it.items() if k != "group"} for it in batch()]
    params = {"weights": {"oc": 1.7e308}}  # raw oc is 0 or 1; its z-scores reach 1.18
    with RewardClient(A, transport=mock) as one:
        raw = one.score(items, params=params, normalize=False)
    assert all(math.isfinite(r) for r in raw.rewards)  # each shard's own check passes
    with (
        RewardClient([A, B], transport=mock) as two,
        pytest.raises(ValueError, match=r"^params: .*non-finite"),
    ):
        two.score(items, params=params, normalize=True)


def test_mixed_groups_are_rejected_before_sending() -> None:
    calls: list[dict[str, Any]] = []
    items = batch()
    del items[3]["group"]
    with (
        RewardClient([A, B], transport=httpx.MockTransport(core_handler(calls))) as rc,
        pytest.raises(ValueError, match=r"items\[3\]\.group"),
    ):
        rc.score(items)
    assert calls == []
    # The odd one out, as the server names it: one grouped item among ungrouped ones.
    items = [{k: v for k, v in item.items() if k != "group"} for item in batch()]
    items[2]["group"] = "g"
    with (
        RewardClient([A, B], transport=httpx.MockTransport(core_handler(calls))) as rc,
        pytest.raises(ValueError, match=rf"items\[2\]\.group: .* \(1 of {len(items)} do\)"),
    ):
        rc.score(items)
    assert calls == []


def test_bad_item_type_fails_in_the_caller() -> None:
    rc = RewardClient(A, transport=httpx.MockTransport(core_handler([])))
    ok = {"completion": "x", "answer": "18"}
    with pytest.raises(ValueError, match=r"items\[1\]\.answer: Input should be a valid string"):
        rc.score([ok, {"completion": "x", "answer": 18}])
    with pytest.raises(ValueError, match=r"items\[2\]\.unexpected_field: "):
        rc.score([ok, ok, {**ok, "unexpected_field": 1}])
    with pytest.raises(TypeError, match=r"items\[0\] must be a mapping or a ScoreItem, not str"):
        rc.score(["just a completion"])  # type: ignore[list-item]


async def test_a_lone_surrogate_is_named_and_never_sent() -> None:
    """A string UTF-8 cannot encode made httpx raise a bare UnicodeEncodeError (through the TRL
    adapter, verl's compute_score and the OpenRLHF hook alike): now a ValueError naming the
    field, raised before any try, by both clients."""
    sent: list[dict[str, Any]] = []
    handler = core_handler(sent)
    bad = [{"completion": "fine", "answer": "1"}, {"completion": "x\ud800y", "answer": "1"}]
    want = r"items\.1\.completion: not valid UTF-8 at character 1: a lone surrogate"
    with pytest.raises(ValueError, match=want):
        RewardClient(A, transport=httpx.MockTransport(handler)).score(bad)
    async with AsyncRewardClient(A, transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(ValueError, match=want):
            await client.score(bad)
    assert sent == []
    ok = RewardClient(A, transport=httpx.MockTransport(handler)).score(bad[:1])
    assert len(ok.rewards) == 1 and len(sent) == 1


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"items": [], None: "x\ud800"}, "None: not valid UTF-8"),
        ({"items": [{"completion": "a", 2.5: "\udc00"}]}, "items.0.2.5: not valid UTF-8"),
    ],
)
def test_a_lone_surrogate_under_a_name_that_is_not_a_string_is_named(
    body: dict[Any, Any], want: str
) -> None:
    """A caller's dict may hold a key JSON writes as a string (None, a float): the field is
    named as ``str`` shows it; making the path printable raised AttributeError on it."""
    with pytest.raises(ValueError, match=re.escape(want)):
        encode_body(body)


async def test_async_client_retries_and_shards() -> None:
    script = Scripted(
        [httpx.ConnectError("refused"), httpx.Response(429, headers={"retry-after": "2"})]
    )
    sleeps: list[float] = []

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    async with AsyncRewardClient(
        [A, B],
        retry=policy(backoff_base=1.0),
        transport=httpx.MockTransport(script),
        sleep=fake_sleep,
    ) as rc:
        result = await rc.score(batch(), diagnostics=True)
    assert isinstance(result, ScoreResult) and len(result) == 12
    # Each retry goes to the other replica: a backoff (first or second retry), never B's 2 s
    # Retry-After stretched by its jitter.
    assert len(sleeps) == 2 and all(0.5 <= s < 2.0 for s in sleeps)
    with RewardClient(A, transport=httpx.MockTransport(core_handler([]))) as one:
        assert result.rewards == pytest.approx(one.score(batch(), diagnostics=True).rewards)


async def test_async_client_exhaustion() -> None:
    async def no_sleep(s: float) -> None:
        return None

    script = Scripted([httpx.ReadTimeout("slow")] * 5)
    async with AsyncRewardClient(
        A, retry=policy(max_attempts=2), transport=httpx.MockTransport(script), sleep=no_sleep
    ) as rc:
        with pytest.raises(RewardServiceError, match=r"ReadTimeout.*ReadTimeout"):
            await rc.score(ONE)


# --- against real server processes -------------------------------------------------------


def gsm8k_like_batch() -> list[dict[str, Any]]:
    """Completions with several distinct strategies, so the encoder really runs."""
    reasons = [
        "Natalia sold 48 clips in April and half as many in May, so 48 / 2 = 24 in May.",
        "Think of it as 48 plus its half: 48 * 1.5 = 72 clips in total.",
        "Count in dozens: 4 dozen in April, 2 dozen in May, 6 dozen is 72.",
        "A shop sells apples; the price of bananas rose sharply last winter.",
    ]
    items = []
    for g in range(4):
        for k in range(4):
            m = (g + k) % 5
            outs = ["72" if (g * k) % 3 == 0 else "70" for _ in range(m)]
            final = "72" if k % 2 else "71"
            rs = [f"{reasons[(j + k) % 4]} (variant {g}.{j})" for j in range(m)]
            items.append(
                {
                    "completion": completion(outs, final, rs),
                    "answer": "#### 72",
                    "group": f"p{g}",
                    "num_tokens": 50 + 37 * k,
                }
            )
    return items


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sde2", "cfl"])
def test_sharded_over_two_real_servers_equals_one(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
    recipe: str,
) -> None:
    a, b = two_reward_servers
    items = gsm8k_like_batch()
    with RewardClient(a.url) as one, RewardClient([a.url, b.url]) as both:
        single = one.score(items, recipe=recipe, diagnostics=True)
        sharded = both.score(items, recipe=recipe, diagnostics=True)
    assert sorted(set(sharded.served_by)) == sorted({a.url, b.url})
    assert sharded.rewards == pytest.approx(single.rewards, abs=1e-6)
    assert sharded.advantages == pytest.approx(single.advantages, abs=1e-5)
    for k in single.components:
        assert sharded.components[k] == pytest.approx(single.components[k], abs=1e-6)
        assert sharded.normalized[k] == pytest.approx(single.normalized[k], abs=1e-5)
    assert [it.correct for it in sharded.items] == [it.correct for it in single.items]
    assert sharded.encoder == single.encoder
    assert max(single.batch_std.values()) > 0.1


@pytest.mark.slow
async def test_async_client_against_real_server(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    a, b = two_reward_servers
    items = gsm8k_like_batch()
    async with AsyncRewardClient([a.url, b.url]) as rc:
        sharded = await rc.score(items, recipe="cfee")
    with RewardClient(b.url) as one:
        single = one.score(items, recipe="cfee")
    assert sharded.rewards == pytest.approx(single.rewards, abs=1e-6)


@pytest.mark.slow
def test_real_server_422_is_a_request_error(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    a, _ = two_reward_servers
    with RewardClient(a.url) as rc, pytest.raises(RewardRequestError, match="422"):
        rc.score(ONE, answer_type="roman numerals")
    # Parameters are checked before any request, naming the field (the server refused them).
    with RewardClient(a.url) as rc, pytest.raises(ValueError, match=r"params\.eps: "):
        rc.score(ONE, params={"eps": 5.0})


# --- batches refused for their size, transient statuses, shards that fail, who answered ----


def size_limited(
    limit: int, calls: list[dict[str, Any]]
) -> Callable[[httpx.Request], httpx.Response]:
    """A mock server that refuses a request of more than ``limit`` items as the real one refuses
    too much encoder work (422 at ``items``, type ``too_many_tokens``), else scores it."""
    core = core_handler(calls)

    def handle(request: httpx.Request) -> httpx.Response:
        n = len(json.loads(request.content)["items"])
        if n > limit:
            issue = {"loc": ["items"], "field": "items", "msg": "split", "type": "too_many_tokens"}
            return httpx.Response(422, json={"detail": [issue]})
        return core(request)

    return handle


@pytest.mark.parametrize("normalize", [True, False])
def test_a_batch_refused_for_its_size_is_scored_in_halves(normalize: bool) -> None:
    items = batch()  # 12 items
    with RewardClient(A, transport=httpx.MockTransport(core_handler([]))) as one:
        single = one.score(items, normalize=normalize)
    calls: list[dict[str, Any]] = []
    with RewardClient(A, transport=httpx.MockTransport(size_limited(4, calls))) as limited:
        halved = limited.score(items, normalize=normalize)
    # 12 refused, 6 refused, 3 + 3 scored, 6 refused, 3 + 3 scored: raw, normalized here
    assert [len(c["items"]) for c in calls] == [3, 3, 3, 3]
    assert all(c["normalize"] is False for c in calls)
    assert halved.rewards == pytest.approx(single.rewards, abs=1e-12)
    assert halved.components == single.components
    assert halved.advantages == pytest.approx(single.advantages, abs=1e-9)
    assert halved.items == single.items


async def test_the_async_client_halves_a_batch_refused_for_its_size() -> None:
    items = batch()
    calls: list[dict[str, Any]] = []
    async with AsyncRewardClient(
        [A, B], transport=httpx.MockTransport(size_limited(2, calls))
    ) as rc:
        halved = await rc.score(items)
    with RewardClient(A, transport=httpx.MockTransport(core_handler([]))) as one:
        assert halved.rewards == pytest.approx(one.score(items).rewards, abs=1e-12)
    assert sorted(len(c["items"]) for c in calls) == [1, 1, 1, 1, 2, 2, 2, 2]


def test_a_size_refusal_of_one_item_or_of_a_field_is_raised() -> None:
    """Halving cannot help one item, nor a refusal that names a field of an item."""
    limited = httpx.MockTransport(size_limited(0, []))
    with RewardClient(A, transport=limited) as rc, pytest.raises(RewardRequestError, match="too_"):
        rc.score(ONE)
    field = {"loc": ["items", 0, "completion"], "msg": "too long", "type": "too_long"}
    transport = Scripted([httpx.Response(422, json={"detail": [field]})])
    with (
        RewardClient(A, transport=httpx.MockTransport(transport)) as rc,
        pytest.raises(RewardRequestError, match="too long"),
    ):
        rc.score(batch())
    assert len(transport.urls) == 1


def corrupt_gzip() -> httpx.Response:
    """A 200 whose gzip body cannot be decoded (read by the client, not here)."""
    return httpx.Response(
        200, headers={"content-encoding": "gzip"}, stream=httpx.ByteStream(b"not gzip")
    )


def test_408_and_an_undecodable_body_are_transient() -> None:
    transport = Scripted([httpx.Response(408, text="body timeout"), corrupt_gzip()])
    sleeps: list[float] = []
    with RewardClient(A, transport=httpx.MockTransport(transport), sleep=sleeps.append) as rc:
        assert len(rc.score(ONE)) == 1
    assert len(transport.urls) == 3 and len(sleeps) == 2
    always_corrupt = Scripted([corrupt_gzip() for _ in range(3)])
    with (
        RewardClient(
            A,
            retry=policy(max_attempts=3),
            transport=httpx.MockTransport(always_corrupt),
            sleep=lambda s: None,
        ) as rc,
        pytest.raises(RewardServiceError, match="DecodingError"),
    ):
        rc.score(ONE)


def test_served_by_names_the_replica_that_answered() -> None:
    transport = Scripted([httpx.Response(503, headers={"retry-after": "0"})])
    with RewardClient([A, B], transport=httpx.MockTransport(transport), sleep=lambda s: None) as rc:
        result = rc.score(ONE)
    assert transport.urls == [A + "/v1/score", B + "/v1/score"]
    assert result.served_by == [B]


def failing_shards() -> tuple[Callable[[httpx.Request], httpx.Response], list[str]]:
    """The first request is refused (422) after a while; every later one fails transiently for
    good (replica A 503, replica B connection refused), so the other shard retries until told
    to stop."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if len(seen) == 1:
            time.sleep(0.2)  # the other shard is retrying by the time this one fails
            return httpx.Response(422, json={"detail": [{"loc": ["params"], "msg": "bad"}]})
        if request.url.host == "replica-b":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(503, text="not ready")

    return handle, seen


def test_a_shard_that_fails_stops_the_others() -> None:
    """The refusal is raised at once; the shard retrying a dead replica gives up at its next
    try instead of spending its whole retry budget."""
    handle, seen = failing_shards()

    def slow_sleep(s: float) -> None:
        time.sleep(0.05)

    rc = RewardClient(
        [A, B],
        retry=policy(max_attempts=200, backoff_base=0.0),
        transport=httpx.MockTransport(handle),
        sleep=slow_sleep,
    )
    start = time.monotonic()
    with pytest.raises(RewardRequestError, match="422"):
        rc.score(batch())
    assert time.monotonic() - start < 2.0
    # The other shard notices at its next try (one 0.05 s sleep away; later on a loaded
    # machine): its count settles, where a shard going on would try every 0.05 s for 10 s.
    tried, settle_by = -1, time.monotonic() + 3
    while len(seen) != tried and time.monotonic() < settle_by:
        tried = len(seen)
        time.sleep(0.3)
    time.sleep(0.3)
    assert len(seen) == tried < 20


def test_a_try_the_batch_failure_cut_short_logs_no_retry(caplog: pytest.LogCaptureFixture) -> None:
    """One shard refused (422) while the other's try is in flight, and the client closed: the
    closing ends that try with an error, which was logged as a retry ("try 1 failed ... next
    try in 0.4 s") after the call had raised and the client was closed."""
    in_flight, closed = threading.Event(), threading.Event()
    ended: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "replica-a":
            assert in_flight.wait(5)
            return httpx.Response(422, json={"detail": [{"loc": ["params"], "msg": "bad"}]})
        in_flight.set()
        assert closed.wait(5)
        ended.append("b")
        raise httpx.ReadError("[Errno 9] Bad file descriptor")

    caplog.set_level(logging.WARNING, logger="trainer_client.client")
    with (
        pytest.raises(RewardRequestError, match="422"),
        RewardClient([A, B], transport=httpx.MockTransport(handle)) as rc,
    ):
        rc.score(batch())
    closed.set()
    for shard in [t for t in threading.enumerate() if t.name == "sde2-shard"]:
        shard.join(10)  # past its failed try, and whatever it logs then
        assert not shard.is_alive()
    assert ended and not [r for r in caplog.records if "failed" in r.getMessage()]


async def test_the_async_client_cancels_the_other_shards() -> None:
    handle, seen = failing_shards()

    async def slow_sleep(s: float) -> None:
        await asyncio.sleep(0.05)

    async with AsyncRewardClient(
        [A, B],
        retry=policy(max_attempts=200, backoff_base=0.0),
        transport=httpx.MockTransport(handle),
        sleep=slow_sleep,
    ) as rc:
        with pytest.raises(RewardRequestError, match="422"):
            await rc.score(batch())
        tried = len(seen)
        await asyncio.sleep(0.3)
        assert len(seen) == tried < 10


def test_no_attempt_limit_means_the_deadline_rules() -> None:
    with pytest.raises(ValueError, match="needs a deadline"):
        RetryPolicy(max_attempts=None)
    transport = Scripted([httpx.ConnectError("down")] * 30)
    clock = [0.0]
    rc = RewardClient(
        A,
        retry=policy(max_attempts=None, backoff_base=1.0, backoff_max=1.0, deadline=20.0),
        transport=httpx.MockTransport(transport),
        sleep=lambda s: clock.__setitem__(0, clock[0] + s),
    )
    assert len(rc.score(ONE)) == 1  # 30 refusals, far more than the default 6 attempts
    assert len(transport.urls) == 31


@pytest.mark.slow
def test_a_real_server_s_size_limits_are_met_by_halving(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    """A server that takes at most 3 items and 200 estimated encoder tokens a request refuses
    the batch (422 at ``items``); the client scores it in smaller requests, with the numbers
    one unlimited server gives for the whole batch."""
    from tests.client_fixtures import running_server

    a, _ = two_reward_servers
    items = gsm8k_like_batch()
    with RewardClient(a.url) as one:
        single = one.score(items, diagnostics=True)
    with (
        running_server("--max-items", "3", "--max-request-tokens", "200") as small,
        RewardClient(small.url) as rc,
    ):
        with pytest.raises(RewardRequestError, match="too_long"):
            rc.request("POST", "/v1/score", {"items": items})  # what it says to one request
        halved = rc.score(items, diagnostics=True)
    assert halved.rewards == pytest.approx(single.rewards, abs=1e-6)
    assert halved.advantages == pytest.approx(single.advantages, abs=1e-5)
    assert [it.uniq for it in halved.items] == [it.uniq for it in single.items]
    assert set(halved.served_by) == {small.url} and len(halved.served_by) > 5


def test_a_failed_batch_starts_no_new_request() -> None:
    """After one shard failed for good, a shard still being halved sends none of its halves."""
    calls: list[tuple[float, str, int]] = []
    core = core_handler([])

    def handle(request: httpx.Request) -> httpx.Response:
        n = len(json.loads(request.content)["items"])
        calls.append((time.monotonic(), request.url.host, n))
        if request.url.host == "replica-b":  # refused for good, not for its size
            issue = {"loc": ["items", 0, "answer"], "msg": "bad", "type": "value_error"}
            return httpx.Response(422, json={"detail": [issue]})
        time.sleep(0.2)
        if n > 1:
            issue = {"loc": ["items"], "msg": "split", "type": "too_many_tokens"}
            return httpx.Response(422, json={"detail": [issue]})
        return core(request)

    with pytest.raises(RewardRequestError, match=r"HTTP 422 .*value_error"):
        RewardClient([A, B], transport=httpx.MockTransport(handle)).score(batch(2, 4))
    raised = time.monotonic()
    time.sleep(0.8)
    assert [c for c in calls if c[0] > raised] == []


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers (a wedged replica)."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    running = True

    def accept() -> None:
        while running:
            with contextlib.suppress(OSError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        running = False
        sock.close()
        for conn in held:
            conn.close()


def test_the_deadline_cuts_the_tries_timeout() -> None:
    """A try begun before the deadline ran the whole request timeout past it (8 s against a
    deadline of 2)."""
    with silent_server() as url:
        policy = RetryPolicy(max_attempts=None, deadline=1.0)
        rc = RewardClient(url, timeout=8, retry=policy)
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match="ReadTimeout"):
            rc.score(batch(1, 2))
        assert time.monotonic() - start < 4


def test_ctrl_c_stops_a_batch_split_over_replicas_at_once() -> None:
    """With several URLs the shards ran in a pool whose threads the interpreter waited for at
    exit: after Ctrl-C the process went on for the request's timeout, logging retries."""
    with silent_server() as url:
        code = (
            "import sys; from trainer_client import RewardClient\n"
            f"rc = RewardClient([{url!r}, {url!r}], timeout=60)\n"
            "print('scoring', flush=True)\n"
            "rc.score([{'completion': 'a', 'answer': '1'}] * 4)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=REPO)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == b"scoring\n"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 5 and b"KeyboardInterrupt" in err


@pytest.mark.slow
def test_the_start_up_probe_asks_every_replica(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    """sde2-train and sde2-eval probe the server before loading a model; a probe of the
    client failed over, so a dead second URL passed it and then cost a retry every request."""
    from tests.server_process import free_port
    from trainer_client.client import probe_each

    a, b = two_reward_servers
    assert len(probe_each([a.url, b.url])) == 2
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardServiceError, match=dead):
        probe_each([a.url, dead])


@pytest.mark.slow
def test_replicas_with_different_encoders_are_named_and_warned(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fleet of an onnxruntime replica and an OpenVINO one (real servers): the start-up probe
    warns, a batch split over both names both encoders and warns, and its rewards are one
    replica's alone within 1e-5 (both are fp32 exports of one model). A merged batch carried
    the first shard's encoder alone, as if one had embedded it all."""
    from tests.client_fixtures import running_server
    from tests.service_fixtures import step_items
    from trainer_client.client import probe_each

    a, _ = two_reward_servers
    items = step_items(seed=3)[:16]
    onnx, openvino = "all-MiniLM-L6-v2 onnx fp32", "all-MiniLM-L6-v2 openvino fp32"
    with running_server("--backend", "openvino") as ov:
        caplog.set_level(logging.WARNING, logger="trainer_client.client")
        assert len(probe_each([a.url, a.url])) == 2 and not caplog.records
        probe_each([a.url, ov.url])
        assert [r.getMessage() for r in caplog.records] == [
            f"the reward service warns: encoder: replicas embed with {onnx} | {openvino}; "
            "only fp32 exports of one model agree"
        ]
        with RewardClient([a.url, ov.url]) as both, RewardClient(a.url) as alone:
            mixed, single = both.score(items), alone.score(items)
    assert single.encoder == onnx and not single.warnings
    assert mixed.encoder == f"{onnx} | {openvino}"
    assert mixed.warnings == [caplog.records[0].getMessage().split(": ", 1)[1]]
    assert mixed.served_by == [a.url, ov.url]
    assert max(abs(x - y) for x, y in zip(mixed.rewards, single.rewards, strict=True)) < 1e-5


def test_ready_is_quick_on_a_wedged_replica_and_async_too() -> None:
    """``ready()`` ("right now") waited the 180 s request timeout on a replica that accepts and
    never answers; ``AsyncRewardClient`` had none, though documented with the same API."""
    from trainer_client import client as client_module

    with silent_server() as url:
        start = time.monotonic()
        assert RewardClient(url).ready() is False
        assert time.monotonic() - start < client_module.READY_TIMEOUT + 2

        async def run() -> bool:
            async with AsyncRewardClient(url) as arc:
                return await arc.ready()

        assert asyncio.run(run()) is False


def test_params_are_checked_naming_the_field_and_sent_as_json_numbers() -> None:
    """A NaN was a bare "Out of range float values are not JSON compliant", a numpy number a
    TypeError (``np.int64`` then "not a valid integer"): now the field is named, and numpy
    scalars are sent as the numbers they hold."""
    import numpy as np

    from trainer_client.sharding import params_to_json

    with pytest.raises(ValueError, match=r"^params\.explore_cap: Input should be a finite number"):
        params_to_json({"explore_cap": math.nan})
    given = {"length_target": np.int64(256), "weights": {"sd": np.float32(0.5)}}
    assert params_to_json(given) == {"length_target": 256, "weights": {"sd": 0.5}}
    assert json.dumps(params_to_json(given))  # plain JSON


@pytest.mark.parametrize("header", ["0", "Mon, 01 Jan 2001 00:00:00 GMT"])
def test_a_retry_after_of_no_time_keeps_the_backoff(header: str) -> None:
    """``Retry-After: 0`` (or a date gone by) from an overloaded proxy replaced the backoff,
    and the client retried at once, thousands of times a second: the wait is now the larger of
    the header's and the backoff."""
    busy = [httpx.Response(503, headers={"retry-after": header}, text="busy")] * 5
    sleeps: list[float] = []
    rc = RewardClient(
        [A, B],
        retry=policy(backoff_base=0.4, backoff_max=20.0),
        transport=httpx.MockTransport(Scripted(busy)),
        sleep=sleeps.append,
    )
    assert len(rc.score(ONE)) == 1
    floors = [0.4 * 2**k / 2 for k in range(5)]  # d/2, the least a backoff waits
    assert len(sleeps) == 5
    assert all(wait >= floor for wait, floor in zip(sleeps, floors, strict=True)), sleeps
    p = policy(backoff_base=1.0, retry_after_jitter=0.0)
    assert p.delay(0, retry_after=0.0) >= 0.5 and p.delay(0, retry_after=9.0) == 9.0


@contextlib.contextmanager
def answering_server(answer: Callable[[Any, bytes], bytes]) -> Iterator[str]:
    """A real keep-alive HTTP server (a thread per connection) answering each POST with 200
    and the JSON bytes ``answer(handler, body)`` returns."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # the stdlib's name
            data = answer(self, self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def spoiling_proxy(upstream: str, spoil: Callable[[dict[str, Any]], None]) -> Any:
    """A real HTTP proxy in front of ``upstream`` that passes each request on and answers the
    upstream's JSON after ``spoil`` changed it, written by Python's ``json`` (which writes a
    NaN as ``NaN``, as some servers and proxies do)."""

    def answer(handler: Any, body: bytes) -> bytes:
        key = {k: v for k, v in handler.headers.items() if k.lower() == "authorization"}
        spoiled = httpx.post(upstream + handler.path, content=body, headers=key).json()
        spoil(spoiled)
        return json.dumps(spoiled).encode()

    return answering_server(answer)


def _set(path: str, value: float) -> Callable[[dict[str, Any]], None]:
    """A ``spoil`` that writes ``value`` at the dotted ``path`` of the answer."""

    def spoil(answer: dict[str, Any]) -> None:
        *head, last = path.split(".")
        node: Any = answer
        for key in head:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return spoil


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    ["rewards.1", "components.sd.2", "normalized.oc.0", "advantages.3", "items.1.div"],
)
def test_a_non_finite_number_in_an_answer_is_refused_naming_it(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
    path: str,
) -> None:
    """A server (or proxy) answering JSON NaN or Infinity passed it on as a reward to TRL and
    verl; now it is a bad answer, retried, then a RewardServiceError naming the field and item."""
    a, _ = two_reward_servers
    items = gsm8k_like_batch()[:4]
    quick = RetryPolicy(max_attempts=2, backoff_base=0.0)
    for bad in (float("nan"), float("inf")):
        with (
            spoiling_proxy(a.url, _set(path, bad)) as proxy,
            RewardClient(proxy, retry=quick) as rc,
        ):
            with pytest.raises(RewardServiceError, match=rf"{re.escape(path)}: {bad}") as err:
                rc.score(items, diagnostics=True)
            assert len(err.value.attempts) == 2  # a failed try, retried


@pytest.mark.slow
def test_the_adapters_raise_on_a_nan_reward_and_null_stays_fine(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    """TRL's reward function and verl's compute_score raise, never hand a NaN to the trainer;
    the nulls SPEC §6 allows pass the same proxy untouched."""
    from trainer_client.trl import sde2_reward
    from trainer_client.verl import compute_score

    a, _ = two_reward_servers
    items = gsm8k_like_batch()[:4]
    quick = RetryPolicy(max_attempts=2, backoff_base=0.0)
    with spoiling_proxy(a.url, lambda answer: None) as proxy, RewardClient(proxy) as rc:
        plain = rc.score(items)
        assert None in [it.div for it in plain.items] and plain.advantages is not None
    with spoiling_proxy(a.url, _set("rewards.0", float("nan"))) as proxy:
        reward = sde2_reward(proxy, retry=quick)
        texts = [it["completion"] for it in items[:2]]
        with pytest.raises(RewardServiceError, match=r"rewards\.0: nan"):
            asyncio.run(reward(prompts=["q", "q"], completions=texts, answer=["72", "72"]))
        with pytest.raises(RewardServiceError, match=r"rewards\.0: nan"):
            compute_score("openai/gsm8k", texts[0], "72", url=proxy, max_attempts=2)


@pytest.mark.slow
def test_the_start_up_probe_checks_the_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server with SDE2_API_KEY and a client without it (or with another) passed the probe,
    then failed with 401 after minutes of loading and generation. Now the probe says so,
    naming the setting, for sde2-eval and sde2-train before anything loads."""
    from trainer_client import evaluate, train
    from trainer_client.client import probe_each

    monkeypatch.delenv("SDE2_API_KEY", raising=False)
    keyed = ServerProcess(None, env={"SDE2_API_KEY": "probe-key"}).start()
    try:
        with pytest.raises(RewardRequestError, match="has none: set SDE2_API_KEY") as err:
            probe_each(keyed.url)
        assert err.value.status == 401
        with pytest.raises(RewardRequestError, match=r"refused the API key .*SDE2_API_KEY"):
            probe_each(keyed.url, api_key="wrong-key")
        assert len(probe_each(keyed.url, api_key="probe-key")) == 1

        runfile = tmp_path / "r.jsonl"
        runfile.write_text('{"completion": "<final_answer>4</final_answer>", "answer": "4"}\n')
        assert evaluate.main(["--reward-url", keyed.url, "--completions", f"r={runfile}"]) == 2
        assert "has none: set SDE2_API_KEY" in capsys.readouterr().err
        argv = ["--model", "no-such-org/no-model", "--reward-url", keyed.url]
        argv += ["--output-dir", str(tmp_path / "out")]
        assert train.main(argv) == 2  # before the model (which does not exist) loads
        assert "has none: set SDE2_API_KEY" in capsys.readouterr().err
        monkeypatch.setenv("SDE2_API_KEY", "probe-key")
        assert evaluate.main(["--reward-url", keyed.url, "--completions", f"r={runfile}"]) == 0
    finally:
        keyed.stop()


@pytest.mark.slow
async def test_errors_name_the_item_s_index_in_the_caller_s_batch(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
) -> None:
    """A batch split over replicas, or halved after a refusal for its size, is sent in pieces
    that each count their items from 0: a 422's ``items.1.answer`` (and a lone surrogate's
    ``items.1.completion``) named the wrong item of the caller's batch."""
    from tests.client_fixtures import running_server

    a, b = two_reward_servers
    items = [{"completion": "<final_answer>1</final_answer>", "answer": "1"} for _ in range(6)]
    # Over the server's --max-completion-chars (200,000): a 422 at the item's completion.
    blank = [*items[:4], {**items[4], "completion": "x" * 200_001}, items[5]]
    broken = [*items[:4], {**items[4], "completion": "bad \ud800 text"}, items[5]]
    for urls in ([a.url, b.url], [a.url]):
        with RewardClient(urls) as rc:
            with pytest.raises(RewardRequestError, match=r"items\.4\.completion") as err:
                rc.score(blank)
            assert "items.1." not in str(err.value)
            assert [i["field"] for i in err.value.attempts[-1].issues] == ["items.4.completion"]
            with pytest.raises(ValueError, match=r"items\.4\.completion: not valid UTF-8"):
                rc.score(broken)
        async with AsyncRewardClient(urls) as ac:
            with pytest.raises(RewardRequestError, match=r"items\.4\.completion"):
                await ac.score(blank)
            with pytest.raises(ValueError, match=r"items\.4\.completion: not valid UTF-8"):
                await ac.score(broken)
    many = [{**items[0]} for _ in range(20)]
    many[15]["completion"] = "x" * 200_001
    with (
        running_server("--max-items", "3") as small,
        RewardClient(small.url) as rc,
        pytest.raises(RewardRequestError, match=r"items\.15\.completion") as err,
    ):
        rc.score(many)  # 20 refused for its size, halved down to pieces of 3 or fewer
    assert "items.0.completion" not in str(err.value)


async def test_a_server_s_warnings_reach_the_caller_once_each(
    two_reward_servers: tuple[ServerProcess, ServerProcess],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gold no sensible answer matches ("####") is scored, and the server says so in an
    ``x-sde2-warning`` header: the result carries it, naming the item by its index in the
    caller's batch (also when the batch is split over replicas), and the client logs each kind
    once (a training run would otherwise log it every step)."""
    a, b = two_reward_servers
    items = [{"completion": "<final_answer>1</final_answer>", "answer": "1"} for _ in range(6)]
    items[4] = {**items[4], "answer": "####"}
    for urls in ([a.url, b.url], [a.url]):
        with caplog.at_level(logging.WARNING, logger="trainer_client.client"):
            caplog.clear()
            with RewardClient(urls) as rc:
                for _ in range(2):
                    result = rc.score(items)
                    [warning] = result.warnings
                    assert warning.startswith("items.4.answer: the gold answer '####'")
                    assert result.items[4].correct is False
            async with AsyncRewardClient(urls) as ac:
                assert (await ac.score(items)).warnings == [warning]
        told = [r.getMessage() for r in caplog.records if "####" in r.getMessage()]
        assert told == [f"the reward service warns: {warning}"] * 2, told  # once per client
    with RewardClient(a.url) as rc:
        assert rc.score(items[:4]).warnings == []


@contextlib.contextmanager
def busy_proxy(upstream: str) -> Iterator[str]:
    """A real HTTP proxy in front of ``upstream`` that passes on ``GET`` requests and answers
    a scoring request as a server busy with another job does once it has accepted its key:
    429 with ``Retry-After`` (a wrong key still gets the upstream's 401)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib's name
            self._answer(httpx.get(upstream + self.path))

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            headers = {k: v for k, v in self.headers.items() if k.lower() == "authorization"}
            answer = httpx.post(upstream + self.path, content=body, headers=headers)
            if answer.status_code != 401:
                answer = httpx.Response(429, json={"detail": "busy"}, headers={"retry-after": "1"})
            self._answer(answer)

        def _answer(self, answer: httpx.Response) -> None:
            self.send_response(answer.status_code)
            for name in ("content-type", "retry-after"):
                if name in answer.headers:
                    self.send_header(name, answer.headers[name])
            self.send_header("content-length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_key_check_passes_a_busy_server_that_accepted_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server checks the key before its queue: a 429 from a server busy with another job
    has accepted the key. The check retried it three times and failed the command's start."""
    from trainer_client.client import probe_each

    monkeypatch.delenv("SDE2_API_KEY", raising=False)
    keyed = ServerProcess(None, env={"SDE2_API_KEY": "probe-key"}).start()
    try:
        with busy_proxy(keyed.url) as busy:
            start = time.monotonic()
            assert len(probe_each(busy, api_key="probe-key")) == 1
            assert time.monotonic() - start < 5  # one try, no waiting out the Retry-After
            with pytest.raises(RewardRequestError, match=r"refused the API key"):
                probe_each(busy, api_key="wrong-key")
    finally:
        keyed.stop()


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_the_deadline_counts_from_the_batch_first_try_through_its_halves(
    client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch refused for its size is scored in halves; each half restarted the policy's
    deadline, so a batch given 30 s went on for 58 s (and deeper splits for longer), past
    ``--reward-deadline``'s "give up on a batch after this many seconds". Each request below
    is refused five times (a server restarting), and bodies of more than 2 items are refused
    for their size: the deadline now ends the batch."""
    import trainer_client.client as client_module

    clock = [0.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    score = core_handler([])
    tries: dict[bytes, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        clock[0] += 1.0
        tries[request.content] = tries.get(request.content, 0) + 1
        if tries[request.content] <= 5:
            return httpx.Response(503, text="restarting")
        if len(json.loads(request.content)["items"]) > 2:
            return httpx.Response(413, text="too large")
        return score(request)

    def wait(seconds: float) -> None:
        clock[0] += seconds

    async def wait_async(seconds: float) -> None:
        wait(seconds)

    policy = RetryPolicy(max_attempts=None, deadline=30.0, rng=random.Random(0))
    items = batch(1, 8)
    transport = httpx.MockTransport(handler)
    with pytest.raises(RewardServiceError, match="failed to score"):
        if client == "blocking":
            RewardClient(A, transport=transport, retry=policy, sleep=wait).score(items)
        else:

            async def run() -> None:
                async with AsyncRewardClient(
                    A, transport=transport, retry=policy, sleep=wait_async
                ) as rc:
                    await rc.score(items)

            asyncio.run(run())
    assert clock[0] <= 31.0  # the deadline, and the try that was under way


# --- answers that must not pass for a result ------------------------------------------------


@contextlib.contextmanager
def dripping_server(body: bytes, gap: float, head_too: bool = False) -> Iterator[str]:
    """A real HTTP server whose every answer is ``body`` (200, JSON), sent a byte per ``gap``
    seconds (``head_too``: its head as well): each byte comes within any read timeout, the
    whole answer long after."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 20)
                head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                head += f"content-length: {len(body)}\r\n\r\n"
                answer = head.encode() + body
                try:
                    sent = 0 if head_too else len(head)
                    conn.sendall(answer[:sent])
                    for k in range(sent, len(answer)):
                        if stop.wait(gap):
                            return
                        conn.sendall(answer[k : k + 1])
                except OSError:
                    continue  # the client gave up on this answer

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(10)


def slow_server(body: bytes, delay: float) -> Any:
    """A real keep-alive HTTP server answering ``body`` (200, JSON) ``delay`` seconds after
    each request, several at once."""

    def answer(handler: Any, request: bytes) -> bytes:
        time.sleep(delay)
        return body

    return answering_server(answer)


def _answer_bytes(items: list[dict[str, Any]]) -> bytes:
    calls: list[dict[str, Any]] = []
    request = httpx.Request("POST", f"{A}/v1/score", json={"items": items, "recipe": "sde2"})
    return core_handler(calls)(request).content


@pytest.mark.parametrize("head_too", [False, True])
def test_a_slow_answer_is_cut_at_the_request_timeout(head_too: bool) -> None:
    """httpx's read timeout bounds each wait for bytes: an answer sent a byte every 20 ms took
    a call with a 0.5 s timeout (and a 1 s deadline) as long as the answer lasted (~10 s).
    The asyncio client cuts a try at its due time, head or body; the blocking client checks
    as bytes arrive, from the head's end."""
    body = _answer_bytes(ONE)
    assert len(body) * 0.02 > 5  # the whole answer would take over 5 s
    quick = policy(max_attempts=2, backoff_base=0.0, deadline=1.0)
    with dripping_server(body, 0.02, head_too) as url:
        t0 = time.monotonic()
        rc = RewardClient(url, timeout=0.5, retry=quick)
        with rc, pytest.raises(RewardServiceError, match=r"ReadTimeout: no whole answer within"):
            rc.score(ONE)
        # A head of ~70 bytes at 20 ms each is 1.4 s; two tries of that and some of the body.
        assert time.monotonic() - t0 < (5.0 if head_too else 2.5)

        async def run() -> None:
            async with AsyncRewardClient(url, timeout=0.5, retry=quick) as rc:
                with pytest.raises(RewardServiceError, match=r"request timeout \(0.5 s\)"):
                    await rc.score(ONE)

        t0 = time.monotonic()
        asyncio.run(run())
        assert time.monotonic() - t0 < 1.5  # cut at each try's due time, the deadline's 1 s


def test_a_wait_for_a_pooled_connection_is_not_the_servers_time() -> None:
    """The due time counts from the request's sending: 8 calls on 2 connections to a server
    answering in 0.3 s all pass with a 1 s timeout (the last ones wait 0.9 s for a
    connection; counting that, two of them timed out)."""
    body = _answer_bytes(ONE)
    once = policy(max_attempts=1)
    with slow_server(body, 0.3) as url:

        async def run() -> list[ScoreResult]:
            async with AsyncRewardClient(url, timeout=1.0, max_connections=2, retry=once) as rc:
                return await asyncio.gather(*(rc.score(ONE) for _ in range(8)))

        assert [len(r) for r in asyncio.run(run())] == [1] * 8
        with RewardClient(url, timeout=1.0, max_connections=1, retry=once) as rc:
            results: list[int] = []
            threads = [
                threading.Thread(target=lambda: results.append(len(rc.score(ONE))))
                for _ in range(5)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert results == [1] * 5


def _spoiled(spoil: Callable[[dict[str, Any]], None]) -> httpx.MockTransport:
    """A mock server answering the core's result after ``spoil`` changed it."""
    core = core_handler([])

    def handle(request: httpx.Request) -> httpx.Response:
        answer = core(request).json()
        spoil(answer)
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handle)


def test_whole_numbers_written_as_floats_are_read_as_integers() -> None:
    """JSON has one kind of number: ``"n_strat": 2.0`` is 2 (some writers put every number so)."""

    def as_floats(answer: dict[str, Any]) -> None:
        for item in answer["items"]:
            item["n_strat"] = float(item["n_strat"])
            item["uniq"] = float(item["uniq"])

    with RewardClient(A, transport=_spoiled(as_floats)) as rc:
        result = rc.score(batch(), diagnostics=True)
    with RewardClient(A, transport=httpx.MockTransport(core_handler([]))) as rc:
        want = rc.score(batch(), diagnostics=True)
    assert result.items == want.items and all(type(i.n_strat) is int for i in result.items)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda a: a["advantages"].insert(0, 9.0), r"rewards but {'advantages': \d+}"),
        (lambda a: a["normalized"]["oc"].pop(), r"rewards but {'normalized.oc': \d+}"),
        (lambda a: a["normalized"].pop("sd"), "normalized \\['fa', 'oc', 're'\\]"),
        (
            lambda a: [a[k].pop("sd") for k in ("components", "normalized")],
            "recipe 'sde2' has components",
        ),
        (lambda a: a.update(recipe="cfl"), "scored with recipe 'cfl', not 'sde2'"),
        (lambda a: a["items"][2].update(correct="false"), "items.2.correct: 'false' is not a"),
        (lambda a: a["items"][1].update(n_strat=True), "items.1.n_strat: True is not a whole"),
        (lambda a: a["items"][1].update(uniq=1.5), "items.1.uniq: 1.5 is not a whole"),
        (lambda a: a["rewards"].__setitem__(3, "0.1"), "rewards.3: '0.1' is not a number"),
        (lambda a: a["batch"]["std"].update(oc=None), "batch.std.oc: None is not a number"),
    ],
)
def test_an_answer_of_another_shape_is_refused_naming_what(
    spoil: Callable[[dict[str, Any]], None], message: str
) -> None:
    """Each was accepted: an ``advantages`` one entry longer, cut to the batch by the TRL
    adapter, moved every advantage onto the next completion; a missing component summed the
    reward over the others when shards were merged; ``bool("false")`` counted as correct."""
    once = policy(max_attempts=1)
    items = batch()
    # Both shards' answers are spoiled, and either may be read first: an item of the second is
    # named by its place in the batch.
    either = re.sub(
        r"^(rewards|items)\.(\d+)",
        lambda m: f"{m[1]}\\.({m[2]}|{int(m[2]) + len(items) // 2})",
        message,
    )
    for rc, expected in (
        (RewardClient(A, retry=once, transport=_spoiled(spoil)), message),
        (RewardClient([A, B], retry=once, transport=_spoiled(spoil)), either),  # merged
    ):
        with rc, pytest.raises(RewardServiceError, match=expected):
            rc.score(items, recipe="sde2")
