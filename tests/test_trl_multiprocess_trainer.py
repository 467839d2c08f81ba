"""TRL's own ``GRPOTrainer`` under 2 CPU processes: one prompt's group spans both, rewards exact.

``accelerate launch`` starts 2 processes running ``sde2-train``'s trainer (via
``tests/trl_multiprocess_step.py``) on SmolLM2-135M for one step against a live reward server.
With ``--batch-size 3`` and 2 generations per prompt, TRL's ``RepeatSampler`` deals the step's 3
prompts × 2 completions as ``[A, A, B | B, C, C]``: prompt B's group is split across the processes.
Each process records what its reward function received and returned; the whole step is then sent
as ONE ``/v1/score`` request, and every completion's value — as returned by the reward function
on its process and as TRL gathered it — must equal that request's group advantage (what
``sde2-train``'s reward returns: the paper's, over TRL's groups).

Why ``--multi_gpu`` on a CPU machine: ``accelerate launch --cpu --num_processes 2`` starts one
process unless an MPI launcher is configured (``--mpirun_hostfile``); ``--multi_gpu`` is the
torchrun launcher, and with ``use_cpu`` (which ``sde2-train`` sets without CUDA) accelerate then
joins the processes in a gloo group (``MULTI_CPU``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.client_fixtures import (  # noqa: F401 - fixture
    REPO,
    ServerProcess,
    reward_server,
    smollm2_gguf,
    tiny_train_argv,
)
from tests.server_process import free_port
from trainer_client import RewardClient, train
from trainer_client.trl_inputs import completion_text, prompt_key

pytestmark = [pytest.mark.train, pytest.mark.slow]

WORLD = 2


#: The step's reward recipe and parameters (as ``sde2-train`` flags and in the request).
RECIPE = "cfl"
PARAMS = {"length_target": 10}
#: Questions whose answers take very different numbers of tokens (SmolLM2 ends a short answer
#: early), so that the step's rewards differ between completions: with 16 new tokens a 135M
#: model writes nothing the SD-E² parser finds, and equal rewards would be equal whatever each
#: process normalized over. ``cfl``'s length component (from TRL's ``completion_ids``) tells them
#: apart; the gather path under test is the same for every recipe.
QUESTIONS = (
    "Reply with the single word: yes",
    "Write the numbers from one to five in words, separated by commas.",
    "Write a long story about a dragon.",
)


def questions(path: Path) -> Path:
    """The questions as a GSM8K-style jsonl file (``--data``)."""
    rows = [{"question": q, "answer": f"#### {i}"} for i, q in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def launch(url: str, out: Path) -> subprocess.CompletedProcess[str]:
    """One GRPO step of ``sde2-train``'s trainer in 2 processes started by ``accelerate launch``."""
    argv = tiny_train_argv(url, out / "run", smollm2_gguf())
    argv += ["--data", str(questions(out / "questions.jsonl")), "--max-new-tokens", "16"]
    argv += ["--recipe", RECIPE, *(f"--param={k}={v}" for k, v in PARAMS.items())]
    argv += ["--max-steps", "1", "--batch-size", "3", "--save-steps", "100", "--beta", "0"]
    return launched("tests.trl_multiprocess_step", str(out), *argv)


def launched(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m module argv`` in :data:`WORLD` processes started by ``accelerate launch``."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", module, *argv,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def sde2_train_launched(tmp_path: Path, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``sde2-train`` itself in :data:`WORLD` processes on a tiny Qwen2 saved in
    ``tmp_path/tiny``: steps of 3 prompts x 2 completions of 8 tokens, into ``tmp_path/run``."""
    from tests.tiny_models import tiny_qwen2

    model = tiny_qwen2(tmp_path / "tiny", chat=True)
    return launched(
        "trainer_client.train",
        "--model", str(model), "--reward-url", url,
        "--data", str(questions(tmp_path / "questions.jsonl")),
        "--num-generations", "2", "--batch-size", "3", "--max-new-tokens", "8",
        "--save-steps", "100", "--no-gradient-checkpointing",
        "--output-dir", str(tmp_path / "run"), *flags,
    )  # fmt: skip


def test_sde2_train_on_two_processes_writes_the_runs_files_once(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``sde2-train`` itself under ``accelerate launch``: both processes wrote the run's record,
    the final adapter's record and the log history at once, and both said so."""
    proc = sde2_train_launched(tmp_path, reward_server.url, "--max-steps", "1")
    out, model = tmp_path / "run", tmp_path / "tiny"
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert said.count("saved the LoRA adapter to") == 1, said[-4000:]
    assert (out / "final" / "adapter_config.json").is_file()
    for record in (out / "sde2_training.json", out / "final" / "sde2_training.json"):
        assert json.loads(record.read_text())["model"] == str(model)
    assert any("loss" in h for h in json.loads((out / "log_history.json").read_text()))


def test_a_reward_outage_under_two_processes_saves_one_whole_checkpoint(tmp_path: Path) -> None:
    """The server dies after step 1 of a 2-process ``sde2-train``: every process saved, but the
    second went on to exit while the first was still writing (the launcher then stopped the
    first mid-save: a checkpoint without its state), and said there was no checkpoint."""
    import re
    import threading

    from tests.client_fixtures import running_server
    from tests.server_process import requests_served

    out = tmp_path / "run"
    with running_server() as server:

        def kill_after_step_1() -> None:  # each process sends its step's request
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if requests_served(server.url, "/v1/score") >= WORLD:
                    server.kill()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=kill_after_step_1, daemon=True)
        watcher.start()
        proc = sde2_train_launched(
            tmp_path, server.url, "--max-steps", "50", "--reward-deadline", "4"
        )
        watcher.join(timeout=5)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-4000:]
    assert "no checkpoint was saved" not in said and "was not saved whole" not in said
    (last,) = re.findall(r"last checkpoint: (\S+); fix the reward service", said)
    checkpoint = Path(last)
    assert checkpoint.parent == out and train.checkpoint_step(checkpoint) >= 1
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state_0.pth"):
        assert (checkpoint / name).is_file(), name
    assert (checkpoint / "rng_state_1.pth").is_file()


def calls(out: Path, rank: int) -> list[dict[str, Any]]:
    """The reward calls recorded on one rank."""
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_grpo_trainer_on_two_processes_gets_the_one_request_rewards(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    start = time.monotonic()
    proc = launch(reward_server.url, tmp_path)
    took = time.monotonic() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [calls(tmp_path, r) for r in range(WORLD)]
    assert [len(c) for c in ranks] == [1, 1], "one step: one reward call per process"
    step = [c[0] for c in ranks]
    assert all(c["world_size"] == WORLD for c in step)
    assert [len(c["rewards"]) for c in step] == [3, 3]

    # The step as one request, in rank order (TRL's gather order), grouped by prompt as the
    # adapter groups (prompt_key), with the same options (the flags above).
    items = [
        {"completion": completion_text(comp), "answer": answer, "group": prompt_key(prompt),
         "num_tokens": n}
        for c in step
        for prompt, comp, answer, n in zip(
            c["prompts"], c["completions"], c["answers"], c["num_tokens"], strict=True
        )
    ]  # fmt: skip
    groups = [{it["group"] for it in items[r * 3 : (r + 1) * 3]} for r in range(WORLD)]
    split = groups[0] & groups[1]
    assert len(split) == 1, "the RepeatSampler put one prompt's completions on both processes"
    assert len({it["group"] for it in items}) == 3

    with RewardClient(reward_server.url) as rc:
        options: dict[str, Any] = {"recipe": RECIPE, "answer_type": "numeric", "params": PARAMS}
        whole = rc.score(items, **options)
        alone = [rc.score(items[r * 3 : (r + 1) * 3], **options) for r in range(WORLD)]
    # sde2-train's reward returns the paper's group advantages of the whole step (TRL's
    # groups are the prompt groups here: [A, A, B | B, C, C]).
    assert whole.advantages is not None
    returned = [r for c in step for r in c["rewards"]]
    assert returned == pytest.approx(whole.advantages, abs=1e-6)
    for c in step:  # what TRL holds after gathering (float32), on every process
        assert c["gathered"] == pytest.approx(whole.advantages, abs=1e-6)
    history = json.loads((tmp_path / "log_history.json").read_text())
    logged = [h[f"{RECIPE}/raw_reward"] for h in history if f"{RECIPE}/raw_reward" in h]
    raw = sum(sum(v) for v in whole.components.values()) / len(items)  # cfl's weights: 1
    assert abs(raw) > 1e-3  # R_final's mean is 0 by construction: not what is logged
    assert logged == [pytest.approx(raw, abs=1e-5)]

    # The check has teeth: each process normalizing its own half gives other numbers.
    per_process = [r for res in alone for r in res.rewards]
    spread = max(abs(a - b) for a, b in zip(per_process, whole.rewards, strict=True))
    diff = max(abs(a - b) for a, b in zip(returned, whole.advantages, strict=True))
    diff32 = max(
        abs(a - b) for c in step for a, b in zip(c["gathered"], whole.advantages, strict=True)
    )
    print(
        f"\n{len(items)} completions, {len(split)} group split across {WORLD} processes, "
        f"max |reward function - one request| = {diff:.2e} (TRL's float32 gather: {diff32:.2e}), "
        f"per-process normalization would be off by "
        f"up to {spread:.3f}; rewards {[round(r, 4) for r in whole.rewards]}; {took:.0f} s"
    )
    assert spread > 1e-3
