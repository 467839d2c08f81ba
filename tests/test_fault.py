"""Fault tolerance of training: the reward server dies mid-training.

Two outcomes are acceptable and both are tested with a real server process and real GRPO steps:
the server comes back and training continues after retries, or it does not and training stops
with a clear error naming the server — in neither case is a step taken on invented rewards; the
stopped run then resumes from its checkpoint once the server is back.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.client_fixtures import (  # noqa: F401 - fixture
    REPO,
    ServerProcess,
    smollm2,
    tiny_train_argv,
)
from tests.test_train_e2e import record_steps
from trainer_client.train import build_parser, build_trainer

pytestmark = [pytest.mark.train, pytest.mark.slow]


def kill_before_second_reward_call(
    holder: Any, server: ServerProcess, restart_after: float
) -> dict:
    """SIGKILL the server just as step 2 asks for its rewards; restart it ``restart_after`` s later.

    Killing from inside the reward path (not from a step callback) guarantees the request meets
    a dead server, however long generation takes on a loaded machine.
    """
    score = holder.score
    state: dict[str, Any] = {"calls": 0, "old_pid": None}

    async def killing_score(*args: Any, **kwargs: Any) -> list[float | None]:
        state["calls"] += 1
        if state["calls"] == 2:
            assert server.proc is not None
            state["old_pid"] = server.proc.pid
            server.kill()
            threading.Timer(restart_after, server.start, kwargs={"wait": False}).start()
        return await score(*args, **kwargs)

    holder.score = killing_score
    return state


def test_training_continues_after_the_server_restarts(
    smollm2: tuple[Path, Any, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    gguf, model, tokenizer = smollm2
    server = ServerProcess().start()
    try:
        argv = tiny_train_argv(
            server.url, tmp_path / "run", gguf, "--reward-retries", "15", "--beta", "0"
        )
        args = build_parser().parse_args(argv)
        trainer, holder = build_trainer(args, model=copy.deepcopy(model), tokenizer=tokenizer)
        results, _ = record_steps(trainer, holder)
        fault = kill_before_second_reward_call(holder, server, restart_after=2.0)
        trainer.train()
    finally:
        server.stop()
    assert fault["calls"] == 2 and fault["old_pid"] is not None
    assert server.proc is not None and server.proc.pid != fault["old_pid"]  # a new process served
    assert trainer.state.global_step == 2 and len(results) == 2
    client = holder._client[1]
    assert client.failed_attempts >= 1  # step 2 met the dead server, then retried
    rewards = [h for h in trainer.state.log_history if "rewards/sde2/mean" in h]
    assert rewards[1]["rewards/sde2/mean"] == pytest.approx(sum(results[1].rewards) / 4, abs=1e-5)


def test_training_stops_with_a_clear_error_when_the_server_stays_down(tmp_path: Path) -> None:
    """Through the ``sde2-train`` command line: exit code 2, the reason, no step 2."""
    from tests.client_fixtures import smollm2_gguf

    server = ServerProcess().start()
    out = tmp_path / "run"
    argv = tiny_train_argv(server.url, out, smollm2_gguf())
    argv += ["--reward-retries", "3", "--reward-deadline", "10", "--beta", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer_client.train", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900
        while not (out / "checkpoint-1").is_dir():  # step 1 done and saved: kill the server
            assert proc.poll() is None, "sde2-train exited before step 1"
            assert time.monotonic() < deadline, "step 1 never finished"
            time.sleep(0.2)
        server.kill()
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 2, output[-3000:]
    assert "training stopped at step 1" in output
    assert "reward service failed" in output and f"{server.url}/v1/score" in output
    assert "--resume" in output and "checkpoint-1" in output
    assert not (out / "checkpoint-2").exists()
    assert not (out / "final").exists()

    # The way out the message names: bring the service back and resume from the checkpoint.
    server.start()
    try:
        resumed = subprocess.run(
            [sys.executable, "-m", "trainer_client.train", *argv, "--resume"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        server.stop()
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "adapter_config.json").is_file()
    history = json.loads((out / "log_history.json").read_text())
    # step 1 comes from the restored checkpoint's state, step 2 was trained after the resume
    assert [h["step"] for h in history if "rewards/sde2/mean" in h] == [1, 2]
