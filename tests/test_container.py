"""The sde2-reward-server image, built and run with podman (``pytest -m container``).

What is checked, end to end: the image builds (or is reused when built from the same sources and
build arguments, see ``docker/build.sh --if-changed``), stays within the size budget, carries no
torch, runs as a non-root user, becomes ready within a bounded time, and scores a batch over HTTP
with exactly the numbers of the in-process reward core; SIGTERM stops it cleanly.

Nothing here skips: without podman (or without the setup it needs) every test fails and says to
run ``bash docker/podman-setup.sh``.

Environment:
    SDE2_TEST_IMAGE          use this image as is, without building (e.g. one from a registry)
    SDE2_TEST_READY_TIMEOUT  seconds a container may take to become ready (default 180)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hostile import PATHOLOGICAL_MATH

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE = "localhost/sde2-reward-server:latest"
MATH_IMAGE = "localhost/sde2-reward-server:math"
CTRANSLATE2_IMAGE = "localhost/sde2-reward-server:ctranslate2"
CONTAINERS_CONF = Path(
    os.environ.get("CONTAINERS_CONF", ROOT / "docker" / ".podman" / "containers.conf")
)
#: Runtime image budget (issue #4), in bytes as podman reports them (uncompressed layers).
MAX_IMAGE_BYTES = 600 * 1000 * 1000
READY_TIMEOUT = float(os.environ.get("SDE2_TEST_READY_TIMEOUT", "180"))
BUILD_TIMEOUT = 3000
SETUP_HINT = (
    "run `bash docker/podman-setup.sh` first (installs podman + runc, writes containers.conf)"
)

#: Numbers from the container against the in-process core. Same ONNX graph: only thread-count
#: float noise. sentence-transformers reference: the export's measured fidelity (cosine 1.00000).
TOL_SAME_MODEL = 1e-5
TOL_REFERENCE = 1e-4


# --- podman -------------------------------------------------------------------------------------


def _podman_base() -> list[str]:
    if shutil.which("podman") is None:
        pytest.fail(f"podman is not installed: {SETUP_HINT}", pytrace=False)
    if not CONTAINERS_CONF.is_file():
        pytest.fail(f"{CONTAINERS_CONF} is missing: {SETUP_HINT}", pytrace=False)
    runc = shutil.which("runc") or "/usr/sbin/runc"
    if not Path(runc).exists():
        pytest.fail(f"runc is not installed: {SETUP_HINT}", pytrace=False)
    return ["podman", "--runtime", runc]


def _env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run one podman command with a bounded time; on failure show its output."""
    cmd = [*_podman_base(), *args]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_env(), check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{exc.stdout}\n{exc.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(
            f"`{' '.join(cmd)}` exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    name: str
    http: str
    grpc_port: int
    cold_start_s: float


def start_container(image: str, *env: str) -> Running:
    """`podman run` on the host network with fresh ports (``env``: more ``NAME=value``); wait
    (bounded) for /readyz."""
    http_port, grpc_port = free_port(), free_port()
    name = f"sde2-test-{uuid.uuid4().hex[:10]}"
    t0 = time.monotonic()
    podman(
        "run", "-d", "--name", name, "--network", "host",
        "-e", f"SDE2_PORT={http_port}",
        "-e", f"SDE2_GRPC_PORT={grpc_port}",
        "-e", "SDE2_HOST=127.0.0.1",
        *(a for e in env for a in ("-e", e)),
        image,
    )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(name, url, READY_TIMEOUT)
    except BaseException:
        remove_container(name)
        raise
    return Running(name, url, grpc_port, time.monotonic() - t0)


def container_logs(name: str) -> str:
    proc = podman("logs", "--tail", "80", name, check=False, timeout=30)
    return (proc.stdout + proc.stderr)[-6000:]


def wait_ready(name: str, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout
            if state.strip() not in ("running", "created", "configured", "initialized"):
                pytest.fail(
                    f"container {name} is {state.strip()!r} before /readyz answered:\n"
                    f"{container_logs(name)}"
                )
            try:
                r = client.get(f"{url}/readyz")
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.25)
    pytest.fail(f"/readyz not 200 within {timeout}s (last: {last}):\n{container_logs(name)}")


def remove_container(name: str) -> None:
    podman("rm", "-f", "-t", "5", name, check=False, timeout=60)


# --- fixtures -------------------------------------------------------------------------------------


def build_image(name: str, root: Path = ROOT, **env: str) -> str:
    """``docker/build.sh --if-changed`` of the checkout ``root`` into ``name`` (``env``: its
    build variables)."""
    _podman_base()
    t0 = time.monotonic()
    cmd = ["bash", str(root / "docker" / "build.sh"), "--if-changed"]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            cwd=root,
            env={**_env(), "SKIP_SETUP": "1", "IMAGE": name, **env},
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"image build exceeded {BUILD_TIMEOUT}s")
    if proc.returncode != 0:
        pytest.fail(
            f"image build failed ({' '.join(cmd)}, exit {proc.returncode}; if the base image "
            f"could not be pulled, {SETUP_HINT}):\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    print(f"\nimage {name} ready in {time.monotonic() - t0:.1f}s (build or reuse)")
    return name


@pytest.fixture(scope="module")
def image() -> str:
    """The image under test: built by docker/build.sh unless SDE2_TEST_IMAGE names one."""
    given = os.environ.get("SDE2_TEST_IMAGE")
    if given:
        if podman("image", "exists", given, check=False).returncode != 0:
            pytest.fail(f"SDE2_TEST_IMAGE={given} does not exist locally")
        return given
    return build_image(DEFAULT_IMAGE)


@pytest.fixture(scope="module")
def server(image: str) -> Iterator[Running]:
    running = start_container(image)
    print(f"\ncold start to /readyz: {running.cold_start_s:.2f}s")
    try:
        yield running
    finally:
        remove_container(running.name)
        assert podman("container", "exists", running.name, check=False).returncode != 0


@pytest.fixture(scope="module")
def image_config(image: str) -> dict[str, Any]:
    out = podman("image", "inspect", image).stdout
    data = json.loads(out)
    return data[0] if isinstance(data, list) else data


@pytest.fixture(scope="module")
def exported_model(image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model folder baked into the image, copied out (for the same-graph comparison)."""
    env_model = next(
        (e.split("=", 1)[1] for e in _image_env(image) if e.startswith("SDE2_MODEL=")), None
    )
    assert env_model, "the image sets no SDE2_MODEL"
    dest = tmp_path_factory.mktemp("image-model")
    name = f"sde2-cp-{uuid.uuid4().hex[:10]}"
    podman("create", "--name", name, image)
    try:
        podman("cp", f"{name}:{env_model}", str(dest))
    finally:
        podman("rm", "-f", name, check=False)
    folder = dest / Path(env_model).name
    assert (folder / "model.onnx").is_file(), sorted(p.name for p in dest.rglob("*"))
    return folder


def _image_env(image: str) -> list[str]:
    out = podman("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout
    return list(json.loads(out) or [])


# --- the batch ------------------------------------------------------------------------------------


def _completion(strategies: Sequence[tuple[str, str]], final: str | None) -> str:
    parts = [
        f'<strategy id="{i}">\n  <reasoning>{r}</reasoning>\n'
        f"  <strategy_outcome>{o}</strategy_outcome>\n</strategy>"
        for i, (r, o) in enumerate(strategies, start=1)
    ]
    if final is not None:
        parts.append(f"<final_answer>{final}</final_answer>")
    return "\n".join(parts)


MUL = "Multiply the 3 boxes by the 6 apples in each box: 3 * 6 = 18 apples."
ADD = "Add six apples three times, once per box: 6 + 6 + 6 = 18."
TABLE = "Recall the multiplication table entry for three sixes, which is eighteen."
MUL_PARAPHRASE = "There are 3 boxes with 6 apples each, so 3 times 6 gives 18 apples."
WRONG = "Add the number of boxes to the apples per box: 3 + 6 = 9."
GUESS = "Eyeball the picture of the boxes and estimate roughly twenty apples."
TRAIN = "The train covers 120 km in 2 hours, so its speed is 120 / 2 = 60 km per hour."
TRAIN_RATE = "Each hour the train covers half of 120 km, that is 60 km, so 60 km/h."
TRAIN_WRONG = "Multiply the distance by the time: 120 * 2 = 240 km per hour."


def batch_items() -> list[dict[str, Any]]:
    """Two groups of four: one to five strategies, right and wrong, paraphrases, no strategies."""
    apples = [
        (_completion([(MUL, "18"), (ADD, "18"), (TABLE, "18")], "18"), 64),
        (_completion([(WRONG, "9"), (MUL, "18")], "18"), 48),
        (_completion([(MUL, "18"), (MUL_PARAPHRASE, "18")], "18"), None),
        (_completion([(WRONG, "9"), (GUESS, "20")], "9"), 40),
    ]
    train = [
        (_completion([(TRAIN, "60"), (TRAIN_RATE, "60 km/h")], "60"), 52),
        (_completion([(TRAIN_WRONG, "240")], "240"), 20),
        ("The speed is 60 km/h. <final_answer>60</final_answer>", 12),
        (
            _completion(
                [
                    (TRAIN_WRONG, "240"),
                    (GUESS, "20"),
                    (WRONG, "9"),
                    (TRAIN_RATE, "60"),
                    (TRAIN, "60"),
                ],
                "60",
            ),
            150,
        ),
    ]
    items: list[dict[str, Any]] = []
    for group, answer, rows in (("apples", "18", apples), ("train", "60", train)):
        for completion, n_tokens in rows:
            item: dict[str, Any] = {"completion": completion, "answer": answer, "group": group}
            if n_tokens is not None:
                item["num_tokens"] = n_tokens
            items.append(item)
    return items


def _request() -> dict[str, Any]:
    return {
        "items": batch_items(),
        "recipe": "sde2",
        "answer_type": "numeric",
        "normalize": True,
        "diagnostics": True,
    }


def in_process(encoder: Any) -> dict[str, Any]:
    """The same request through the reward core in this process (JSON round trip included)."""
    from reward_server.core.scoring import ScoreItem, score_batch

    req = _request()
    score = score_batch(
        [ScoreItem(**item) for item in req["items"]],
        encoder,
        recipe=req["recipe"],
        answer_type=req["answer_type"],
        normalize=req["normalize"],
        diagnostics=req["diagnostics"],
    )
    return dict(json.loads(json.dumps(score.as_dict())))


def assert_same(got: Any, want: Any, tol: float, path: str = "$") -> None:
    """Every number within ``tol`` (absolute), everything else equal, same keys and lengths."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not an object"
        assert set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], tol, f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list), f"{path}: {got!r} is not an array"
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, tol, f"{path}[{i}]")
    elif isinstance(want, bool) or want is None or isinstance(want, str):
        assert got == want, f"{path}: {got!r} != {want!r}"
    elif isinstance(want, (int, float)):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}: {got!r}"
        assert math.isclose(got, want, rel_tol=0, abs_tol=tol), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


# --- tests: the image -----------------------------------------------------------------------------


def test_image_size_within_budget(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    print(f"\nimage size: {size} bytes ({size / 1e6:.1f} MB)")
    assert size <= MAX_IMAGE_BYTES, (
        f"{image} is {size / 1e6:.1f} MB > {MAX_IMAGE_BYTES / 1e6:.0f} MB"
    )


def test_runtime_image_has_no_torch(image: str) -> None:
    proc = podman(
        "run", "--rm", "--network", "host", image, "python3", "-c", "import torch", check=False
    )
    assert proc.returncode != 0, "torch is importable in the runtime image"
    assert "No module named 'torch'" in proc.stderr, proc.stderr[-2000:]
    # ...while the server stack itself imports fine (the failure above is not a broken python).
    ok = podman(
        "run", "--rm", "--network", "host", image, "python3", "-c",
        "import onnxruntime, tokenizers, reward_server.service.serve; "
        "import reward_server.service.grpc_server; "
        "import importlib.metadata as m; "
        "names = {d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()}; "
        "bad = names & {'torch', 'transformers', 'sentence-transformers', 'grpcio-tools', "
        "'huggingface-hub', 'hf-xet', 'setuptools', 'pip'}; "
        "assert not bad, bad; print(onnxruntime.__version__)",
        check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_image_config(image_config: dict[str, Any]) -> None:
    config = image_config["Config"]
    user = str(config.get("User") or "")
    assert user and user.split(":")[0] not in ("0", "root"), f"image user {user!r}"
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    assert env.get("SDE2_HOST") == "0.0.0.0"
    assert env.get("SDE2_MODEL"), env
    assert set(config.get("ExposedPorts") or {}) >= {"8000/tcp", "50051/tcp"}
    assert config.get("Cmd") == ["sde2-reward", "serve"], config.get("Cmd")
    # podman reports it at the top level ("Healthcheck"), docker under Config.
    health = (
        image_config.get("Healthcheck")
        or image_config.get("HealthCheck")
        or config.get("Healthcheck")
        or {}
    )
    assert "/readyz" in " ".join(health.get("Test") or []), (
        f"no /readyz HEALTHCHECK (build with --format docker): {health}"
    )


# --- tests: the running server --------------------------------------------------------------------


def test_runs_as_non_root(server: Running) -> None:
    uid = podman("exec", server.name, "id", "-u").stdout.strip()
    assert uid.isdigit() and int(uid) != 0, f"server runs as uid {uid!r}"
    # The installed code and the model are not writable by that user.
    proc = podman(
        "exec", server.name, "python3", "-c",
        "import os, reward_server; "
        "print(os.access(os.path.dirname(reward_server.__file__), os.W_OK), "
        "os.access(os.environ['SDE2_MODEL'], os.W_OK))",
    )  # fmt: skip
    assert proc.stdout.split() == ["False", "False"], proc.stdout


def test_healthcheck_passes(server: Running) -> None:
    proc = podman("healthcheck", "run", server.name, check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_http_routes(server: Running) -> None:
    with httpx.Client(base_url=server.http, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 200
        info = client.get("/v1/info")
        assert info.status_code == 200, info.text
        assert "onnx" in json.dumps(info.json()).lower()
    # gRPC listens on its port as well.
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5):
        pass


def _score_over_http(server: Running) -> dict[str, Any]:
    with httpx.Client(base_url=server.http, timeout=120) as client:
        r = client.post("/v1/score", json=_request())
    assert r.status_code == 200, r.text[:2000]
    return dict(r.json())


def test_scores_match_in_process_same_model(server: Running, exported_model: Path) -> None:
    """HTTP in the container == the core in this process on the image's own ONNX graph."""
    from reward_server.encoders.onnx_runtime import OnnxEncoder

    got = _score_over_http(server)
    encoder_name = got.pop("encoder")
    assert "onnx" in encoder_name.lower(), encoder_name
    want = in_process(OnnxEncoder(exported_model))
    assert_same(got, want, TOL_SAME_MODEL)
    # The batch exercises what it should: several strategies, wrong ones, advantages per group.
    assert got["advantages"] is not None
    assert {item["n_strat"] for item in got["items"]} >= {0, 1, 2, 3}
    assert {item["strategy_correct"] for item in got["items"]} == {True, False}


def test_scores_match_sentence_transformers_reference(server: Running) -> None:
    """HTTP in the container == the core in this process on sentence-transformers (torch)."""
    from reward_server.encoders.reference import SentenceTransformerEncoder

    got = _score_over_http(server)
    got.pop("encoder")
    want = in_process(SentenceTransformerEncoder())
    assert_same(got, want, TOL_REFERENCE)


def test_sigterm_stops_cleanly(image: str) -> None:
    """A second container: ready within the bound, then `podman stop` ends it by SIGTERM."""
    running = start_container(image)
    print(f"\ncold start to /readyz (second container): {running.cold_start_s:.2f}s")
    try:
        t0 = time.monotonic()
        podman("stop", "-t", "20", running.name, timeout=60)
        stop_s = time.monotonic() - t0
        code = podman("inspect", "--format", "{{.State.ExitCode}}", running.name).stdout.strip()
        print(f"stopped in {stop_s:.2f}s, exit code {code}")
        assert code != "137", "the server ignored SIGTERM and was killed"
        assert stop_s < 20
    finally:
        remove_container(running.name)


@pytest.mark.parametrize("delay", [0.2, 0.6])
def test_sigterm_during_startup_stops_at_once(image: str, delay: float) -> None:
    """`podman stop` a fraction of a second after the start, while the server is still
    importing (PID 1, before its draining handlers exist): the kernel drops a signal PID 1 has
    no handler for, so without the early one (``reward_server.cli``) the stop waited out its
    whole timeout and killed the server (137)."""
    name = f"sde2-test-{uuid.uuid4().hex[:10]}"
    podman(
        "run", "-d", "--name", name, "--network", "host",
        "-e", f"SDE2_PORT={free_port()}", "-e", f"SDE2_GRPC_PORT={free_port()}",
        "-e", "SDE2_HOST=127.0.0.1",
        image,
    )  # fmt: skip
    try:
        time.sleep(delay)
        t0 = time.monotonic()
        podman("stop", "-t", "15", name, timeout=60)
        stop_s = time.monotonic() - t0
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        print(f"\nstopped {delay}s after the start in {stop_s:.2f}s, exit code {code}")
        assert code == "0", f"exit code {code}:\n{container_logs(name)}"
        assert stop_s < 5
    finally:
        remove_container(name)


def test_math_variant_survives_pathological_answers() -> None:
    """``SERVER_EXTRAS="server math"``: the math matcher works as the image's non-root user, and
    an answer sympy would compute for hours costs ``SDE2_MATH_TIMEOUT``, not the container."""
    image = build_image(MATH_IMAGE, SERVER_EXTRAS="server math")
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    print(f"\n{image}: {size / 1e6:.1f} MB")
    running = start_container(image)
    try:
        items = [
            {"completion": _completion([("by powers", evil), ("halve ten", "$\\frac{10}{2}$")],
                                       evil),
             "answer": "$5$"}
            for evil in PATHOLOGICAL_MATH
        ]  # fmt: skip
        r = httpx.post(
            f"{running.http}/v1/score",
            json={"items": items, "answer_type": "math", "recipe": "cfee"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert [it["strategy_correct"] for it in r.json()["items"]] == [True] * len(items)
        assert [it["correct"] for it in r.json()["items"]] == [False] * len(items)
        assert httpx.get(f"{running.http}/healthz", timeout=5).status_code == 200
    finally:
        remove_container(running.name)


def test_ctranslate2_variant_serves_its_backend(exported_model: Path) -> None:
    """``SERVER_EXTRAS="server ctranslate2"`` and ``SDE2_BACKEND=ctranslate2``: the image's
    model is converted at the first start, as the non-root user, into its cache, and the batch
    is scored as onnxruntime scores it in this process on the same export (within 1e-5)."""
    from reward_server.encoders.onnx_runtime import OnnxEncoder

    image = build_image(CTRANSLATE2_IMAGE, SERVER_EXTRAS="server ctranslate2")
    running = start_container(image, "SDE2_BACKEND=ctranslate2")
    print(f"\ncold start to /readyz, the conversion included: {running.cold_start_s:.2f}s")
    try:
        got = _score_over_http(running)
        assert got.pop("encoder") == "all-MiniLM-L6-v2 ctranslate2 fp32"
        assert_same(got, in_process(OnnxEncoder(exported_model)), TOL_SAME_MODEL)
    finally:
        remove_container(running.name)


def _image_ids(*filters: str) -> dict[str, str]:
    """Image id -> its ``org.sde2.source-hash`` label, of the images ``filters`` select."""
    args = [a for f in filters for a in ("--filter", f)]
    fmt = '{{.ID}} {{index .Labels "org.sde2.source-hash"}}'
    lines = podman("images", "--no-trunc", *args, "--format", fmt).stdout.split("\n")
    return dict(line.split() for line in lines if len(line.split()) == 2)


def test_rebuild_removes_what_earlier_builds_left(tmp_path: Path) -> None:
    """A rebuild after a source change leaves no untagged image of the earlier build (each kept
    ~2.7 GB), and keeps this build's exporter and builder stages, the layer cache of the next.

    Built from a copy of the checkout (its files, not what git ignores: 2 MB), so that a source
    can change without touching it, into an image name of its own (removed at the end with what
    it left).
    """
    name = f"localhost/sde2-reward-server:rebuild-{uuid.uuid4().hex[:8]}"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    copy = tmp_path / "checkout"
    for rel in listed:
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    ours = f"label=org.sde2.image={name}"

    def build() -> tuple[str, str]:
        build_image(name, root=copy)
        digest = subprocess.run(
            ["bash", "docker/build.sh", "--print-hash"], cwd=copy,
            env={**_env(), "SKIP_SETUP": "1", "IMAGE": name},
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        image_id = podman("image", "inspect", "--format", "{{.Id}}", name).stdout.strip()
        return image_id, digest

    try:
        first, first_hash = build()
        (copy / "reward_server" / "_rebuild_probe.txt").write_text("a source changed\n")
        second, second_hash = build()
        assert second_hash != first_hash and second != first
        assert podman("image", "exists", first, check=False).returncode != 0, (
            "the image the rebuild replaced is still there, untagged"
        )
        left = _image_ids("dangling=true", ours)
        # What is left untagged: this build's two stages only (their layers are the cache).
        assert set(left.values()) == {second_hash}, left
        assert len(left) == 2, left
    finally:
        for image_id in _image_ids(ours):
            podman("rmi", "-f", image_id, check=False, timeout=300)
