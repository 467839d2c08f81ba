"""OpenRLHF 0.11.2's own rollout executor gets exact SD-E² rewards, or visibly none.

``openrlhf.utils.agent.SingleTurnAgentExecutor`` (installed from PyPI, ``--no-deps``) is run for
real against live ``sde2-reward serve`` processes, both ways OpenRLHF offers: its own HTTP call to
``/get_reward`` (``--reward.remote_url http://.../get_reward``) and the ``.py`` hook
(``--reward.remote_url trainer_client/openrlhf.py``). Only vLLM is replaced (a scripted engine,
:mod:`tests.trainer_doubles`). Rewards are compared with the in-process scorer on the same
encoder; labels arrive as strings, ints and floats, as a dataset column holds them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Installed by `make setup-dev` (openrlhf==0.11.2 --no-deps): missing, this module fails.
from openrlhf.utils import agent

from reward_server.core import ScoreItem, score_batch
from reward_server.encoders.loading import load_encoder
from tests.client_fixtures import running_server
from tests.server_process import ServerProcess, requests_served
from tests.test_client import completion
from tests.trainer_doubles import SamplingParams, ScriptedEngine, byte_level_tokenizer

pytestmark = pytest.mark.slow

HOOK = Path(__file__).resolve().parents[1] / "trainer_client" / "openrlhf.py"
KEY = "openrlhf-test-key"
PROMPT = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half "
    "as many clips in May. How many clips did she sell altogether? Answer with <strategy> "
    "blocks, then <final_answer>N</final_answer>.<|im_end|>\n<|im_start|>assistant\n"
)
COMPLETIONS = [
    completion(
        ["72", "72"],
        "72",
        ["Half of 48 is 24 sold in May; 48 + 24 = 72.", "Three halves of 48 is 72."],
    ),
    completion(
        ["70", "68"],
        "70",
        ["48 + 22 = 70, guessing May sales.", "Twice 34 is 68 if May doubled March."],
    ),
    completion(["72"], None, ["48 plus 24."]),
    "The answer is #### 72",
]
#: The same gold answer as a dataset would hold it: text, an int column, a float column.
LABELS: list[Any] = ["72", 72, 72.0]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer([PROMPT, *COMPLETIONS])


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    with running_server() as server:
        yield server


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, float]]:
    """(R_final, correct) per completion from the in-process scorer, one sample per batch."""
    encoder = load_encoder("onnx")
    out = []
    for text in COMPLETIONS:
        res = score_batch([ScoreItem(text, "72", PROMPT, None, None)], encoder, normalize=False)
        out.append((res.rewards[0], float(res.items[0].correct)))
    return out


def rollout(executor: Any, tokenizer: Any, label: Any, texts: list[str]) -> list[dict[str, Any]]:
    """One OpenRLHF rollout per text: the executor generates (scripted) and fetches the reward."""
    engine = ScriptedEngine(tokenizer, list(texts))

    async def run() -> list[dict[str, Any]]:
        # One at a time, like one vLLM request each (OpenRLHF runs them concurrently).
        return [
            await executor.execute(PROMPT, label, SamplingParams(), 2048, tokenizer, engine)
            for _ in texts
        ]

    outputs = asyncio.run(run())
    for out, text in zip(outputs, texts, strict=True):
        # What the reward saw: the executor's own decoding of prompt + response ids.
        assert tokenizer.decode(out["observation_tokens"], skip_special_tokens=False) == (
            PROMPT + text
        )
    return outputs


def check_rewards(outputs: list[dict[str, Any]], reference: list[tuple[float, float]]) -> None:
    for out, (reward, correct) in zip(outputs, reference, strict=True):
        assert out["reward"] == [pytest.approx(reward, abs=1e-6)]
        assert out["scores"] == [correct]  # correctness, for OpenRLHF's dynamic filtering
        assert out["extra_logs"]["correct"] == [correct]
    assert len({out["reward"][0] for out in outputs}) == len(outputs)  # distinct numbers


@pytest.mark.parametrize("label", LABELS, ids=["str", "int", "float"])
def test_openrlhf_http_route(
    open_server: ServerProcess, tokenizer: Any, reference: Any, label: Any
) -> None:
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=f"{open_server.url}/get_reward")
    check_rewards(rollout(executor, tokenizer, label, COMPLETIONS), reference)


def test_openrlhf_py_hook_with_a_key(
    tokenizer: Any, reference: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """``--reward.remote_url trainer_client/openrlhf.py``: the key travels, labels of any type."""
    keyed = ServerProcess(None, env={"SDE2_API_KEY": KEY}).start()
    try:
        monkeypatch.setenv("SDE2_URL", keyed.url)
        monkeypatch.setenv("SDE2_API_KEY", KEY)
        executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(HOOK))
        assert executor.reward_func is not None  # OpenRLHF loaded our file, not a URL
        for label in LABELS:
            check_rewards(rollout(executor, tokenizer, label, COMPLETIONS), reference)

        # Without the key the server refuses: OpenRLHF keeps the sample with reward None, and
        # our hook's error log says so (OpenRLHF itself logs at info level only).
        monkeypatch.delenv("SDE2_API_KEY")
        with caplog.at_level(logging.ERROR, logger="trainer_client.openrlhf"):
            [lost] = rollout(executor, tokenizer, "72", COMPLETIONS[:1])
        assert lost["reward"] is None and lost["scores"] is None
        assert "SD-E² reward lost" in caplog.text and "HTTP 401" in caplog.text

        # OpenRLHF's own HTTP call sends no key: every reward is lost (after 5 tries, 1 s apart).
        http = agent.SingleTurnAgentExecutor(remote_rm_url=f"{keyed.url}/get_reward")
        [lost] = rollout(http, tokenizer, "72", COMPLETIONS[:1])
        assert lost["reward"] is None
    finally:
        keyed.stop()


def test_openrlhf_empty_label_is_refused_not_scored(
    open_server: ServerProcess, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """No ``--data.label_key``: OpenRLHF sends ``""``; the hook fails naming the flag."""
    monkeypatch.setenv("SDE2_URL", open_server.url)
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(HOOK))
    with caplog.at_level(logging.ERROR, logger="trainer_client.openrlhf"):
        [out] = rollout(executor, tokenizer, "", COMPLETIONS[:1])
    assert out["reward"] is None
    assert "HTTP 422" in caplog.text and "--data.label_key" in caplog.text
    # The server says so too, whichever way OpenRLHF called it.
    assert "OpenRLHF drops this sample's reward" in open_server.log()


def test_openrlhf_a_label_no_answer_matches_is_scored_and_the_warning_logged(
    open_server: ServerProcess, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A label no answer matches ("####") is scored as SPEC §2 defines it; the server's warning
    (naming ``labels.0``) reaches the trainer's log through the hook, not only the server's."""
    monkeypatch.setenv("SDE2_URL", open_server.url)
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(HOOK))
    with caplog.at_level(logging.WARNING, logger="trainer_client.client"):
        [out] = rollout(executor, tokenizer, "####", COMPLETIONS[:1])
    assert out["reward"] is not None
    assert "the reward service warns: labels.0: the gold answer '####'" in caplog.text


def test_openrlhf_server_killed_mid_run(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded behaviour: a dead server leaves OpenRLHF samples with reward None; OpenRLHF's
    batching then drops every reward of a batch whose first sample lost its own, and fails on a
    later ``None`` (``openrlhf.trainer.ppo_utils.experience.make_experience_batch``)."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch

    with running_server() as server:
        monkeypatch.setenv("SDE2_URL", server.url)
        monkeypatch.setenv("SDE2_MAX_ATTEMPTS", "2")
        hook = agent.SingleTurnAgentExecutor(remote_rm_url=str(HOOK))
        http = agent.SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward")
        [before] = rollout(hook, tokenizer, 72, COMPLETIONS[:1])
        assert before["reward"] is not None
        server.kill()
        started = time.monotonic()
        [after_hook] = rollout(hook, tokenizer, 72, COMPLETIONS[:1])
        [after_http] = rollout(http, tokenizer, 72, COMPLETIONS[:1])
        assert after_hook["reward"] is None and after_http["reward"] is None
        assert time.monotonic() - started < 30

    def experience(out: dict[str, Any]) -> Any:  # as OpenRLHF's samples generator builds it
        reward = out["reward"]
        return Experience(rewards=torch.tensor([reward]) if reward is not None else None)

    lost_first = make_experience_batch([experience(after_hook), experience(before)])
    assert lost_first.rewards is None  # the good sample's reward is gone too
    with pytest.raises(TypeError):
        make_experience_batch([experience(before), experience(after_http)])


def test_openrlhf_py_hook_spreads_samples_over_the_replicas(
    tokenizer: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SDE2_URL=A,B``: the hook sends one sample a call, and every call went to A (B only
    on failover). Now they take turns, with the same rewards."""
    with running_server() as a, running_server() as b:
        monkeypatch.setenv("SDE2_URL", f"{a.url},{b.url}")
        executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(HOOK))
        check_rewards(rollout(executor, tokenizer, "72", COMPLETIONS), reference)
        served = [requests_served(s.url, "/get_reward") for s in (a, b)]
    assert served == [2, 2], served


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"rewards": [0.5], "scores": [1.0], "extra_logs": {"oc": [float("nan")]}}, "nan is not"),
        ({"rewards": [0.5], "scores": [1.0], "extra_logs": {"oc": []}}, "extra_logs.oc=\\[\\]"),
        ({"rewards": [True], "scores": [1.0], "extra_logs": {}}, "rewards.0: True is not a number"),
        ({"rewards": [0.5], "scores": [1.0]}, "extra_logs=None, not an object"),
    ],
)
def test_openrlhf_hook_refuses_an_answer_it_would_log_or_train_on_wrongly(
    answer: dict[str, Any], message: str
) -> None:
    """``extra_logs`` went to OpenRLHF's logs unchecked (a NaN, a column of another length),
    and a boolean passed for a reward."""
    from trainer_client.openrlhf import _check

    with pytest.raises(ValueError, match=message):
        _check(answer, 1)
    good = {"rewards": [0.5], "scores": [1.0], "extra_logs": {"oc": [1.0], "n_strat": [2.0]}}
    assert _check(good, 1) is good


def test_openrlhf_hook_retries_until_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's retries: until ``SDE2_REWARD_DEADLINE`` (600 s by default), not six tries
    (spent in ~15 s against a server refusing a large step with 429 for a minute); each
    variable's bad value is refused naming it."""
    from trainer_client import openrlhf
    from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy

    for var in ("SDE2_MAX_ATTEMPTS", "SDE2_REWARD_DEADLINE"):
        monkeypatch.delenv(var, raising=False)
    assert openrlhf._retry() == RetryPolicy(max_attempts=None, deadline=TRAINER_DEADLINE)
    monkeypatch.setenv("SDE2_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("SDE2_REWARD_DEADLINE", "30")
    assert openrlhf._retry() == RetryPolicy(max_attempts=2, deadline=30.0)
    bad_values = [("SDE2_MAX_ATTEMPTS", "0"), ("SDE2_MAX_ATTEMPTS", "2.5"),
                  ("SDE2_REWARD_DEADLINE", "nan"), ("SDE2_REWARD_DEADLINE", "soon")]  # fmt: skip
    for var, bad in bad_values:
        with monkeypatch.context() as env:
            env.setenv(var, bad)
            with pytest.raises(ValueError, match=rf"^{var} must be .*{bad!r}"):
                openrlhf._retry()
