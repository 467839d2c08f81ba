"""The real server process under load: correct answers, fast 429s, SIGTERM drain, restart.

Every test starts ``sde2-reward serve`` as a subprocess with the real fp32 ONNX model, talks to
it over 127.0.0.1 only, and bounds the number of requests and every wait.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from reward_server.service.grpc_client import RewardStub, request_from_dict, response_to_dict
from tests.server_process import ServerProcess, free_port
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    REAL_MODEL_ATOL,
    assert_same_response,
    onnx_encoder_fixture,
    onnx_model_dir_fixture,
    reference_response,
    step_items,
    unique_items,
)

pytestmark = pytest.mark.slow
#: One shared client: creating an httpx client per call builds an SSL context each time, which
#: costs ~0.1 s of GIL-bound CPU and, with 16 threads, swamps the latencies being measured.
CLIENT = httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=64))


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return CLIENT.post(url + "/v1/score", json=body)


def grpc_score(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        return response_to_dict(RewardStub(channel).Score(request_from_dict(body), timeout=120))


def test_concurrent_clients_get_the_in_process_answers(
    onnx_model_dir: Path, onnx_encoder: Any
) -> None:
    bodies = [
        {"items": step_items(seed=100 + i, prompts=1, generations=2), "diagnostics": i % 2 == 0}
        for i in range(12)
    ]
    with ServerProcess(onnx_model_dir, grpc=True) as server, ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda b: post(server.url, b), bodies))
        assert [r.status_code for r in responses] == [200] * len(bodies)
        for body, r in zip(bodies, responses, strict=True):
            want = reference_response(body, onnx_encoder)
            assert_same_response(r.json(), want, atol=REAL_MODEL_ATOL)
        metrics = CLIENT.get(server.url + "/metrics").text
        # Concurrent requests were coalesced: fewer encoder calls than requests needing one.
        batches = _metric(metrics, "sde2_batch_requests_count")
        assert 0 < batches < len(bodies)
        # The ONNX encoder reports its own work: real tokens, with padding, per run.
        tokens = _metric(metrics, "sde2_encoder_tokens_total")
        assert 0 < tokens <= _metric(metrics, "sde2_encoder_padded_tokens_total")
        assert _metric(metrics, "sde2_encoder_batches_total") >= batches
        # HTTP and gRPC give the same numbers for the same batch (cache hit: same bits).
        via_http = post(server.url, bodies[0]).json()
        assert grpc_score(server, bodies[0]) == via_http


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _scored(text: str) -> float:
    """Requests answered so far on the scoring routes (HTTP and gRPC), any status."""
    routes = ('route="/v1/score"', 'route="grpc:Score"')
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sde2_requests_total{") and any(r in line for r in routes)
    )


def test_overload_burst_gets_fast_429s_and_the_server_recovers(onnx_model_dir: Path) -> None:
    extra = ("--queue-capacity", "2", "--cache-size", "0")
    with ServerProcess(onnx_model_dir, *extra, grpc=False) as server:
        bodies = [{"items": unique_items(seed=i, items=2, strategies=8)} for i in range(16)]

        def timed(i: int) -> tuple[int, float, str | None]:
            t0 = time.monotonic()
            r = post(server.url, bodies[i])
            return r.status_code, time.monotonic() - t0, r.headers.get("retry-after")

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(timed, range(16)))
        wall = time.monotonic() - t0
        codes = [code for code, _, _ in results]
        assert set(codes) <= {200, 429}
        assert codes.count(429) >= 8  # capacity 2: most of a 16-wide burst is refused
        assert codes.count(200) >= 2
        refusals = [(seconds, retry) for code, seconds, retry in results if code == 429]
        assert max(seconds for seconds, _ in refusals) < 1.5  # refused at once, not queued
        assert all(retry is not None and int(retry) >= 1 for _, retry in refusals)
        assert wall < 120  # nothing hangs
        after = post(server.url, {"items": unique_items(seed=99, items=1, strategies=3)})
        assert after.status_code == 200
        metrics = CLIENT.get(server.url + "/metrics").text
        overloaded = _metric(metrics, 'sde2_failures_total{reason="overloaded"}')
        assert overloaded == codes.count(429)
        assert _metric(metrics, "sde2_admitted_requests") == 0


def test_sigterm_drains_in_flight_requests_then_a_restart_serves(
    onnx_model_dir: Path, onnx_encoder: Any
) -> None:
    bodies = [{"items": unique_items(seed=200 + i, items=2, strategies=8)} for i in range(4)]
    server = ServerProcess(onnx_model_dir, "--cache-size", "0", grpc=True).start()
    try:
        with ThreadPoolExecutor(5) as pool:
            http_calls = [pool.submit(post, server.url, b) for b in bodies]
            grpc_call = pool.submit(grpc_score, server, {"items": unique_items(seed=250)})
            deadline = time.monotonic() + 60
            admitted = inside = 0.0  # every request admitted or answered: none can arrive late
            while inside < len(bodies) + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
                text = CLIENT.get(server.url + "/metrics").text
                admitted = _metric(text, "sde2_admitted_requests")
                inside = admitted + _scored(text)
            assert inside >= len(bodies) + 1, server.log_tail()
            assert admitted >= 1, "every request was answered before the stop: nothing to drain"
            t0 = time.monotonic()
            server.terminate()
            responses = [f.result(timeout=120) for f in http_calls]
            via_grpc = grpc_call.result(timeout=120)
        assert server.wait(60) == 0
        assert time.monotonic() - t0 < 60
        assert [r.status_code for r in responses] == [200] * len(bodies)
        for body, r in zip(bodies, responses, strict=True):
            assert_same_response(
                r.json(), reference_response(body, onnx_encoder), atol=REAL_MODEL_ATOL
            )
        assert len(via_grpc["rewards"]) == 2
        assert "draining" in server.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/healthz", timeout=5)
    finally:
        server.stop()
    with ServerProcess(onnx_model_dir, grpc=False, port=server.port) as again:
        assert post(again.url, bodies[0]).status_code == 200


def test_two_worker_processes_share_the_ports(onnx_model_dir: Path) -> None:
    with ServerProcess(onnx_model_dir, "--workers", "2", grpc=True) as server:
        bodies = [{"items": unique_items(seed=300 + i, items=1, strategies=3)} for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            codes = [r.status_code for r in pool.map(lambda b: post(server.url, b), bodies)]
        assert codes == [200] * 6
        assert len(grpc_score(server, bodies[0])["rewards"]) == 1
        server.terminate()
        assert server.wait(60) == 0


def test_workers_asked_for_port_0_share_one_chosen_port(onnx_model_dir: Path) -> None:
    """``--port 0 --grpc-port 0`` with two workers: the supervisor chooses each port once and
    both workers listen on it (each choosing its own would give two unrelated ports)."""
    server = ServerProcess(onnx_model_dir, "--workers", "2", "--port", "0", "--grpc-port", "0")
    server.start(wait=False)
    try:
        deadline = time.monotonic() + 120
        while server.log().count("gRPC listening on") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        log = server.log()
        chosen = dict(re.findall(r"(port|grpc_port) 0: every worker listens on (\d+)", log))
        assert set(chosen) == {"port", "grpc_port"}, server.log_tail()
        grpc_ports = re.findall(r"gRPC listening on 127\.0\.0\.1:(\d+)", log)
        assert grpc_ports == [chosen["grpc_port"]] * 2, server.log_tail()
        server.port, server.grpc_port = int(chosen["port"]), int(chosen["grpc_port"])
        server.url = f"http://127.0.0.1:{server.port}"
        server.wait_ready(60)
        body = {"items": unique_items(seed=400, items=1, strategies=3)}
        assert post(server.url, body).status_code == 200
        assert len(grpc_score(server, body)["rewards"]) == 1
        server.terminate()
        assert server.wait(60) == 0
    finally:
        server.stop()


TEXTS = "sde2_encoder_texts_total"
MISSES = 'sde2_cache_lookups_total{result="miss"}'


def test_every_worker_shows_the_metrics_of_all(onnx_model_dir: Path, tmp_path: Path) -> None:
    """With ``--workers 2`` a scrape shows the sum over both workers, whichever of them the
    kernel hands it to: the requests, their items and the encoder's work of each, the same on
    every scrape (before, each scrape showed one worker's share). The folder the workers
    share is the server's own, and gone once it stopped."""
    env = {"TMPDIR": str(tmp_path)}
    with ServerProcess(onnx_model_dir, "--workers", "2", grpc=False, env=env) as server:
        assert len(list(tmp_path.glob("sde2-metrics-*"))) == 1
        deadline, started = time.monotonic() + 120, "Application startup complete"
        while server.log().count(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the second worker listens once its encoder is warm
        assert server.log().count(started) == 2, server.log_tail()
        # The workers' warm-up texts, counted by each before it listens: the same twice.
        warmup = {_metric(httpx.get(server.url + "/metrics").text, TEXTS) for _ in range(4)}
        assert len(warmup) == 1
        warmup_texts = warmup.pop()
        assert warmup_texts > 0
        bodies = [
            {"items": unique_items(seed=500 + i, items=1 + i % 2, strategies=3)} for i in range(12)
        ]
        # A connection each (httpx.post, no shared client): the kernel spreads them.
        codes = [
            httpx.post(server.url + "/v1/score", json=b, timeout=120).status_code for b in bodies
        ]
        assert codes == [200] * len(bodies)
        scrapes = [httpx.get(server.url + "/metrics", timeout=30).text for _ in range(10)]
        # The same body again over one connection (one worker): its cache answers the repeats.
        with httpx.Client(timeout=120) as client:
            assert all(
                client.post(server.url + "/v1/score", json=bodies[0]).is_success for _ in range(3)
            )
        repeated = [httpx.get(server.url + "/metrics", timeout=30).text for _ in range(6)]
        server.terminate()
        assert server.wait(60) == 0, server.log_tail()
    assert list(tmp_path.glob("sde2-metrics-*")) == []
    items = sum(len(b["items"]) for b in bodies)
    for text in scrapes:
        assert _metric(text, 'sde2_requests_total{route="/v1/score",status="200"}') == 12
        assert _metric(text, "sde2_request_items_count") == 12
        assert _metric(text, "sde2_request_items_sum") == items
        assert _metric(text, "sde2_ready") == 1  # the least over the live workers
        assert _metric(text, "sde2_admitted_requests") == 0
    work = {(_metric(text, TEXTS), _metric(text, MISSES)) for text in scrapes}
    # Every item's three strategies are wrong and fresh: each of its texts embedded once.
    assert work == {(warmup_texts + 3 * items, 3 * items)}
    assert all(_metric(text, "sde2_cache_hit_ratio") == 0 for text in scrapes)
    for text in scrapes + repeated:  # one family per name (the ratio was one per worker)
        families = re.findall(r"^# TYPE (\S+)", text, re.M)
        assert len(families) == len(set(families)), sorted(families)
    hits = {_metric(text, 'sde2_cache_lookups_total{result="hit"}') for text in repeated}
    (hit,) = hits
    assert hit >= 6  # the last two repeats at least: three texts each
    misses = _metric(repeated[0], MISSES)
    assert {_metric(text, "sde2_cache_hit_ratio") for text in repeated} == {hit / (hit + misses)}


@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5, 3.0])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_workers_start_is_a_clean_stop(
    onnx_model_dir: Path, delay: float, sig: signal.Signals
) -> None:
    """A stop that lands while the workers start or load is a requested stop: exit 0, no
    traceback (SIGINT, a Ctrl-C, was a KeyboardInterrupt in each worker and exit 1)."""
    server = ServerProcess(onnx_model_dir, "--workers", "2", grpc=False).start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while "started 2 workers" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.05)  # the supervisor's handlers are installed once it says so
        time.sleep(delay)
        assert server.proc is not None
        server.proc.send_signal(sig)
        assert server.wait(60) == 0, server.log_tail()
        assert "exited with" not in server.log() and "Traceback" not in server.log()
    finally:
        server.stop()


#: A ``sitecustomize`` that makes ``uvicorn`` fail to import, a moment after it is asked for
#: (while the encoder's session is being built), as on an install missing part of an extra.
_NO_UVICORN = """
import sys, time

class _NoUvicorn:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "uvicorn":
            time.sleep(0.2)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoUvicorn())
"""


def test_a_web_stack_that_fails_to_import_lets_the_loading_end_first(
    onnx_model_dir: Path, tmp_path: Path
) -> None:
    """The encoder starts loading before the web stack is imported. When that import fails, the
    process lets the loading end, then says what is missing (exit 2): exiting while onnxruntime
    built its session aborted it instead (exit 134, "terminate called without an active
    exception"), two starts in three."""
    (tmp_path / "sitecustomize.py").write_text(_NO_UVICORN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "reward_server.cli", "serve", "--port", str(free_port()),
             "--model", str(onnx_model_dir)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        assert "uvicorn is not installed" in done.stderr
        assert "terminate called" not in done.stderr


def test_workers_refuse_a_taken_port_and_die_with_their_supervisor(
    onnx_model_dir: Path, tmp_path: Path
) -> None:
    """A second server on the ports of one running with ``--workers``, or on a port any
    socket holds, exits 3 with the error before starting workers (with ``SO_REUSEPORT`` it
    used to start and share the ports). A supervisor killed outright takes its workers with
    it (they used to go on serving, orphaned)."""
    first = ServerProcess(onnx_model_dir, "--workers", "2", grpc=True).start()
    try:
        second = ServerProcess(onnx_model_dir, "--workers", "2", port=first.port)
        second.start(wait=False)
        assert second.wait(120) == 3, second.log_tail()
        assert "started" not in second.log()
        assert f"cannot bind HTTP to 127.0.0.1:{first.port}: Address already in use" in second.log()
        assert first.grpc_port is not None
        grpc_taken = ServerProcess(
            onnx_model_dir, "--workers", "2", "--grpc-port", str(first.grpc_port)
        ).start(wait=False)
        assert grpc_taken.wait(120) == 3, grpc_taken.log_tail()
        assert f"cannot bind gRPC to 127.0.0.1:{first.grpc_port}" in grpc_taken.log()
        assert CLIENT.get(first.url + "/readyz").status_code == 200
        first.kill()  # SIGKILL to the supervisor alone
        assert first.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(first.url + "/healthz", timeout=2)
            except httpx.TransportError:
                break  # no worker listens any more
            time.sleep(0.2)
        else:
            pytest.fail("the workers outlived their supervisor")
    finally:
        first.stop()
    with socket.socket() as holder:  # any socket on the port, not a server
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        held = ServerProcess(onnx_model_dir, "--workers", "2", port=port).start(wait=False)
        assert held.wait(120) == 3, held.log_tail()
        assert "Address already in use" in held.log(), held.log_tail()
    # A model folder that is not there: refused before any worker starts, naming it.
    missing = ServerProcess(Path("/nonexistent/model"), "--workers", "2")
    assert missing.start(wait=False).wait(120) == 2, missing.log_tail()
    assert "model (--model / SDE2_MODEL): model '/nonexistent/model': no such" in missing.log()
    # An export that cannot load: one line naming why, as one process says it (was a
    # traceback from the supervisor).
    broken = tmp_path / "broken-export"
    shutil.copytree(onnx_model_dir, broken)
    (broken / "model.onnx").write_bytes(b"not an onnx graph")
    failing = ServerProcess(broken, "--workers", "2")
    assert failing.start(wait=False).wait(120) == 1, failing.log_tail()
    assert "loading the encoder failed: " in failing.log(), failing.log_tail()
    assert "Traceback" not in failing.log()


def test_load_benchmark_runs_end_to_end(
    onnx_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short run of ``benchmarks/bench_load.py``: it starts its own server and checks answers."""
    from benchmarks import bench_load

    argv = ["--duration", "1", "--levels", "1,2", "--pool", "3", "--completions", "2"]
    status = bench_load.main([*argv, "--model", str(onnx_model_dir)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "OK: every answer 2xx and equal to the in-process scorer" in out
    lines = out.splitlines()
    table = [line.split() for line in lines[lines.index(bench_load.HEADER) + 1 :][:2]]
    assert [row[0] for row in table] == ["1", "2"], out
    assert all(int(row[1]) > 0 and row[2:4] == ["0", "0"] for row in table), out


def test_score_benchmark_runs_end_to_end(
    onnx_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short run of ``benchmarks/bench_score.py`` (one small timed step): A, B and C agree."""
    from benchmarks import bench_score

    status = bench_score.main(
        ["--rounds", "1", "--prompts", "1", "--port", "18739", "--model", str(onnx_model_dir),
         "--overhead-steps", "3"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "rewards agree (<= 1e-5): yes" in out
    assert re.search(r"ratio A/B = [0-9.]+ +ratio A/C = [0-9.]+", out), out
    assert re.search(r"-> \d+% of floor", out), out
    assert re.search(r"fp32 ceiling: .* A/C at most (inf|[0-9.]+) ", out), out
    # Everything but the encoder: in process and through the server, with the same rewards.
    assert re.search(r"\(D\) in process.* [0-9.]+ +[0-9.]+ +<= 1\.5", out), out
    assert re.search(r"the same steps back to back \(a warm machine\) +[0-9.]+ +[0-9.]+", out)
    assert re.search(r"\(E\) through the server.* [0-9.]+ +[0-9.]+ +<= 3\.0", out), out
    # ... and through the encoder's worker, as a step the cache does not hold goes.
    assert re.search(r"\(E\) through the encoder's worker.* [0-9.]+ +[0-9.]+ +<= 3\.0", out), out
    assert "(D) and (E) rewards agree (<= 1e-9): yes" in out
    # (D) on the workload's other shapes; folded line breaks leave every reward as it was.
    assert re.search(r"\(D\), reasoning with line breaks +[0-9.]+ +[0-9.]+", out), out
    assert re.search(r"\(D\), one character beyond Latin-1 +[0-9.]+ +[0-9.]+", out), out
    assert re.search(r"\(E\), a '<' in the reasoning +[0-9.]+ +[0-9.]+", out), out
    assert re.search(r"\(D\), Markdown in the reasoning +[0-9.]+ +[0-9.]+", out), out
    assert "line breaks leave the rewards as they were: yes" in out


def test_idle_benchmark_runs_end_to_end(
    onnx_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short run of ``benchmarks/overhead_idle.py``: a p50 for each setting, the same rewards."""
    from benchmarks import overhead_idle

    argv = ["--steps", "2", "--cycles", "1", "--port", "18743", "--model", str(onnx_model_dir)]
    assert overhead_idle.main(argv) == 0
    out = capsys.readouterr().out
    for name in overhead_idle.SETTINGS:
        assert re.search(rf"{re.escape(name)} +[0-9.]+\n", out), out
    assert "rewards: the same in every setting" in out


def test_servers_benchmark_compares_sides_end_to_end(
    onnx_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short run of ``benchmarks/ab_servers.py``: a server from another tree, one on another
    export folder (the ``mha`` and ``onnx24`` forms of ``graph_variants.py``) and one with an
    extra variable, each step to every server; the attention's other forms give the same
    rewards."""
    from benchmarks import ab_servers, graph_variants

    repo = Path(__file__).resolve().parents[1]
    mha, onnx24 = tmp_path / "mha", tmp_path / "onnx24"
    ops = graph_variants.write_mha(onnx_model_dir, mha)
    assert ops["MultiHeadAttention"] == 6 and "Attention" not in ops
    ops = graph_variants.write_onnx24(onnx_model_dir, onnx24)
    assert ops["Attention"] == 6 and ops["Split"] == 6 and "MultiHeadAttention" not in ops
    sides = [
        "onnx",
        f"onnx tree={repo}",
        f"onnx model={mha}",
        f"onnx model={onnx24}",
        "onnx env=SDE2_LOG_LEVEL=warning",
    ]
    status = ab_servers.main(
        ["--steps", "1", "--port", "18861", "--model", str(onnx_model_dir), *sides]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    for side in sides:
        row = next(line for line in out.splitlines() if line.startswith(f"{side}  "))
        median, encode, speed, diff = row[len(side) :].split()
        assert float(median) >= float(encode) > 0 and speed.endswith("x"), row
        assert float(diff) <= 1e-5, row
    assert "rewards agree with the first side (<= 1e-05): yes" in out


def test_servers_benchmark_refuses_a_side_it_cannot_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import ab_servers

    with pytest.raises(SystemExit):
        ab_servers.main(["onnx", "onnx colour=red"])
    assert "'colour=red': a side's words are model=DIR, tree=DIR or env=NAME=VALUE" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        ab_servers.main(["onnx"])
    assert "give two sides or more" in capsys.readouterr().err


def test_servers_benchmark_hands_a_side_its_variables(onnx_model_dir: Path) -> None:
    """A side's ``env=`` reaches its server: one the server refuses stops the benchmark."""
    from benchmarks import ab_servers

    argv = ["--steps", "1", "--port", "18871", "--model", str(onnx_model_dir), "onnx"]
    with pytest.raises(RuntimeError, match="server exited"):
        ab_servers.main([*argv, "onnx env=SDE2_LOG_LEVEL=nonsense"])


def test_load_benchmark_spreads_connections_over_workers(
    onnx_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--workers 2`` the benchmark finds which worker holds each client's connection and
    spreads them evenly: at 2 and 4 clients both workers answer, half the connections each
    (the kernel's hash alone puts 2 connections on one worker half the time)."""
    from benchmarks import bench_load

    argv = ["--duration", "2", "--levels", "2,4", "--pool", "3", "--completions", "2"]
    status = bench_load.main(
        [*argv, "--model", str(onnx_model_dir), "--server-args", "--workers 2"]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 workers; connections spread: even" in out
    splits = re.findall(r"requests per worker (\d+)/(\d+)", out)
    assert len(splits) == 2 and all(int(a) > 0 and int(b) > 0 for a, b in splits), out
