"""End to end: a real reward server process, real TRL GRPOTrainer steps on SmolLM2-135M calling
it through the adapter, then ``sde2-eval`` on GSM8K test questions.

What is checked is the path of the numbers: every step's rewards are the server's (the logged
``sde2/raw_reward`` equals the weighted mean of the raw components the server returned), TRL's
advantages — the only way rewards enter the GRPO loss — are the paper's group z-scores
(population std) of exactly those rewards (``sde2-train``'s reward returns them; TRL's
``scale_rewards="none"`` keeps them), the adapter's metrics reach the trainer's logs,
checkpoints are written, and the evaluation table is computed from the server's verdicts
(checked on a hand-made run with known answers).
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.client_fixtures import (  # noqa: F401 - fixtures
    GSM8K_DIR,
    REPO,
    ServerProcess,
    reward_server,
    smollm2,
    tiny_train_argv,
)
from tests.test_client import completion
from trainer_client.results import ScoreResult
from trainer_client.train import build_parser, build_trainer

pytestmark = [pytest.mark.train, pytest.mark.slow]


def record_steps(trainer: Any, holder: Any) -> tuple[list[ScoreResult], list[torch.Tensor]]:
    """Record each reward response and the advantages TRL derives from it."""
    results: list[ScoreResult] = []
    advantages: list[torch.Tensor] = []
    score = holder.score

    async def recording_score(*args: Any, **kwargs: Any) -> list[float | None]:
        rewards = await score(*args, **kwargs)
        results.append(holder.last_result)
        return rewards

    holder.score = recording_score  # the recipe method calls self.score: this one
    generate = trainer._generate_and_score_completions

    def recording_generate(batch: Any) -> Any:
        out = generate(batch)
        advantages.append(out["advantages"].detach().clone())
        return out

    trainer._generate_and_score_completions = recording_generate
    return results, advantages


def expected_advantages(rewards: list[float], g: int) -> torch.Tensor:
    """The paper's group advantages (App. A.2, SPEC §5: population std, eps 1e-6) of the
    server's rewards, which ``sde2-train``'s reward returns and TRL keeps."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + 1e-6)).view(-1).float()


def test_grpo_trains_on_server_rewards_then_evaluates(
    reward_server: ServerProcess,  # noqa: F811
    smollm2: tuple[Path, Any, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    gguf, model, tokenizer = smollm2
    out = tmp_path / "run"
    args = build_parser().parse_args(tiny_train_argv(reward_server.url, out, gguf))
    trainer, holder = build_trainer(args, model=copy.deepcopy(model), tokenizer=tokenizer)
    results, advantages = record_steps(trainer, holder)

    started = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - started
    print(f"\n2 GRPO steps on SmolLM2-135M: {train_s:.1f} s")

    assert trainer.state.global_step == 2
    assert len(results) == 2 and len(advantages) == 2  # one generation batch per step
    logs = [h for h in trainer.state.log_history if "rewards/sde2/mean" in h]
    assert len(logs) == 2
    for result, adv, log in zip(results, advantages, logs, strict=True):
        assert len(result) == 4  # 2 prompts x 2 completions
        raw = sum(sum(v) for v in result.components.values()) / 4  # sde2's weights: 1
        assert log["sde2/raw_reward"] == pytest.approx(raw, abs=1e-5)
        assert log["rewards/sde2/mean"] == pytest.approx(0.0, abs=1e-5)  # the advantages'
        assert torch.allclose(adv, expected_advantages(result.rewards, 2), atol=1e-5)
        for key in ("oc", "re", "fa", "sd"):
            assert log[f"sde2/{key}"] == pytest.approx(sum(result.components[key]) / 4, abs=1e-6)
        assert log["sde2/s_acc"] == pytest.approx(result.strategy_accuracy, abs=1e-6)
        assert {"sde2/n_strat", "sde2/uniq", "sde2/acc"} <= set(log)
        assert math.isfinite(log["loss"])
        # every item carried its prompt's group: two groups of two
        assert result.advantages is not None
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()

    # The untrained 135M model ignores the schema, so its rewards above may all be equal. Push
    # schema-following completions through TRL's own reward path (its async loop included) to
    # see distinct rewards arrive intact as the trainer's reward tensor.
    texts = [
        completion(["18", "20"], "18", ["16 - 3 - 4 = 9 eggs sold at $2 each", "a rough guess"]),
        completion(["20"], "20", ["Assume every egg is sold."]),
        "Janet makes #### 18",
        completion(["18"], "18", ["Eggs left: 16 - 7 = 9, times 2 dollars."]),
    ]
    prompts = [[{"role": "user", "content": "Janet?"}]] * 4
    inputs = [{"answer": "18", "answer_type": "numeric", "question": "Janet?"}] * 4
    ids = [[1] * (5 + i) for i in range(4)]
    got = trainer._calculate_rewards(
        inputs, prompts, [[{"role": "assistant", "content": t}] for t in texts], ids
    )
    direct = results[-1]  # recorded by the same holder for this call
    assert direct.advantages is not None  # what the reward returns to TRL
    assert got[:, 0].tolist() == pytest.approx(direct.advantages, abs=1e-5)
    assert len({round(r, 4) for r in direct.rewards}) == 4  # all distinct: not a degenerate check
    assert direct.items[0].correct and not direct.items[1].correct
    trainer.save_model(str(out / "final"))
    assert (out / "final" / "adapter_config.json").is_file()

    # --- sde2-eval: the trained adapter on 3 GSM8K test questions, plus a known run ----------
    known = tmp_path / "known.jsonl"
    right = completion(["18", "20"], "18", ["16 - 3 - 4 = 9 eggs, 9 * 2 = 18", "guess 20"])
    wrong = completion(["5"], "5", ["Misread the question entirely."])
    rows = [{"completion": right, "answer": "18"}, {"completion": wrong, "answer": "3"}]
    known.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = tmp_path / "eval.json"
    cmd = [
        sys.executable, "-m", "trainer_client.evaluate",
        "--reward-url", reward_server.url,
        "--model", str(gguf), "--adapter", str(out / "final"), "--method", "smollm2-grpo",
        "--data", str(GSM8K_DIR), "--split", "test", "--limit", "3",
        "--max-new-tokens", "12", "--batch-size", "3",
        "--completions", f"known={known}",
        "--json", str(report), "--plot", str(tmp_path / "acc_vs_tok.png"), "--ci", "wilson",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    print(f"sde2-eval (3 questions + 1 read run): {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "| Method | N | ACC (%) | 95% CI | S-ACC (%) | #STR | #TOK | Words | Uniq |" in proc.stdout
    )
    runs = {r["method"]: r for r in json.loads(report.read_text())["runs"]}
    gen = runs["smollm2-grpo"]
    assert gen["n"] == 3 and 0 <= gen["ci_low"] <= gen["acc"] <= gen["ci_high"] <= 100
    assert 0 < gen["tokens"] <= 13  # counted with the policy's tokenizer, capped by generation
    k = runs["known"]
    assert (k["n"], k["correct"], k["acc"], k["s_acc"]) == (2, 1, 50.0, 50.0)
    assert k["n_str"] == 1.5 and k["uniq"] == pytest.approx(1.5)
    assert k["ci_low"] == pytest.approx(9.45, abs=0.01) and k["ci_high"] == pytest.approx(
        90.55, abs=0.01
    )
    assert k["tokens"] is not None and k["tokens"] > 10  # tokenized with --model's tokenizer
    # matplotlib comes with the train extra; in a client-only install the run still succeeds
    # and says why there is no plot.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stderr
        assert not (tmp_path / "acc_vs_tok.png").exists()
    else:
        assert (tmp_path / "acc_vs_tok.png").stat().st_size > 1000


def test_a_failure_at_step_0_does_not_advise_resuming(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reward server goes away after sde2-train's start-up probe: training stops at step 0
    with no checkpoint, and the exit message told the user to rerun with --resume, when there
    was nothing to resume."""
    import threading

    from tests.client_fixtures import running_server, smollm2_gguf
    from tests.server_process import requests_served
    from trainer_client.train import main

    with running_server() as server:

        def kill_after_the_probe() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if requests_served(server.url, "/v1/info") >= 1:
                    server.kill()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=kill_after_the_probe, daemon=True)
        watcher.start()
        argv = tiny_train_argv(server.url, tmp_path / "run", smollm2_gguf())
        with caplog.at_level("ERROR", logger="sde2.train"):
            status = main([*argv, "--reward-retries", "2", "--reward-deadline", "5"])
        watcher.join(timeout=5)
    assert status == 2
    assert "training stopped at step 0" in caplog.text
    assert "no checkpoint was saved" in caplog.text and "--resume" not in caplog.text
