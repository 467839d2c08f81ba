"""``answer_type = "math"`` in the server: pathological answers cost ``--math-timeout`` each,
the server keeps answering meanwhile, and a server without the math extra says so (422)."""

from __future__ import annotations

import json
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


def _slow_items(tag: int, answers: int) -> list[dict[str, Any]]:
    """Items whose every math check runs into the time limit (towers of powers), distinct
    across ``tag`` (the judge caches verdicts)."""
    return [
        {"completion": _completion([f"$9^{{9^{{9^{{{k}{tag}}}}}}}$"], "$1$"), "answer": "$5$"}
        for k in range(10, 10 + answers)
    ]


def _score(service: Any, body: dict[str, Any], gone: Any = None) -> Any:
    from reward_server.service.schemas import ScoreRequest

    return service.score(lambda: ScoreRequest.model_validate_json(json.dumps(body)), gone=gone)


@pytest.mark.slow
async def test_a_one_item_math_request_waits_for_one_check_not_for_other_requests() -> None:
    """The math pool had two threads a child and each request waited for all its checks in
    one: three heavy requests held them, and a one-item request queued behind a whole heavy
    request (46 s measured) instead of one check. It is answered before any heavy one."""
    import asyncio

    service = make_service(math_workers=1, math_timeout=0.5, queue_capacity=8)
    finished: list[str] = []

    async def run(name: str, body: dict[str, Any]) -> None:
        await _score(service, body)
        finished.append(name)

    light = {"items": [{"completion": _completion(["$5$"], "$\\sqrt{25}$"), "answer": "$5$"}]}
    try:
        await run("warm", {**light, "answer_type": "math"})  # the child has booted
        bodies = [{"items": _slow_items(r, 6), "answer_type": "math"} for r in range(3)]
        heavy = [asyncio.ensure_future(run(f"heavy{r}", b)) for r, b in enumerate(bodies)]
        await asyncio.sleep(0.3)
        await run("light", {**light, "answer_type": "math"})
        await asyncio.gather(*heavy)
    finally:
        service.close()
    assert finished[:2] == ["warm", "light"], finished


@pytest.mark.slow
async def test_a_client_gone_during_its_math_checks_frees_its_place_at_once() -> None:
    """A client that hung up while its answers were checked kept its admission slot and its
    thread for every check left (20 slow checks: 20 s), and was counted as answered; its
    checks now stop after the one running, and the request ends as the client's leaving."""
    import asyncio

    from reward_server.service.errors import ClientGone

    service = make_service(math_workers=1, math_timeout=0.5)
    left = asyncio.Event()

    async def gone() -> None:
        await left.wait()

    scoring = asyncio.ensure_future(
        _score(service, {"items": _slow_items(7, 20), "answer_type": "math"}, gone)
    )
    await asyncio.sleep(2.5)  # the child has booted, a few checks have run
    assert service.batcher is not None and service.batcher.admitted == 1
    left.set()
    with pytest.raises(ClientGone, match="while its math answers were checked"):
        await asyncio.wait_for(scoring, 5)
    assert service.batcher.admitted == 0
    judge = service._math_judge
    assert judge is not None
    at_leaving = judge.timeouts
    await asyncio.sleep(2.0)  # four check limits: at most the running check ends
    assert judge.timeouts <= at_leaving + 1 and at_leaving < 10
    service.close()


def test_a_math_checker_that_cannot_start_is_a_500_not_wrong_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Children that exit before their hello every time (the checker's packages missing in
    its environment, a memory limit): one such death is retried, but a second was counted as
    *not equivalent*, so "1" against "1" scored wrong with a 200. It is a 500 naming why."""
    import subprocess
    import sys

    from reward_server import math_judge

    real_popen = subprocess.Popen

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        dying = [sys.executable, "-c", "import sys; sys.exit(1)"]
        return real_popen(dying, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(math_judge.subprocess, "Popen", popen)
    service = make_service()
    item = {"completion": _completion(["$1$"], "$1$"), "answer": "$1$"}
    with http_client(service) as c:
        r = c.post("/v1/score", json={"items": [item], "answer_type": "math"})
        metrics = c.get("/metrics").text
    assert r.status_code == 500, r.text
    assert r.json()["detail"] == "cannot check math answers: the math checker exited with 1"
    assert 'sde2_failures_total{reason="math_unavailable"} 1.0' in metrics


@pytest.mark.slow
async def test_a_cancelled_math_request_stops_its_checks() -> None:
    """A gRPC call the client ends, or a request the drain's end cuts, is cancelled: its
    checks went on in the math pool until its deadline (and their errors were logged as never
    retrieved). They stop after the running one."""
    import asyncio
    import contextlib

    service = make_service(math_workers=1, math_timeout=0.5)
    scoring = asyncio.ensure_future(_score(service, {"items": _slow_items(8, 20),
                                                     "answer_type": "math"}))  # fmt: skip
    await asyncio.sleep(2.5)
    scoring.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await scoring
    judge = service._math_judge
    assert judge is not None
    at_cancel = judge.timeouts
    await asyncio.sleep(2.0)
    assert judge.timeouts <= at_cancel + 1 and at_cancel < 10
    service.close()
