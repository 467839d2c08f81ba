"""The TRL reward adapter meets TRL 1.16's reward-function contract, against a real server.

Contract (TRL 1.16 GRPOTrainer, read in its source): called with keyword arguments ``prompts``,
``completions``, ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and every
dataset column; returns one ``float | None`` per completion; ``async def`` functions are detected
with ``inspect.iscoroutinefunction`` (TRL's ``is_async_callable``) and awaited on TRL's loop.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import pickle
import subprocess
import sys
from collections import defaultdict
from typing import Any

import httpx
import pytest

from reward_server.core import RewardParams
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.server_process import free_port
from tests.test_client import completion
from trainer_client import RewardClient
from trainer_client.retry import RewardServiceError
from trainer_client.trl import SDE2Reward, sde2_reward
from trainer_client.trl_inputs import completion_text, prompt_key

pytestmark = pytest.mark.slow

GOOD = completion(
    ["72", "72"],
    "72",
    [
        "Half of 48 is 24 sold in May; 48 + 24 = 72.",
        "Treat April as two halves: three halves of 48 is 72.",
    ],
)
PARTIAL = completion(["70"], "70", ["48 + 22 = 70, guessing May sales."])
PLAIN = "The answer is #### 72"


def call_kwargs(texts: list[str], prompts: list[Any], conversational: bool = False) -> dict:
    completions: list[Any] = (
        [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    )
    return {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [list(range(10 * (i + 1))) for i in range(len(texts))],
        "answer": ["72"] * len(texts),
        "question": ["q"] * len(texts),
        "trainer_state": None,
    }


def test_signature_async_detection_and_name(reward_server: ServerProcess) -> None:  # noqa: F811
    from trl.trainer.utils import get_callable_name, is_async_callable

    fn = sde2_reward(reward_server.url)
    assert inspect.iscoroutinefunction(fn) and is_async_callable(fn)
    assert fn.__name__ == "sde2" and get_callable_name(fn) == "sde2"
    assert sde2_reward(reward_server.url, recipe="cfee").__name__ == "cfee"
    params = inspect.signature(fn).parameters
    assert {"prompts", "completions"} <= set(params)
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_pickles_before_and_after_use(reward_server: ServerProcess) -> None:  # noqa: F811
    fn = sde2_reward(reward_server.url, similarity_threshold=0.75)
    kw = call_kwargs([GOOD, PARTIAL], ["p", "p"])
    first = asyncio.run(fn(**kw))  # creates a client bound to this loop
    clone = pickle.loads(pickle.dumps(fn))
    assert inspect.iscoroutinefunction(clone) and clone.__name__ == "sde2"
    assert clone.__self__.params == {"similarity_threshold": 0.75}
    assert asyncio.run(clone(**kw)) == pytest.approx(first)
    # the original keeps working on a new loop (a fresh client per loop)
    assert asyncio.run(fn(**kw)) == pytest.approx(first)


def test_rewards_match_the_server(reward_server: ServerProcess) -> None:  # noqa: F811
    fn = sde2_reward(reward_server.url)
    texts = [GOOD, PARTIAL, PLAIN, GOOD]
    prompts = ["p1", "p1", "p2", "p2"]
    rewards = asyncio.run(fn(**call_kwargs(texts, prompts)))
    items = [
        {"completion": t, "answer": "72", "group": prompt_key(p), "num_tokens": 10 * (i + 1)}
        for i, (t, p) in enumerate(zip(texts, prompts, strict=True))
    ]
    with RewardClient(reward_server.url) as rc:
        expected = rc.score(items, diagnostics=True)
    assert rewards == pytest.approx(expected.rewards)
    assert len(set(rewards)) >= 3  # normalized over the call: distinct completions differ
    assert all(isinstance(r, float) for r in rewards)


def test_by_default_a_call_rides_out_a_server_that_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter's default retry was the client's six tries (about 15-30 s): a replica's
    restart or a minute of 429s ended the user's TRL run, where ``sde2-train`` and the verl
    and OpenRLHF hooks wait up to 600 s. The server here starts 20 s after the call: the
    call waits for it and returns its rewards. A 401 is not retried, and says what to set."""
    import threading

    monkeypatch.delenv("SDE2_API_KEY", raising=False)
    server = ServerProcess(None)
    fn = sde2_reward(server.url)
    threading.Timer(20, server.start, kwargs={"wait": False}).start()
    try:
        rewards = asyncio.run(fn(**call_kwargs([GOOD, PARTIAL], ["p", "p"])))
        assert len(rewards) == 2 and rewards[0] > rewards[1]
    finally:
        server.stop()
    keyed = ServerProcess(None, env={"SDE2_API_KEY": "the-key"}).start()
    try:
        for key, problem in ((None, "this client has none"), ("other", "refused the API key")):
            with pytest.raises(RewardServiceError) as refused:
                asyncio.run(sde2_reward(keyed.url, api_key=key)(**call_kwargs([GOOD], ["p"])))
            message = str(refused.value)
            assert problem in message and "set SDE2_API_KEY" in message and "api_key=" in message
            assert len(refused.value.attempts) == 1
    finally:
        keyed.stop()


def test_conversational_equals_standard(reward_server: ServerProcess) -> None:  # noqa: F811
    fn = sde2_reward(reward_server.url)
    texts = [GOOD, PARTIAL, PLAIN]
    prompts_std = ["Q?"] * 3
    prompts_conv = [[{"role": "user", "content": "Q?"}]] * 3
    standard = asyncio.run(fn(**call_kwargs(texts, prompts_std)))
    conversational = asyncio.run(fn(**call_kwargs(texts, prompts_conv, conversational=True)))
    assert conversational == pytest.approx(standard)
    assert (
        completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}]) == "a"
    )


def test_reasoning_content_is_scored_with_the_content(reward_server: ServerProcess) -> None:  # noqa: F811
    """A chat template with a response schema returns the reasoning apart from the content."""
    fn = sde2_reward(reward_server.url)
    head, tail = GOOD.split("<final_answer>")
    split = [[{"role": "assistant", "reasoning_content": head, "content": "<final_answer>" + tail}]]
    kw = call_kwargs([GOOD, PARTIAL], ["Q?"] * 2)
    whole = asyncio.run(fn(**kw))
    kw["completions"] = [*split, [{"role": "assistant", "content": PARTIAL}]]
    assert asyncio.run(fn(**kw)) == pytest.approx(whole)
    assert completion_text(split[0]) == head + "\n<final_answer>" + tail
    only_content = [[{"role": "assistant", "content": "<final_answer>" + tail}]]
    kw["completions"] = [*only_content, [{"role": "assistant", "content": PARTIAL}]]
    assert asyncio.run(fn(**kw)) != pytest.approx(whole)  # without the reasoning: no strategies


def test_reasoning_under_every_name_transformers_uses(reward_server: ServerProcess) -> None:  # noqa: F811
    """TRL's gpt-oss response template puts the reasoning in ``thinking`` (transformers reads
    ``reasoning_content``, ``thinking`` and ``reasoning`` as one): parsed by transformers' own
    parser with TRL's own template, the reasoning is scored (it was dropped: reward -3, not +3)."""
    from transformers.utils.chat_parsing.response_parser import parse_response
    from trl.chat_template_utils import gptoss_template

    head, tail = GOOD.split("<final_answer>")
    output = (
        f"<|channel|>analysis<|message|>{head}<|end|><|start|>assistant<|channel|>final"
        f"<|message|><final_answer>{tail}<|return|>"
    )
    parsed = parse_response(output, gptoss_template, prefix="<|start|>assistant")
    assert parsed.get("thinking") == head  # what TRL hands the reward function
    assert completion_text([parsed]) == head + "\n<final_answer>" + tail
    fn = sde2_reward(reward_server.url)
    kw = call_kwargs([GOOD, PARTIAL], ["Q?"] * 2)
    whole = asyncio.run(fn(**kw))
    for field in ("thinking", "reasoning"):
        message = {"role": "assistant", field: head, "content": "<final_answer>" + tail}
        kw["completions"] = [[message], [{"role": "assistant", "content": PARTIAL}]]
        assert asyncio.run(fn(**kw)) == pytest.approx(whole), field


def test_no_nan_reaches_log_metric(reward_server: ServerProcess) -> None:  # noqa: F811
    """By default (no diagnostics) Uniq of multi-strategy completions with a correct strategy is
    never computed: the uniq metric is left out rather than logged as NaN (NaN poisons TRL's
    average across processes)."""
    metrics: dict[str, list[float]] = defaultdict(list)
    holder = SDE2Reward(reward_server.url)
    kw = call_kwargs([GOOD, GOOD], ["p"] * 2)
    kw["log_metric"] = lambda name, value: metrics[name].append(value)
    asyncio.run(holder.sde2(**kw))
    assert "sde2/uniq" not in metrics and "sde2/acc" in metrics
    assert not any(math.isnan(v) for values in metrics.values() for v in values)


def encoder_lookups(url: str) -> float:
    """Texts the server's reward asked its (cached) encoder for so far: hits plus misses."""
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sde2_cache_lookups_total{")
    )


def test_default_costs_no_encoder_work_beyond_the_reward(reward_server: ServerProcess) -> None:  # noqa: F811
    """The adapter's default request asks the encoder for exactly what a reward-only request
    does; the full diagnostics are an opt-in that costs more."""
    wrong = completion(["70", "68"], "70", ["48 + 22 = 70, a guess.", "Twice 34 is 68."])
    texts = [GOOD, wrong, GOOD.replace("Half", "One half"), PLAIN]
    kw = call_kwargs(texts, ["p", "p", "q", "q"])
    items = [{"completion": t, "answer": "72"} for t in texts]

    def cost(call: Any) -> float:
        before = encoder_lookups(reward_server.url)
        call()
        return encoder_lookups(reward_server.url) - before

    with RewardClient(reward_server.url) as rc:
        bare = cost(lambda: rc.score(items))
    default = cost(lambda: asyncio.run(sde2_reward(reward_server.url)(**kw)))
    full = cost(lambda: asyncio.run(sde2_reward(reward_server.url, diagnostics=True)(**kw)))
    assert default == bare > 0  # the wrong two-strategy completion's reward needs the encoder
    assert full > default  # the correct multi-strategy completions' Uniq, computed on request
    # What `uniq` averages by default: the wrong one and the plain one (m = 0), not the two
    # correct multi-strategy ones.
    metrics: dict[str, float] = {}
    kw["log_metric"] = metrics.__setitem__
    asyncio.run(sde2_reward(reward_server.url)(**kw))
    assert metrics["sde2/uniq_coverage"] == 2 / 4
    assert metrics["sde2/uniq"] == pytest.approx((2 + 0) / 2)


def test_num_tokens_come_from_completion_ids(reward_server: ServerProcess) -> None:  # noqa: F811
    holder = SDE2Reward(reward_server.url, recipe="cfl", params={"length_target": 10})
    kw = call_kwargs([PLAIN, PLAIN, PLAIN], ["p"] * 3)
    kw["completion_ids"] = [[0] * 5, [0] * 15, [0] * 40]
    asyncio.run(holder.cfl(**kw))
    assert holder.last_result is not None
    # len = -min(1, max(0, l - 10) / 10) with l the token count, not the 5 words of PLAIN
    assert holder.last_result.components["len"] == pytest.approx([0.0, -0.5, -1.0])


def test_lengths_are_words_when_a_completion_holds_tool_turns(
    reward_server: ServerProcess,  # noqa: F811
) -> None:
    """TRL's ``completion_ids`` hold the tool results' tokens too (it masks them in its own
    lengths but does not pass the mask): a completion was penalized for a tool's output. With
    a tool turn in the call every length is the words of the model's own text."""
    holder = SDE2Reward(reward_server.url, recipe="cfl", params={"length_target": 10})
    said = [{"role": "assistant", "content": PLAIN}]
    tool = [
        said[0],
        {"role": "tool", "content": "x " * 500},
        {"role": "assistant", "content": "ok"},
    ]
    kw = call_kwargs([PLAIN, PLAIN], ["p"] * 2)
    kw.update(completions=[said, tool], completion_ids=[[0] * 4, [0] * 900])
    asyncio.run(holder.cfl(**kw))
    assert holder.last_result is not None
    # 5 and 6 words of the model's (the tool's 500 not counted), both under the target of 10
    assert holder.last_result.components["len"] == pytest.approx([0.0, 0.0])
    kw.update(completions=[said, said])  # no tool turn: TRL's token counts stand
    asyncio.run(holder.cfl(**kw))
    assert holder.last_result.components["len"] == pytest.approx([0.0, -1.0])


def test_prompts_with_images_are_grouped_by_their_pixels(
    reward_server: ServerProcess,  # noqa: F811
) -> None:
    """TRL puts a vision prompt's PIL images in its messages; ``json.dumps`` of them failed on
    the first reward call of every such run."""
    from PIL import Image

    def prompt(color: str) -> list[dict[str, Any]]:
        image = Image.new("RGB", (4, 4), color)
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "How many?"}]}]  # fmt: skip

    assert prompt_key(prompt("red")) == prompt_key(prompt("red")) != prompt_key(prompt("blue"))
    rewards = asyncio.run(
        sde2_reward(reward_server.url)(**call_kwargs([GOOD, PLAIN], [prompt("red")] * 2))
    )
    assert len(rewards) == 2 and rewards[0] is not None


def test_groups_follow_identical_prompts(reward_server: ServerProcess) -> None:  # noqa: F811
    holder = SDE2Reward(reward_server.url)
    a = [{"role": "user", "content": "A"}]
    b = [{"role": "user", "content": "B"}]
    prompts = [a, b, [dict(m) for m in a], b]
    asyncio.run(holder.sde2(**call_kwargs([GOOD, GOOD, PLAIN, PARTIAL], prompts)))
    adv = holder.last_result.advantages if holder.last_result else None
    assert adv is not None
    # advantages are z-scores within {0, 2} and {1, 3}: each pair is ±1 (up to eps)
    assert adv[0] == pytest.approx(-adv[2]) and adv[1] == pytest.approx(-adv[3])
    assert abs(adv[0]) == pytest.approx(1.0, abs=1e-3)
    assert prompt_key(a) == prompt_key([dict(m) for m in a]) != prompt_key(b)


def test_log_metric_and_log_extra(reward_server: ServerProcess) -> None:  # noqa: F811
    metrics: dict[str, list[float]] = defaultdict(list)
    extra: dict[str, list[Any]] = defaultdict(list)
    # Uniq of every completion; a weight other than 1 shows in the raw reward
    holder = SDE2Reward(reward_server.url, diagnostics=True, params={"weights": {"sd": 0.5}})
    texts = [GOOD, PARTIAL, PLAIN, ""]
    kw = call_kwargs(texts, ["p"] * 4)
    kw["log_metric"] = lambda name, value: metrics[name].append(value)
    kw["log_extra"] = lambda col, values: extra[col].extend(values)
    asyncio.run(holder.sde2(**kw))
    res = holder.last_result
    assert res is not None
    expected_keys = {
        f"sde2/{k}"
        for k in (
            "raw_reward", "oc", "re", "fa", "sd", "acc", "s_acc", "n_strat", "uniq",
            "uniq_coverage",
        )
    }  # fmt: skip
    assert set(metrics) == expected_keys
    # Σ_k w_k · mean(R_k), not R_final's mean (0 by construction: each R̃_k is zero-mean)
    c = res.components
    raw = sum(sum(c[k]) / 4 for k in ("oc", "re", "fa")) + 0.5 * sum(c["sd"]) / 4
    assert raw > 0.1 and abs(sum(res.rewards) / 4) < 1e-9
    assert metrics["sde2/raw_reward"] == [pytest.approx(raw)]
    assert extra["sde2/reward"] == pytest.approx(res.rewards)
    assert metrics["sde2/oc"] == [pytest.approx(1 / 4)]  # only GOOD is right (PLAIN: no tags)
    assert metrics["sde2/acc"] == [pytest.approx(1 / 4)]
    assert metrics["sde2/s_acc"] == [pytest.approx(1 / 4)]
    assert metrics["sde2/n_strat"] == [pytest.approx((2 + 1 + 0 + 0) / 4)]
    assert metrics["sde2/uniq"] == [pytest.approx((2 + 1 + 0 + 0) / 4)]
    assert metrics["sde2/uniq_coverage"] == [1.0]  # diagnostics: every completion's Uniq
    assert metrics["sde2/fa"] == [pytest.approx(sum(res.components["fa"]) / 4)]
    assert extra["sde2/n_strat"] == [2, 1, 0, 0]
    assert extra["sde2/correct"] == [True, False, False, False]
    assert extra["sde2/final_answer"] == ["72", "70", None, None]
    assert all(len(v) == 4 for v in extra.values())
    assert not any(math.isnan(v[0]) for v in metrics.values())


def test_missing_answer_column_is_a_clear_error(reward_server: ServerProcess) -> None:  # noqa: F811
    fn = sde2_reward(reward_server.url, answer_column="solution")
    with pytest.raises(KeyError, match="solution"):
        asyncio.run(fn(**call_kwargs([GOOD], ["p"])))


def test_a_completion_of_another_type_names_its_row(reward_server: ServerProcess) -> None:  # noqa: F811
    """``None`` or a number among the completions was a bare TypeError from deep inside."""
    fn = sde2_reward(reward_server.url)
    for bad, kind in ((None, "got NoneType"), (5, "got int"), ([5], "messages are mappings")):
        with pytest.raises(ValueError, match=rf"completions, row 1: .*{kind}"):
            asyncio.run(fn(**call_kwargs([GOOD, bad], ["p", "p"])))


def test_bad_params_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="similarity_threshold"):
        sde2_reward("http://127.0.0.1:1", similarity_threshold=1.5)
    # A misspelt parameter was pydantic's whole report, its docs link included.
    hint = r"^params\.similarity_treshold: .* \(did you mean 'similarity_threshold'\?\)$"
    with pytest.raises(ValueError, match=hint):
        sde2_reward("http://127.0.0.1:1", similarity_treshold=0.8)
    with pytest.raises(ValueError, match="recipe"):
        sde2_reward("http://127.0.0.1:1", recipe="nope")
    # The server's address and the matcher too: each failed only at the first reward call,
    # after the model had loaded and the first generation had run.
    with pytest.raises(ValueError, match="http://"):
        sde2_reward("127.0.0.1:8000")
    with pytest.raises(ValueError, match=r"answer_type must be one of .*'numerc'"):
        sde2_reward("http://127.0.0.1:1", answer_type="numerc")
    # A weight of a component the recipe lacks changed nothing (sde2-train refused it).
    with pytest.raises(ValueError, match=r"params\.weights\.sd: not a component of recipe 'cfl'"):
        sde2_reward("http://127.0.0.1:1", recipe="cfl", weights={"sd": 0})
    with pytest.raises(ValueError, match=r"params\.weights\.rd: not a component of recipe 'sde2'"):
        SDE2Reward("http://127.0.0.1:1", params=RewardParams(weights={"rd": 0.5}))


def test_verl_compute_score(reward_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from trainer_client import verl

    out = verl.compute_score("openai/gsm8k", GOOD, "72", {"reward_url": reward_server.url})
    # oc + re + fa (min(1, 0.2·2) + 0.3 + 0.1) + sd (collapse bonus), unnormalized
    assert out["score"] == pytest.approx(1.0 + 1.0 + 0.8 + 1.0)
    assert out["acc"] == 1.0 and out["n_strat"] == 2
    monkeypatch.setenv("SDE2_URL", reward_server.url)
    med = verl.compute_score("medmcqa", "<final_answer>(B)</final_answer>", "B")
    assert med["acc"] == 1.0
    # verl judges MATH's expressions by equivalence; read as digits, "32" matched this gold.
    gold = "\\frac{\\sqrt{3}}{2}"
    for said, acc in (("32", 0.0), ("\\frac{\\sqrt3}{2}", 1.0)):
        got = verl.compute_score("lighteval/MATH", f"<final_answer>{said}</final_answer>", gold)
        assert got["acc"] == acc, said
    got = asyncio.run(verl.compute_score_async("gsm8k", PARTIAL, 72, recipe="cfee"))
    assert set(got) >= {"score", "oc", "fa", "re", "rd"} and got["acc"] == 0.0
    monkeypatch.delenv("SDE2_URL")
    with pytest.raises(ValueError, match="SDE2_URL"):
        verl.compute_score("gsm8k", GOOD, "72")
    # Several replicas in one string (an env var): a dead one costs a retry, not the sample.
    dead = f"http://127.0.0.1:{free_port()}"
    both = {"reward_url": f"{dead},{reward_server.url}"}
    assert verl.compute_score("openai/gsm8k", GOOD, "72", both)["score"] == out["score"]


def test_a_step_warning_is_logged_once_with_its_item(
    reward_server: ServerProcess,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In one process the adapter tells each step's warnings, naming the item in the step,
    each kind once however many steps repeat it."""
    fn = sde2_reward(reward_server.url)
    kwargs = {**call_kwargs([GOOD, PLAIN], ["p", "p"]), "answer": ["72", "####"]}

    async def two_steps() -> None:  # on one loop, as TRL runs its reward functions
        for _ in range(2):
            await fn(**kwargs)

    with caplog.at_level("WARNING", logger="trainer_client"):
        asyncio.run(two_steps())
    told = [r.getMessage() for r in caplog.records if "reward service warns" in r.message]
    assert len(told) == 1 and told[0].startswith("the reward service warns: items.1.answer:")


def test_gold_answers_from_numbers_and_missing_ones(reward_server: ServerProcess) -> None:  # noqa: F811
    """A float gold is written out in plain decimal (``str(1e-05)`` would be the gold -5 to
    SPEC §2's ``N``); a missing one is an error naming the column and row, not the gold
    ``"None"`` that no answer matches."""
    fn = sde2_reward(reward_server.url, diagnostics=True)
    holder = fn.__self__  # type: ignore[attr-defined]
    texts = [completion(["0.00001"], "0.00001"), completion(["2"], "20000000000000000")]
    kwargs = {**call_kwargs(texts, ["p", "q"]), "answer": [1e-05, 2e16]}
    asyncio.run(fn(**kwargs))
    assert [it.correct for it in holder.last_result.items] == [True, True]
    kwargs["answer"] = [1e-05, None]
    with pytest.raises(ValueError, match=r"'answer', row 1: the gold answer is missing"):
        asyncio.run(fn(**kwargs))
    from trainer_client import verl

    url = {"reward_url": reward_server.url}
    assert verl.compute_score("gsm8k", texts[0], 1e-05, url)["acc"] == 1.0
    with pytest.raises(ValueError, match="ground_truth of a 'gsm8k' sample: the gold answer"):
        verl.compute_score("gsm8k", texts[0], None, url)


def test_a_cancelled_call_gives_up_its_turn_at_the_gather(
    reward_server: ServerProcess,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under several processes the calls gather in the order they began; a call cancelled
    while its request ran kept its turn, and every later gather on the loop (this step's other
    reward function, the next steps') waited for it forever. One process stands in for the
    group here: the gather hands back this process's own part."""
    from trainer_client import trl

    monkeypatch.setattr(trl, "process_group", lambda: "group")
    monkeypatch.setattr(trl, "all_gather", lambda obj: [obj])
    monkeypatch.setattr(trl, "process_rank", lambda: 0)
    stuck, other = SDE2Reward(reward_server.url), SDE2Reward(reward_server.url)

    async def step() -> list[float | None]:
        client = stuck._get_client()

        async def never(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(3600)

        client.score = never  # type: ignore[method-assign]
        kw = call_kwargs([GOOD, PLAIN], ["p"] * 2)
        first = asyncio.ensure_future(stuck.sde2(**kw))  # takes the first turn
        second = asyncio.ensure_future(other.sde2(**kw))
        await asyncio.sleep(0.5)
        first.cancel()
        await asyncio.wait_for(second, 30)
        return await asyncio.wait_for(other.sde2(**kw), 30)  # and the next step's

    rewards = asyncio.run(step())
    assert len(rewards) == 2 and rewards[0] is not None


def test_prompt_parts_group_alike_in_every_process() -> None:
    """A prompt part JSON cannot write was keyed by its repr: a set's order follows the hash
    seed (each process grouped the same prompt apart), and an object's default repr is its
    address (every call did)."""
    tags = {"alpha", "beta", "gamma", "delta"}
    nested = {frozenset({"a", "z"}), frozenset({"m", "q"})}
    prompt = [{"role": "user", "content": "A", "tags": tags, "nested": nested}]
    code = f"from trainer_client.trl_inputs import prompt_key; print(prompt_key({prompt!r}))"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout
        for seed in ("1", "2", "3", "4")
    }  # fmt: skip
    assert len(keys) == 1

    class Opaque:
        pass

    with pytest.raises(ValueError, match=r"prompt holds a Opaque.*its repr is its address"):
        prompt_key([{"role": "user", "content": "A", "extra": Opaque()}])


def test_a_prompt_without_content_is_refused_naming_its_row(
    reward_server: ServerProcess,  # noqa: F811
) -> None:
    prompts = ["p", [{"role": "user", "content": "A", "extra": object()}]]
    with pytest.raises(ValueError, match=r"^prompts, row 1: a prompt holds a object"):
        asyncio.run(sde2_reward(reward_server.url)(**call_kwargs([GOOD, PLAIN], prompts)))
