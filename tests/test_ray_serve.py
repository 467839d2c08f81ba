"""The Ray Serve application on a real local Ray cluster (``pytest -m ray``; part of ``make test``).

One cluster for the module (``ray.init(num_cpus=2)`` on 127.0.0.1, CPU, two scorer replicas of
0.5 CPU, the application under the route prefix ``/sde2``) and one ``sde2-reward serve`` process
with the same model and settings beside it. What is checked against that process, byte for byte
after JSON decoding: the HTTP ingress on every route, the deployment handle (from this driver
and from a Ray task, as a trainer's reward worker runs), our client and the TRL adapter pointed
at the ingress URL; then a scorer replica is killed during a bounded stream of requests: each
request gets the right answer or 429/503, and Ray brings the replica back. What the ingress
answers itself: /healthz with no scorer able to start (and 503, not a hang, elsewhere), and
401 / 413 / 408 / 429 before a body is read or shipped.

Both sides run onnxruntime with one thread and no embedding cache, so equal requests are equal
encoder batches and the numbers are identical, not merely close.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.server_process import ServerProcess, free_port
from tests.service_fixtures import (
    REAL_MODEL_ATOL,
    assert_same_response,
    real_model_dir,
    step_items,
)
from tests.test_container import _request as diagnostic_request

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: Ray on the loopback address only (its default is the machine's outward address), no token
#: file written into $HOME, no usage report attempted. Read by Ray at import: set before it.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
SERVE_FLAGS = ("--intra-op-threads", "1", "--cache-size", "0", "--body-timeout", "3")
#: ``ingress_max_bodies`` low enough for a test to fill, above the 4 clients of the kill test.
RAY_ARGS = {
    "num_replicas": 2,
    "num_cpus": 0.5,
    "cache_size": 0,
    "body_timeout": 3,
    "ingress_max_bodies": 6,
}
#: Not "/": Ray puts a prefix in both ``root_path`` and ``path``; every test goes through it.
PREFIX = "/sde2"


@dataclass
class Cluster:
    """The Ray ingress URL (with the route prefix) and the reference ``sde2-reward serve`` URL."""

    ray_url: str
    serve_url: str
    port: int  # Ray's HTTP proxy


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    model = real_model_dir()
    reference = ServerProcess(model, *SERVE_FLAGS, env={"SDE2_API_KEY": API_KEY})
    reference.start(wait=False)
    # The replicas inherit this process's environment (their SDE2_API_KEY comes from it).
    with _env({**RAY_ENV, "SDE2_API_KEY": API_KEY}):
        import ray
        from ray import serve
        from ray._private import ray_constants

        from reward_server.service.ray_app import build_app

        t0 = time.monotonic()
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps the node on loopback (else Ray takes the
        # address of the interface that routes outside, where there is one), but Ray reads it
        # once, when first imported, which another module's test may have done already.
        cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            app = build_app({"model": str(model), **RAY_ARGS})
            serve.run(app, name="sde2", route_prefix=PREFIX)
            print(f"\nRay cluster and application up in {time.monotonic() - t0:.1f}s")
            reference.wait_ready()
            yield Cluster(f"http://127.0.0.1:{port}{PREFIX}", reference.url, port)
        finally:
            reference.stop()
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


def _post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH if headers is None else headers,
                      timeout=120)  # fmt: skip


def _bodies() -> list[dict[str, Any]]:
    """Two groups with diagnostics; a full GRPO step (64 completions); one without normalizing."""
    return [
        diagnostic_request(),
        {"items": step_items(seed=3), "recipe": "sde2"},
        {"items": step_items(seed=4, prompts=2), "recipe": "cfee", "normalize": False},
    ]


OPENRLHF_BODY = {
    "query": ["Q: 2+3? <strategy><reasoning>Add two and three to get 5.</reasoning>"
              "<strategy_outcome>5</strategy_outcome></strategy><final_answer>5</final_answer>",
              "Q: 2+3? The answer is 6. <final_answer>6</final_answer>"],
    "prompts": ["Q: 2+3?", "Q: 2+3?"],
    "labels": ["5", "5"],
}  # fmt: skip
BAD_BODY = {"items": [{"completion": 7, "answer": "5"}], "recipe": "nope"}


# --- HTTP ingress == sde2-reward serve ------------------------------------------------------------


def test_http_routes_match_serve(cluster: Cluster) -> None:
    for body in _bodies():
        want = _post(cluster.serve_url, "/v1/score", body)
        assert want.status_code == 200, want.text
        for path in ("/v1/score", "/score"):
            got = _post(cluster.ray_url, path, body)
            assert got.status_code == 200, got.text
            assert got.json() == want.json()
            assert {f"x-{p}-time" for p in ("parse", "queue", "encode", "reward", "total")} <= set(
                got.headers
            )
    for query in ("", "?normalize=true&recipe=cfl"):
        want = _post(cluster.serve_url, "/get_reward" + query, OPENRLHF_BODY)
        got = _post(cluster.ray_url, "/get_reward" + query, OPENRLHF_BODY)
        assert want.status_code == got.status_code == 200, got.text
        assert got.json() == want.json()


def test_errors_and_health_match_serve(cluster: Cluster) -> None:
    for path, body, headers in (
        ("/v1/score", BAD_BODY, AUTH),  # 422 naming each bad field
        ("/v1/score", diagnostic_request(), {}),  # 401 without the key
        ("/get_reward", {"query": ["x"], "prompts": ["y"], "labels": ["1"]}, AUTH),  # 422
    ):
        want = _post(cluster.serve_url, path, body, headers)
        got = _post(cluster.ray_url, path, body, headers)
        assert want.status_code in (401, 422)
        assert (got.status_code, got.json()) == (want.status_code, want.json())
    # Over the body limit: 413 from the ingress, on the declared length, as the server does.
    big = b'{"items": [' + b" " * (16 * 1024 * 1024 + 10) + b"]}"
    want = httpx.post(cluster.serve_url + "/v1/score", content=big, headers=AUTH, timeout=60)
    got = httpx.post(cluster.ray_url + "/v1/score", content=big, headers=AUTH, timeout=60)
    assert (got.status_code, got.json()) == (
        want.status_code,
        want.json(),
    ) and want.status_code == 413
    for path in ("/healthz", "/readyz", "/v1/info"):
        want, got = httpx.get(cluster.serve_url + path), httpx.get(cluster.ray_url + path)
        assert got.status_code == want.status_code == 200
        expected = want.json()
        if path == "/v1/info":  # uvicorn's connection limits: Ray's proxy holds connections
            for key in ("max_header_bytes", "header_timeout_s", "keep_alive_timeout_s"):
                del expected["limits"][key]
        assert got.json() == expected
    # The route as ``sde2-reward serve`` names it: without the prefix. /metrics shows the
    # replica that answers, which may have scored none of the above: ask until one has.
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(cluster.ray_url + "/metrics")
        assert metrics.status_code == 200
        if 'sde2_requests_total{route="/v1/score"' in metrics.text:
            break
        assert time.monotonic() < deadline, "no replica counted /v1/score"
        _post(cluster.ray_url, "/v1/score", BAD_BODY, AUTH)  # counted by whichever scores it


def test_route_prefix_reaches_the_app(cluster: Cluster) -> None:
    """Under a prefix the app sees it as ``root_path``: its routes match, and its docs page
    loads the OpenAPI document from under the prefix."""
    docs = httpx.get(cluster.ray_url + "/docs")
    assert docs.status_code == 200 and f"'{PREFIX}/openapi.json'" in docs.text, docs.text[:300]
    openapi = httpx.get(cluster.ray_url + "/openapi.json")
    assert openapi.status_code == 200 and "/v1/score" in openapi.json()["paths"]
    base = f"http://127.0.0.1:{cluster.port}"
    assert httpx.get(base + "/v1/info").status_code == 404  # nothing outside the prefix
    # Redirects and the inspector's links stay under the prefix (they led out of the app).
    assert httpx.get(cluster.ray_url + "/").headers["location"] == f"{PREFIX}/inspect"
    slash = httpx.get(cluster.ray_url + "/healthz/")
    assert slash.status_code == 307 and slash.headers["location"].endswith(f"{PREFIX}/healthz")
    page = httpx.get(cluster.ray_url + "/inspect")
    for link in ("inspect/inspector.css", "inspect/inspector.js"):
        assert f'"{link}"' in page.text
        assert httpx.get(str(page.url.join(link))).status_code == 200, link
    script = httpx.get(cluster.ray_url + "/inspect/inspector.js").text
    assert 'fetch("v1/explain"' in script  # relative: {PREFIX}/v1/explain from the page
    # Metrics name routes as sde2-reward serve does, without the prefix.
    _post(cluster.ray_url, "/v1/score", diagnostic_request())
    deadline = time.monotonic() + 30
    while 'route="/v1/score"' not in httpx.get(cluster.ray_url + "/metrics").text:
        assert time.monotonic() < deadline, "no replica counted /v1/score"
        time.sleep(0.3)
    assert f'route="{PREFIX}' not in httpx.get(cluster.ray_url + "/metrics").text


# --- the deployment handle ------------------------------------------------------------------------


def test_handle_matches_serve(cluster: Cluster) -> None:
    from reward_server.service.ray_app import RewardHandle, ScoreCallError

    handle = RewardHandle()
    for body in _bodies():
        want = _post(cluster.serve_url, "/v1/score", body).json()
        assert handle.score(body) == want
    want = _post(cluster.serve_url, "/get_reward?normalize=true", OPENRLHF_BODY).json()
    assert handle.get_reward(OPENRLHF_BODY, normalize=True) == want
    want_422 = _post(cluster.serve_url, "/v1/score", BAD_BODY).json()
    with pytest.raises(ScoreCallError) as info:
        handle.score(BAD_BODY)
    assert info.value.status == 422 and not info.value.retryable
    assert info.value.detail == want_422["detail"]


def test_handle_refuses_what_json_cannot_carry(cluster: Cluster) -> None:
    """What the HTTP route would refuse (not JSON: NaN, bytes; an unknown query keyword) is a
    422 ``ScoreCallError`` naming the body or the keyword, not a bare ``RayTaskError``."""
    from reward_server.service.ray_app import RewardHandle, ScoreCallError

    handle = RewardHandle()
    item = {"completion": "<final_answer>5</final_answer>", "answer": "5"}
    for call, field in (
        (lambda: handle.score({"items": [item], "params": {"alpha": math.nan}}), "body"),
        (lambda: handle.score({"items": [{**item, "completion": b"5"}]}), "body"),
        (lambda: handle.get_reward(OPENRLHF_BODY, recipee="cfl"), "query.recipee"),
    ):
        with pytest.raises(ScoreCallError) as info:
            call()
        assert info.value.status == 422 and info.value.detail[0]["field"] == field, info.value


def test_handle_from_a_ray_task(cluster: Cluster) -> None:
    """A reward worker elsewhere in the cluster (a Ray task) scores through a pickled handle."""
    import ray

    from reward_server.service.ray_app import RewardHandle

    @ray.remote(num_cpus=0)
    def reward_worker(handle: RewardHandle, body: dict[str, Any]) -> dict[str, Any]:
        return handle.score(body)

    body = {"items": step_items(seed=5, prompts=2)}
    want = _post(cluster.serve_url, "/v1/score", body).json()
    assert ray.get(reward_worker.remote(RewardHandle(), body), timeout=120) == want


# --- our client and the TRL adapter, unchanged ----------------------------------------------------


def test_client_and_trl_adapter_against_the_ingress(cluster: Cluster) -> None:
    from trainer_client import RewardClient
    from trainer_client.trl import sde2_reward

    items = step_items(seed=6, prompts=2)
    with RewardClient(cluster.ray_url, api_key=API_KEY) as on_ray:
        with RewardClient(cluster.serve_url, api_key=API_KEY) as on_serve:
            got = on_ray.score(items, diagnostics=True)
            want = on_serve.score(items, diagnostics=True)
        assert on_ray.ready()
    assert got.rewards == want.rewards and got.components == want.components
    assert got.advantages == want.advantages and got.items == want.items

    texts = [it["completion"] for it in items]
    kwargs = {
        "prompts": [it["group"] for it in items],
        "completions": [[{"role": "assistant", "content": t}] for t in texts],
        "completion_ids": [[1, 2, 3]] * len(items),
        "answer": [it["answer"] for it in items],
        "trainer_state": None,
    }
    on_ray_fn = sde2_reward(cluster.ray_url, api_key=API_KEY)
    on_serve_fn = sde2_reward(cluster.serve_url, api_key=API_KEY)
    rewards = asyncio.run(on_ray_fn(**kwargs))
    assert rewards == asyncio.run(on_serve_fn(**kwargs))
    assert len(rewards) == len(items) and all(isinstance(r, float) for r in rewards)


# --- what the ingress answers itself -------------------------------------------------------------


def _raw(
    port: int, head: bytes, body: bytes = b"", media_type: bytes = b"application/json"
) -> socket.socket:
    """A connection to Ray's proxy that has sent ``head`` (request line and headers, without the
    blank line) and then ``body``: an upload the test can leave unfinished."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(head + b"\r\nHost: x\r\nContent-Type: " + media_type + b"\r\n\r\n" + body)
    return conn


def _status_of(conn: socket.socket) -> tuple[int, bytes]:
    """The status of the answer on ``conn`` and what came with it (read until the head ends)."""
    got = b""
    with conn:
        while b"\r\n\r\n" not in got:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
    return int(got.split(b" ", 2)[1]), got


def test_ingress_refuses_before_reading_the_body(cluster: Cluster) -> None:
    """Uploads that never finish: without the key (401) or over the limit by its declared
    length (413) they are answered at once, unread; with the key, each holds an ingress slot
    until the body timeout (408); beyond ``ingress_max_bodies`` held, 429 with Retry-After."""
    post = f"POST {PREFIX}/v1/score HTTP/1.1".encode()

    def answered_at_once(
        head: bytes, body: bytes = b"", media: bytes = b"application/json"
    ) -> tuple[int, bytes]:
        # Each answer comes before the 3 s body timeout: an answer that waited for the upload
        # to give up would take at least that long.
        t0 = time.monotonic()
        status, answer = _status_of(_raw(cluster.port, head, body, media))
        assert time.monotonic() - t0 < 2.5, f"{head!r}: answered only once the upload gave up"
        return status, answer

    status, head = answered_at_once(post + b"\r\nContent-Length: 1000", b'{"items": ')
    assert status == 401 and b"connection: close" in head.lower()  # the rest is never read
    key = b"\r\nAuthorization: Bearer " + API_KEY.encode()
    # Two credentials are none, as the scorers read them (the ingress read the first one and
    # relayed the body, for the replica's 401).
    status, head = answered_at_once(post + key + key + b"\r\nContent-Length: 1000", b"{")
    assert status == 401 and b"connection: close" in head.lower()
    status, head = answered_at_once(post + key + b"\r\nContent-Length: 99999999")
    assert status == 413 and b"connection: close" in head.lower()
    status, head = answered_at_once(post + key + b"\r\nContent-Length: 1000", b"{", b"text/plain")
    assert status == 415 and b"connection: close" in head.lower()
    # A route that reads no body (a wrong path, another method): answered unread, as the plain
    # server does, never holding a slot (they were read, keyless, until the body timeout).
    for line, want in (
        (f"POST {PREFIX}/nope HTTP/1.1", 404),
        (f"PUT {PREFIX}/v1/score HTTP/1.1", 405),
        (f"POST {PREFIX}/healthz HTTP/1.1", 405),
    ):
        status, _ = answered_at_once(line.encode() + b"\r\nContent-Length: 9", b"{")
        assert status == want, line
    head = httpx.head(cluster.ray_url + "/healthz")  # a load balancer's probe, as serve's
    assert head.status_code == 200 and head.content == b""

    stalled_head = (
        post + b"\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000"
    )
    stalled = [
        _raw(cluster.port, stalled_head, b'{"items": ')
        for _ in range(RAY_ARGS["ingress_max_bodies"])
    ]
    # Once the proxy has handed them all to the ingress (polled: a loaded machine takes longer
    # than an idle one), the next request is refused; until then it may still get a slot.
    deadline = time.monotonic() + 2
    while (over := _post(cluster.ray_url, "/v1/score", diagnostic_request())).status_code == 200:
        assert time.monotonic() < deadline, "the stalled uploads never held every slot"
        time.sleep(0.05)
    assert over.status_code == 429 and over.headers["retry-after"] == "1", over.text
    t1 = time.monotonic()
    answers = [_status_of(conn) for conn in stalled]
    assert [status for status, _ in answers] == [408] * len(stalled), answers
    assert time.monotonic() - t1 < RAY_ARGS["body_timeout"] + 2
    # Slots are free again.
    assert _post(cluster.ray_url, "/v1/score", diagnostic_request()).status_code == 200


def test_replicas_log_at_the_log_level(cluster: Cluster) -> None:
    """``log_level`` (info by default) reaches the replicas' ``reward_server`` loggers: each
    scorer's pipeline writes "encoder ... ready" to its worker log."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    line = re.compile(r"INFO reward_server\.service\.pipeline: encoder .* ready in \d")
    found = [
        path.name
        for path in logs.rglob("*")
        if path.is_file() and line.search(path.read_text(errors="replace"))
    ]
    assert len(found) >= RAY_ARGS["num_replicas"], sorted(p.name for p in logs.rglob("*"))


def test_client_disconnect_is_counted(cluster: Cluster) -> None:
    """A client that gives up mid-request is counted as ``sde2-reward serve`` counts it (status
    499, failure reason ``client_disconnect``) by the replica that was scoring it."""
    line = 'sde2_failures_total{reason="client_disconnect"}'
    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster.ray_url + "/v1/score", json={"items": step_items(seed=77, prompts=8)},
                   headers=AUTH, timeout=0.3)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # /metrics shows the replica that answers: ask again
        text = httpx.get(cluster.ray_url + "/metrics").text
        if line in text and 'status="499"' in text:
            return
        time.sleep(0.3)
    pytest.fail(f"no replica counted the disconnect: {line} missing")


def test_no_scorer_replica_no_hang(cluster: Cluster) -> None:
    """A scorer that cannot be placed (more CPUs than the node has): /healthz answers from the
    ingress, /readyz and scoring answer 503 with Retry-After within their budgets (the scoring
    budget counting the time queued for a replica), none hangs."""
    from ray import serve

    from reward_server.service.ray_app import build_app

    # drain_timeout: Ray waits that long (graceful_shutdown_timeout_s) for the replica it never
    # placed when the application is deleted.
    args = {"model": str(real_model_dir()), "num_replicas": 1, "num_cpus": 64,
            "request_timeout": 2, "probe_timeout_s": 1, "drain_timeout": 0}  # fmt: skip
    app = build_app(args)
    serve.run_many(
        [serve.RunTarget(app, name="starved", route_prefix="/starved")],
        wait_for_applications_running=False,
    )
    base = f"http://127.0.0.1:{cluster.port}/starved"
    try:
        deadline = time.monotonic() + 90
        health = httpx.get(base + "/healthz", timeout=30)
        while health.status_code == 404 and time.monotonic() < deadline:  # the route not yet up
            time.sleep(0.5)
            health = httpx.get(base + "/healthz", timeout=30)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        t0 = time.monotonic()  # a balancer's HEAD probe too: it was relayed, a 503 after 1 s
        head = httpx.head(base + "/healthz", timeout=30)
        assert (head.status_code, head.content) == (200, b"") and time.monotonic() - t0 < 1
        assert head.headers["content-length"] == health.headers["content-length"]
        for method, path, budget in (("GET", "/readyz", 1), ("POST", "/v1/score", 3)):
            t0 = time.monotonic()
            body = diagnostic_request() if method == "POST" else None
            got = httpx.request(method, base + path, json=body, headers=AUTH, timeout=30)
            took = time.monotonic() - t0
            assert got.status_code == 503 and got.headers["retry-after"] == "1", got.text
            assert "no scorer replica answered" in got.json()["detail"]
            assert budget <= took < budget + 5, took
        assert httpx.post(base + "/v1/score", json={}, timeout=30).status_code == 401
        # The handle too: bounded by its timeout (it waited for ever).
        from reward_server.service.ray_app import RewardHandle, ScoreCallError

        t0 = time.monotonic()
        with pytest.raises(ScoreCallError) as err:
            RewardHandle(app_name="starved", timeout=2).score(diagnostic_request())
        assert err.value.status == 503 and err.value.retryable
        assert 2 <= time.monotonic() - t0 < 7
    finally:
        serve.delete("starved")


# --- a replica killed under load ------------------------------------------------------------------


def _scorer_replicas() -> dict[str, str]:
    """Running scorer replicas: replica id -> actor name."""
    from ray import serve

    status = serve.status().applications["sde2"].deployments["SDE2Scorer"]
    running = status.replica_states.get("RUNNING", 0)
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::sde2#SDE2Scorer#")
    ]
    return {n.rsplit("#", 1)[1]: n for n in names} if running == len(names) else {}


def _ingress_log() -> str:
    """What the ingress replicas logged (its retries on a lost replica are logged there)."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return "".join(
        p.read_text(errors="replace")
        for p in (session / "logs" / "serve").glob("replica_sde2_SDE2Ingress_*.log")
    )


def test_replica_killed_during_a_stream(cluster: Cluster) -> None:
    import ray

    before = _scorer_replicas()
    assert len(before) == 2, before
    bodies = [{"items": step_items(seed=100 + i, prompts=2)} for i in range(12)]
    log_before = _ingress_log().count("scorer replica lost")

    outcomes: list[tuple[int, int, Any]] = []
    lock = threading.Lock()
    answered = threading.Event()

    def one(i: int) -> None:
        r = _post(cluster.ray_url, "/v1/score", bodies[i])
        with lock:
            outcomes.append((i, r.status_code, r.json()))
            if len(outcomes) >= 2:
                answered.set()

    victim = next(iter(before.values()))
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(one, i) for i in range(len(bodies))]
        assert answered.wait(120), "no answers before the kill"
        actor = ray.get_actor(victim, namespace="serve")
        # Kill it while it holds a request, not between two, and one it has been running for a
        # moment: Ray's router itself sends a request again, unseen, whose replica dies before
        # the request reached it (then the ingress has nothing to retry: the check below fails).
        busy_deadline = time.monotonic() + 60
        held_since: float | None = None
        while True:
            now = time.monotonic()
            if ray.get(actor.get_num_ongoing_requests.remote(), timeout=30) < 1:
                held_since = None
            elif held_since is None:
                held_since = now
            elif now - held_since >= 0.1:
                break
            assert now < busy_deadline, "the victim never held a request"
            time.sleep(0.01)
        ray.kill(actor, no_restart=True)
        killed_at = time.monotonic()
        for f in futures:
            f.result(timeout=300)

    # The reference answers (computed while Ray replaces the replica).
    expected = [_post(cluster.serve_url, "/v1/score", b).json() for b in bodies]
    statuses = sorted(status for _, status, _ in outcomes)
    print(f"\nstatuses after killing {victim}: {statuses}")
    assert len(outcomes) == len(bodies)
    for i, status, data in outcomes:
        assert status in (200, 429, 503), (i, status, data)
        if status == 200:
            # Concurrent requests share encoder batches here (not in the sequential reference):
            # padding moves embeddings by ~1e-7, hence the tolerance.
            assert_same_response(data, expected[i], atol=REAL_MODEL_ATOL)
        else:
            assert "detail" in data
    assert statuses.count(200) >= len(bodies) // 2
    # The ingress's log reaches its file asynchronously: wait for the line, do not race it.
    log_deadline = time.monotonic() + 20
    lost = _ingress_log().count("scorer replica lost") - log_before
    while lost < 1 and time.monotonic() < log_deadline:
        time.sleep(0.5)
        lost = _ingress_log().count("scorer replica lost") - log_before
    print(f"requests the ingress retried on another replica: {lost}")
    assert lost >= 1, "no request was in flight on the killed replica: the retry went untested"

    # Ray replaces the replica (a new one, loaded and warm), and it serves.
    deadline = time.monotonic() + 180
    after: dict[str, str] = {}
    while time.monotonic() < deadline:
        after = _scorer_replicas()
        if len(after) == 2 and victim not in after.values():
            break
        time.sleep(0.5)
    assert len(after) == 2 and victim not in after.values(), after
    print(f"replica replaced in {time.monotonic() - killed_at:.1f}s")
    for body, want in zip(bodies[:4], expected[:4], strict=True):
        assert _post(cluster.ray_url, "/v1/score", body).json() == want


# --- the shipped serve config ---------------------------------------------------------------------


def test_serve_config_is_valid_and_builds() -> None:
    """``deploy/ray/serve_config.yaml`` passes Ray's own schema and builds the application its
    import path names, with the autoscaling defaults."""
    with _env(RAY_ENV):
        from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
        from ray.serve.schema import ServeDeploySchema

        from reward_server.service import ray_app

        config = yaml.safe_load((REPO / "deploy" / "ray" / "serve_config.yaml").read_text())
        schema = ServeDeploySchema.parse_obj(config)
        (app_config,) = schema.applications
        assert app_config.name == ray_app.APP_NAME and app_config.route_prefix == "/"
        module, attr = app_config.import_path.split(":")
        builder = getattr(__import__(module, fromlist=[attr]), attr)
        assert builder is ray_app.build_app
        app = call_user_app_builder_with_args_if_necessary(builder, app_config.args)
        scorer = app._bound_deployment.init_args[0]._bound_deployment  # the bound scorer
        auto = scorer._deployment_config.autoscaling_config
        assert auto is not None and auto.min_replicas >= 1 and auto.max_replicas > auto.min_replicas
        assert auto.target_ongoing_requests == ray_app.RayOptions().target_ongoing_requests
        # It becomes ready on a 2-CPU node: the ingress reserves no CPU, one scorer fits.
        ingress_opts = app._bound_deployment.ray_actor_options or {}
        scorer_opts = scorer.ray_actor_options or {}
        assert ingress_opts.get("num_cpus") == 0, ingress_opts
        assert scorer_opts["num_cpus"] <= 2, scorer_opts


def test_docs_name_real_ray_commands() -> None:
    """Ray 2.60's ``serve run`` has no ``--port``: the docs and messages point elsewhere."""
    from reward_server.service import ray_app
    from reward_server.service.ray_app import split_args

    for text in (ray_app.__doc__ or "", (REPO / "deploy" / "README.md").read_text()):
        assert "serve run --port" not in text and "serve run --host" not in text
    with pytest.raises(ValueError, match="serve start --http-port"):
        split_args({"port": 9000})


@pytest.mark.parametrize(("level", "written"), [("debug", ["DEBUG", "INFO"]), ("warning", [])])
def test_log_level_sets_what_a_replica_writes(level: str, written: list[str]) -> None:
    """What :func:`use_log_level` lets through, in a process of its own (loggers are global)."""
    script = (
        "import logging\n"
        "from reward_server.service.ray_app import use_log_level\n"
        f"use_log_level({level!r})\n"
        "log = logging.getLogger('reward_server.service.pipeline')\n"
        "log.debug('a debug record'); log.info('an info record')\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert got.returncode == 0, got.stderr
    lines = got.stderr.splitlines()
    assert [line.split()[0] for line in lines] == written, got.stderr
    assert all("reward_server.service.pipeline: a" in line for line in lines)


def test_arguments_are_checked_at_build_time() -> None:
    from reward_server.service.ray_app import settings_from_args, split_args

    settings, options, passed = split_args({"max-items": "2048", "num_replicas": "3"})
    assert settings.max_items == 2048 and options.num_replicas == 3
    assert passed == {"max_items": "2048"}
    assert settings.intra_op_threads == 1  # one per reserved CPU, not every core of the node
    for bad, word in (
        ({"max_itemz": 1}, "max_itemz"),
        ({"port": 9000}, "http_options"),
        ({"max_items": 0}, "max_items"),
        ({"api_key": "x"}, "SDE2_API_KEY"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"num_replicas": 2.5}, "num_replicas: expected an integer"),  # not 2
        ({"num_replicas": "auto"}, "num_replicas"),
        ({"max_replicas": True}, "max_replicas"),
        ({"num_cpus": "two"}, "num_cpus"),
        ({"header_timeout": 3}, "header_timeout.*http_options"),  # uvicorn's, not Ray's proxy's
        ({"max_header_bytes": 2000}, "max_header_bytes"),
        ({"keep_alive_timeout": 9}, "keep_alive_timeout_s"),
        # Not "max_replicas: invalid value 4", an argument never set.
        ({"min_replicas": 5}, "min_replicas 5 is over max_replicas 4 .the default 4 unless set"),
    ):
        with pytest.raises(ValueError, match=word):
            split_args(bad)
    with pytest.raises(ValueError) as unknown:  # the arguments it lists are ones to set
        split_args({"max_itemz": 1})
    listed = str(unknown.value).split("known: ")[1].split(", ")
    assert "max_items" in listed and "min_replicas" in listed
    assert not {"api_key", "header_timeout", "max_header_bytes", "port"} & set(listed)
    # YAML `key:` (null) leaves the default, for options and settings alike (the connection
    # limits included); a connection limit given at its default is accepted, as from SDE2_*.
    settings, options, passed = split_args(
        {"min_replicas": None, "model": None, "num_replicas": 2.0, "keep_alive_timeout": None}
    )
    assert options.min_replicas == 1 and options.num_replicas == 2
    assert settings.model is None and passed == {}
    defaults = {"header_timeout": 10, "keep_alive_timeout": 5}
    assert {k: getattr(split_args(defaults)[0], k) for k in defaults} == defaults
    # The connection limits are refused from the environment too (the replicas read it).
    with pytest.raises(ValueError, match="SDE2_HEADER_TIMEOUT"):
        settings_from_args({}, options, {"SDE2_HEADER_TIMEOUT": "4"})
    assert split_args({"body_timeout": 3})[0].body_timeout == 3  # enforced by the ingress
