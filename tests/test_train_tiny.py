"""``sde2-train`` end to end on a tiny Qwen2 checkpoint built in-process: a real reward server
process, a real TRL ``GRPOTrainer`` step, in seconds (the SmolLM2 runs of
``tests/test_train_e2e.py`` take minutes). What a run leaves behind is checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_server.data import GSM8K_DIR
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.tiny_models import tiny_qwen2
from trainer_client import train

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny"), chat=True)


def tiny_argv(url: str, model: Path, out: Path, *extra: str) -> list[str]:
    """One GRPO step: 1 prompt x 2 completions of 8 tokens."""
    return [
        "--model", str(model), "--reward-url", url,
        "--data", str(GSM8K_DIR), "--limit", "2",
        "--max-steps", "1", "--num-generations", "2", "--batch-size", "2",
        "--max-new-tokens", "8", "--save-steps", "100", "--no-gradient-checkpointing",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def test_the_run_writes_what_it_trained_with(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    assert (
        train.main(tiny_argv(reward_server.url, tiny_model, out, "--param=explore_rate=0.2")) == 0
    )
    record = json.loads((out / "final" / train.TRAINING_RECORD).read_text())
    assert json.loads((out / train.TRAINING_RECORD).read_text()) == record
    assert record["load_in_4bit"] is False  # no CUDA here, and the record says so
    assert record["optimizer"] == "adamw_torch" and record["bf16"] is False
    assert record["params"] == {"explore_rate": 0.2} and record["recipe"] == "sde2"
    assert (out / "final" / "adapter_config.json").is_file()
