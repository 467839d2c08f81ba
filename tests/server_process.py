"""A real ``sde2-reward serve`` child process for tests (one class for every suite).

Startup is bounded: :meth:`ServerProcess.start` waits for ``GET /readyz`` at most ``timeout``
seconds (default ``SDE2_TEST_READY_TIMEOUT`` or 300: the first start may export the encoder) and
fails with the server's log tail, so a broken server is a failure, not a hang. A stopped server
can be started again on the same port (the fault tests restart a killed replica).
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
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT = float(os.environ.get("SDE2_TEST_READY_TIMEOUT", "300"))
REPO = Path(__file__).resolve().parents[1]
#: Extra ``serve`` flags for every test server (e.g. ``--model DIR`` for a pre-exported encoder).
SERVER_ARGS = tuple(shlex.split(os.environ.get("SDE2_TEST_SERVER_ARGS", "")))


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m reward_server.cli serve`` on free ports (HTTP, and gRPC when asked)."""

    def __init__(
        self,
        model_dir: Path | None = None,
        *extra: str,
        grpc: bool = False,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.grpc_port = free_port() if grpc else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "reward_server.cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            *(["--model", str(model_dir)] if model_dir is not None else []),
            *(["--grpc-port", str(self.grpc_port)] if self.grpc_port else []),
            *SERVER_ARGS, *extra,
        ]  # fmt: skip
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        fd, name = tempfile.mkstemp(prefix=f"sde2-serve-{self.port}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)

    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT) -> ServerProcess:
        """Spawn the server; with ``wait``, block until ``/readyz`` answers 200 (bounded)."""
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Poll ``/readyz`` until 200; fail with the log tail on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"server not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log(self) -> str:
        """Everything the server printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the server's output, for failure messages."""
        return "\n".join(self.log().splitlines()[-n:])

    def terminate(self) -> None:
        """SIGTERM: the graceful drain."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Exit status, waiting at most ``timeout`` seconds."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the abrupt death a crashed or preempted replica suffers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def requests_served(url: str, route: str) -> int:
    """How many requests to ``route`` the server at ``url`` answered with 200 (its
    ``/metrics``): which replica a client's requests went to."""
    metrics = httpx.get(url + "/metrics", timeout=10).text
    line = f'sde2_requests_total{{route="{route}",status="200"}} '
    return sum(int(float(x[len(line) :])) for x in metrics.splitlines() if x.startswith(line))
