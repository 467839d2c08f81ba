"""The TRL adapter's optional log of why the best and the worst completion got their reward."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import httpx
import pytest

from reward_server.explain_report import summarize_item
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from trainer_client.trl import SDE2Reward, prompt_key

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
    step."""
    from tests.client_fixtures import running_server

    reference = asyncio.run(SDE2Reward(reward_server.url).sde2(**kwargs(lambda c, v: None)))
    extra: dict[str, list[Any]] = defaultdict(list)
    with running_server("--max-items", "2") as small:
        holder = SDE2Reward(small.url, explain_extremes=True)
        with caplog.at_level("WARNING", logger="trainer_client.trl"):
            rewards = asyncio.run(holder.sde2(**kwargs(lambda c, v: extra[c].extend(v))))
    assert rewards == pytest.approx(reference, abs=1e-6)
    assert "sde2/explanation" not in extra and "sde2/n_strat" in extra
    assert "no sde2/explanation column this step" in caplog.text and "422" in caplog.text
