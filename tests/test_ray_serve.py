"""The Ray Serve application on a real local Ray cluster (``pytest -m ray``; part of ``make test``).

One cluster for the module (``ray.init(num_cpus=2)`` on 127.0.0.1, CPU, two scorer replicas of
0.5 CPU) and one ``sde2-reward serve`` process with the same model and settings beside it. What
is checked against that process, byte for byte after JSON decoding: the HTTP ingress on every
route, the deployment handle (from this driver and from a Ray task, as a trainer's reward worker
runs), our client and the TRL adapter pointed at the ingress URL; then a scorer replica is killed
during a bounded stream of requests: each request gets the right answer or 429/503, and Ray
brings the replica back.

Both sides run onnxruntime with one thread and no embedding cache, so equal requests are equal
encoder batches and the numbers are identical, not merely close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
SERVE_FLAGS = ("--intra-op-threads", "1", "--cache-size", "0")
RAY_ARGS = {"num_replicas": 2, "num_cpus": 0.5, "cache_size": 0}


@dataclass
class Cluster:
    """The Ray ingress URL and the reference ``sde2-reward serve`` URL."""

    ray_url: str
    serve_url: str


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
            serve.run(build_app({"model": str(model), **RAY_ARGS}), name="sde2", route_prefix="/")
            print(f"\nRay cluster and application up in {time.monotonic() - t0:.1f}s")
            reference.wait_ready()
            yield Cluster(f"http://127.0.0.1:{port}", reference.url)
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
    # Over the body limit: 413 from the replica's own reader (the ingress forwards limit + 1).
    big = b'{"items": [' + b" " * (16 * 1024 * 1024 + 10) + b"]}"
    got = httpx.post(cluster.ray_url + "/v1/score", content=big, headers=AUTH, timeout=60)
    assert got.status_code == 413, got.text
    for path in ("/healthz", "/readyz", "/v1/info"):
        want, got = httpx.get(cluster.serve_url + path), httpx.get(cluster.ray_url + path)
        assert got.status_code == want.status_code == 200 and got.json() == want.json()
    metrics = httpx.get(cluster.ray_url + "/metrics")
    assert metrics.status_code == 200 and 'sde2_requests_total{route="/v1/score"' in metrics.text


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
        busy_deadline = time.monotonic() + 60  # kill it while it holds a request, not between two
        while ray.get(actor.get_num_ongoing_requests.remote(), timeout=30) < 1:
            assert time.monotonic() < busy_deadline, "the victim never held a request"
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


def test_arguments_are_checked_at_build_time() -> None:
    from reward_server.service.ray_app import split_args

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
    ):
        with pytest.raises(ValueError, match=word):
            split_args(bad)
