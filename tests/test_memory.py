"""Resident memory of a real server stays flat across GRPO steps (the ≤ 400 MB budget)."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest

from reward_server.service.memory import tune_malloc
from tests.server_process import ServerProcess
from tests.service_fixtures import onnx_model_dir_fixture, step_items  # noqa: F401  (fixture)


def test_tune_malloc_applies_on_glibc() -> None:
    assert tune_malloc() is True


@pytest.mark.slow
def test_server_memory_stays_within_budget(onnx_model_dir: Path) -> None:
    with ServerProcess(onnx_model_dir, "--cache-size", "0") as server:
        assert server.proc is not None
        proc = psutil.Process(server.proc.pid)
        ready = proc.memory_info().rss
        with httpx.Client(base_url=server.url, timeout=600) as http:
            for seed in range(3):
                assert http.post("/v1/score", json={"items": step_items(seed)}).status_code == 200
        after = proc.memory_info().rss
    assert after < 400 * 2**20, f"{after / 2**20:.0f} MB after 3 steps"
    assert after - ready < 100 * 2**20, f"grew {(after - ready) / 2**20:.0f} MB over 3 steps"
