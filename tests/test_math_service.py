"""``answer_type = "math"`` in the server: pathological answers cost ``--math-timeout`` each,
the server keeps answering meanwhile, and a server without the math extra says so (422)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hostile import PATHOLOGICAL_MATH
from tests.server_process import ServerProcess
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    http_client,
    make_service,
    onnx_model_dir_fixture,
    threads_running,
)


def _completion(outcomes: list[str], final: str) -> str:
    blocks = "".join(
        f"<strategy><reasoning>Approach {i}: compute the value step by step.</reasoning>"
        f"<strategy_outcome>{o}</strategy_outcome></strategy>"
        for i, o in enumerate(outcomes)
    )
    return blocks + f"<final_answer>{final}</final_answer>"


@pytest.mark.slow
def test_pathological_math_answers_do_not_stall_the_server(onnx_model_dir: Path) -> None:
    items = [
        {"completion": _completion([evil, "$\\frac{10}{2}$"], evil), "answer": "$5$"}
        for evil in PATHOLOGICAL_MATH
    ] + [{"completion": _completion(["$6$", "$7$"], "$\\sqrt{25}$"), "answer": "$5$"}]
    with ServerProcess(onnx_model_dir, "--math-timeout", "1", grpc=False) as server:
        answer: dict[str, Any] = {}

        def score() -> None:
            r = httpx.post(
                server.url + "/v1/score", json={"items": items, "answer_type": "math"}, timeout=120
            )
            answer["status"], answer["body"] = r.status_code, r.json()

        scoring = threading.Thread(target=score)
        t0 = time.monotonic()
        scoring.start()
        health: list[float] = []
        while scoring.is_alive():
            t = time.monotonic()
            assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.1)
        scoring.join()
        elapsed = time.monotonic() - t0
        assert answer["status"] == 200, answer
        got = answer["body"]["items"]
        # Each pathological check ran out (not equivalent); the sane strategies were still judged.
        assert [it["strategy_correct"] for it in got] == [True, True, True, False]
        assert [it["correct"] for it in got] == [False, False, False, True]
        assert len(health) >= 3 and max(health) < 1.0, health
        assert elapsed < len(PATHOLOGICAL_MATH) * (1 + 3) + 10
        metrics = httpx.get(server.url + "/metrics").text
        assert f"sde2_math_check_timeouts_total {float(len(PATHOLOGICAL_MATH))}" in metrics
        ok = httpx.post(
            server.url + "/v1/score",
            json={"items": items[-1:], "answer_type": "math"},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["items"][0]["correct"] is True


def test_math_without_the_extra_is_422_naming_answer_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("reward_server.service.pipeline.math_available", lambda: False)
    with http_client(make_service()) as client:
        r = client.post(
            "/v1/score",
            json={"items": [{"completion": "x", "answer": "1"}], "answer_type": "math"},
        )
    assert r.status_code == 422
    detail = r.json()
    assert "answer_type" in str(detail) and "sde2[math]" in str(detail)


def test_a_math_explanation_waits_in_the_math_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``/v1/explain`` checks a ``math`` request's answers again: that runs in the math pool
    (as its preparation does), so a slow check never holds the CPU pool every request shares;
    other explanations stay in the CPU pool."""
    threads = threads_running(monkeypatch, "explain_batch")
    item = {"completion": _completion(["$6$", "$5$"], "$\\sqrt{25}$"), "answer": "$5$"}
    with http_client(make_service()) as c:
        for answer_type in ("math", "numeric"):
            body = {"items": [item], "answer_type": answer_type}
            assert c.post("/v1/explain", json=body).status_code == 200
    assert [t.rsplit("_", 1)[0] for t in threads] == ["sde2-math", "sde2-cpu"], threads
