"""The TRL adapter's optional log of why the best and the worst completion got their reward."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import httpx
import pytest

from reward_server.explain_report import summarize_item
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from trainer_client.retry import RewardServiceError
from trainer_client.trl import SDE2Reward
from trainer_client.trl_inputs import prompt_key

pytestmark = pytest.mark.slow


def strat(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
    )


TEXTS = [
    strat("Half of 48 is 24; 48 + 24 = 72.", "72")
    + strat("Three halves of 48 is 72.", "72")
    + "<final_answer>72</final_answer>",
    strat("48 + 22 = 70, guessing May sales.", "70") + "<final_answer>70</final_answer>",
    "The answer is #### 72",
    "<strategy><reasoning>unfinished",
]


def kwargs(log_extra: Any) -> dict[str, Any]:
    return {
        "prompts": ["p"] * len(TEXTS),
        "completions": TEXTS,
        "completion_ids": [list(range(5 * (i + 1))) for i in range(len(TEXTS))],
        "answer": ["72"] * len(TEXTS),
        "trainer_state": None,
        "log_extra": log_extra,
    }


def test_best_and_worst_explained_only_when_asked(reward_server: ServerProcess) -> None:  # noqa: F811
    extra: dict[str, list[Any]] = defaultdict(list)
    holder = SDE2Reward(reward_server.url, explain_extremes=True, params={"explore_cap": 0.7})
    rewards = asyncio.run(holder.sde2(**kwargs(lambda col, values: extra[col].extend(values))))
    column = extra["sde2/explanation"]
    assert len(column) == len(TEXTS)
    best = max(range(len(rewards)), key=lambda k: rewards[k])
    worst = min(range(len(rewards)), key=lambda k: rewards[k])
    assert [k for k, v in enumerate(column) if v is not None] == sorted({best, worst})
    # The cell is the summary of /v1/explain over the same call (same items, groups, params).
    assert holder.last_result is not None
    body = {
        "items": [
            {"completion": t, "answer": "72", "group": prompt_key("p"), "num_tokens": 5 * (k + 1)}
            for k, t in enumerate(TEXTS)
        ],
        "params": {"explore_cap": 0.7},
    }
    explained = httpx.post(reward_server.url + "/v1/explain", json=body, timeout=60).json()
    items = explained["explanation"]["items"]
    assert column[best] == f"best: {summarize_item(items[best])}"
    assert column[worst] == f"worst: {summarize_item(items[worst])}"
    assert f"reward {rewards[best]:+.4f}" in column[best]

    plain: dict[str, list[Any]] = defaultdict(list)
    asyncio.run(SDE2Reward(reward_server.url).sde2(**kwargs(lambda c, v: plain[c].extend(v))))
    assert "sde2/explanation" not in plain and "sde2/n_strat" in plain


def test_a_failed_explanation_leaves_the_rewards(
    reward_server: ServerProcess,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that takes 2 items a request: the score is split in halves and merged, and
    ``/v1/explain`` of the whole call, refused, costs the column only (a warning), not the
    step. The column is logged empty: left out, TRL showed the last step's explanations
    beside this step's completions (its columns are queues one generation batch long)."""
    from tests.client_fixtures import running_server

    reference = asyncio.run(SDE2Reward(reward_server.url).sde2(**kwargs(lambda c, v: None)))
    extra: dict[str, list[Any]] = defaultdict(list)
    with running_server("--max-items", "2") as small:
        holder = SDE2Reward(small.url, explain_extremes=True)
        with caplog.at_level("WARNING", logger="trainer_client.trl"):
            rewards = asyncio.run(holder.sde2(**kwargs(lambda c, v: extra[c].extend(v))))
    assert rewards == pytest.approx(reference, abs=1e-6)
    assert extra["sde2/explanation"] == [None] * len(rewards) and "sde2/n_strat" in extra
    assert "no sde2/explanation column this step" in caplog.text and "422" in caplog.text


def test_a_stalled_explanation_costs_the_column_not_the_step(
    reward_server: ServerProcess,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``/v1/explain`` that never answers is given up after ``EXPLAIN_TIMEOUT`` (it held the
    step for the adapter's 180 s timeout, twice); the rewards are the server's."""
    import time

    from trainer_client import trl

    monkeypatch.setattr(trl, "EXPLAIN_TIMEOUT", 0.5)
    reference = asyncio.run(SDE2Reward(reward_server.url).sde2(**kwargs(lambda c, v: None)))
    holder = SDE2Reward(reward_server.url, explain_extremes=True)

    async def step() -> list[float | None]:
        client = holder._get_client()
        scored = client.request

        async def stalled(method: str, path: str, *args: Any, **options: Any) -> Any:
            if path == "/v1/explain":
                await asyncio.sleep(3600)
            return await scored(method, path, *args, **options)

        client.request = stalled  # type: ignore[method-assign]
        return await holder.sde2(**kwargs(lambda c, v: None))

    started = time.monotonic()
    with caplog.at_level("WARNING", logger="trainer_client.trl"):
        rewards = asyncio.run(step())
    assert time.monotonic() - started < 10
    assert rewards == pytest.approx(reference, abs=1e-6)
    assert "no sde2/explanation column this step: no answer within 0.5 s" in caplog.text


def test_the_explanation_waits_briefly_on_a_busy_server() -> None:
    """A busy server's ``Retry-After: 60`` held the step for a minute for a log column: the
    explanation's one retry waits at most ``retry_after_max`` (2 s) and its jitter."""
    from trainer_client import AsyncRewardClient
    from trainer_client.trl import EXPLAIN_RETRY

    busy = httpx.Response(503, headers={"retry-after": "60"}, json={"detail": "busy"})
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def explain() -> None:
        transport = httpx.MockTransport(lambda request: busy)
        async with AsyncRewardClient("http://a:1", transport=transport, sleep=sleep) as client:
            await client.request("POST", "/v1/explain", {}, retry=EXPLAIN_RETRY)

    with pytest.raises(RewardServiceError, match="after 2 attempt"):
        asyncio.run(explain())
    assert len(sleeps) == 1 and 2.0 <= sleeps[0] <= 2.2


@pytest.mark.parametrize(
    "answer",
    [{"detail": "another service"}, {"explanation": {"items": []}}, {"explanation": None}],
)
def test_an_explanation_of_another_shape_costs_the_column_only(
    answer: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 from ``/v1/explain`` that holds no explanation of these items (another server
    version, another service behind the route) stopped the step with a bare ``KeyError`` or
    ``IndexError``; it costs the column only (a warning), the rewards stand."""
    import json

    from reward_server.core import RewardParams, ScoreItem, score_batch
    from tests.doubles import HashEncoder
    from trainer_client import AsyncRewardClient

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/explain":
            return httpx.Response(200, json=answer)
        body = json.loads(request.content)
        params = RewardParams.model_validate(body.get("params", {}))
        items = [ScoreItem(**item) for item in body["items"]]
        scored = score_batch(items, HashEncoder(), params=params)
        return httpx.Response(200, json={**scored.as_dict(), "encoder": "hash"})

    columns: dict[str, list[Any]] = {}
    holder = SDE2Reward("http://a:1", explain_extremes=True)

    async def step() -> list[float | None]:
        client = AsyncRewardClient("http://a:1", transport=httpx.MockTransport(handle))
        holder._client = (asyncio.get_running_loop(), client)
        return await holder.sde2(**kwargs(columns.__setitem__))

    with caplog.at_level("WARNING", logger="trainer_client.trl"):
        rewards = asyncio.run(step())
    assert len(rewards) == len(TEXTS) and all(r is not None for r in rewards)
    assert columns["sde2/explanation"] == [None] * len(TEXTS)
    assert "no sde2/explanation column this step: not an explanation" in caplog.text
