"""The project stands alone: nothing it runs reads outside its own tree.

A user's clone has nothing beside it, and an installed package must not reach into whatever folder
happens to lie next to it. So:

* statically, no path built from ``__file__`` climbs above the repository and no file names a
  folder beside the checkout;
* at run time, the data loaders (the export's fidelity texts, the benchmark workload, the client's
  datasets) and a real server (start, score, drain) run in child processes under an audit hook
  (``sys.addaudithook``: every ``open``, ``os.listdir`` and ``os.scandir``); every path they touch
  must lie in the repository, the interpreter's prefixes (the venv and the system Python), the
  model cache, the test's own temporary folder, or the operating system's files;
* a wheel built with ``pip wheel`` and installed into a fresh venv where protoc (``grpc_tools``) is
  not importable serves gRPC and HTTP identically, without writing into its package folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import site
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from reward_server.encoders import model_store
from reward_server.service.grpc_client import RewardStub, request_from_dict, response_to_dict
from tests.server_process import REPO, ServerProcess, free_port
from tests.service_fixtures import onnx_model_dir_fixture, step_items  # noqa: F401 (fixture)

#: Runs ``-c CODE`` or ``-m MODULE ARGS`` with every path-touching event appended to a log file
#: (opened before the hook, written with ``os.write``, which raises no audit event itself).
AUDIT_RUNNER = r"""
import os, runpy, sys
_log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
def _hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            os.write(_log, os.fsencode(os.path.abspath(os.fsdecode(path))) + b"\n")
sys.addaudithook(_hook)
mode, target = sys.argv[2], sys.argv[3]
sys.argv = [target, *sys.argv[4:]]
if mode == "-c":
    exec(compile(target, "<audited>", "exec"), {"__name__": "__main__"})
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""

#: The operating system's own files a Python process may read (devices, process info, config).
SYSTEM_ROOTS = ("/dev", "/proc", "/sys", "/etc")


def allowed_roots(tmp: Path) -> list[Path]:
    """Where the project may read: its tree, the interpreter, the model cache, its temp dir."""
    roots = [REPO, tmp, model_store.cache_dir()]
    roots += [Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)]
    roots += [Path(p) for p in site.getsitepackages()]
    return roots + [r.resolve() for r in roots]


def outside(paths: set[str], roots: list[Path]) -> list[str]:
    """The paths not under ``roots`` (both as logged and with symlinks resolved, so a link out
    of the tree counts as outside), nor among the system's files (as logged)."""
    bad = []
    for raw in sorted(paths):
        if any(Path(raw).is_relative_to(root) for root in SYSTEM_ROOTS):
            continue
        forms = {Path(raw), Path(os.path.realpath(raw))}
        if not all(any(p.is_relative_to(r) for r in roots) for p in forms):
            bad.append(raw)
    return bad


def audited(tmp: Path, *target: str) -> tuple[list[str], Path]:
    """Command line running ``target`` (``-c CODE`` or ``-m MODULE ...``) under the audit hook,
    and the log file it appends to."""
    runner = tmp / "audit_runner.py"
    runner.write_text(AUDIT_RUNNER)
    log = tmp / "opened.log"
    return [sys.executable, str(runner), str(log), *target], log


def child_env(tmp: Path) -> dict[str, str]:
    """The test's environment with the repository on the path and ``tmp`` as the temp dir."""
    return {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}


def opened(log: Path) -> set[str]:
    return set(log.read_text(errors="replace").splitlines()) if log.exists() else set()


# --- static ---------------------------------------------------------------------------------------

_FILE_PATH = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parents?\b(?:\[\d+\])?)+)")
_STEP = re.compile(r"\.parents\[(\d+)\]|\.parent\b")
#: A folder beside the checkout, as a path (assembled so that this file does not match itself).
_SIBLING = re.compile(r"\.\./" + "shared|/ ?[\"']" + "shared[\"']|" + "shared" + r"/data")


def project_files() -> Iterator[Path]:
    """The project's own source, build and container files (not venvs, caches or build output)."""
    skip = {".git", ".venv", "venv", "build", "dist", "_generated", "__pycache__", ".podman"}
    for path in REPO.rglob("*"):
        if skip & set(path.relative_to(REPO).parts) or not path.is_file():
            continue
        if path.suffix in {".py", ".sh", ".toml", ".cfg", ".in"} or path.name.startswith(
            ("Makefile", "Dockerfile", "run")
        ):
            yield path


def test_no_source_path_leaves_the_repository() -> None:
    checked, bad = 0, []
    for path in project_files():
        text = path.read_text(errors="replace")
        checked += 1
        if path != Path(__file__) and _SIBLING.search(text):
            bad.append(f"{path.relative_to(REPO)} names a folder beside the checkout")
        for match in _FILE_PATH.finditer(text):
            folder = path
            for step in _STEP.finditer(match.group(1)):
                folder = folder.parents[int(step.group(1))] if step.group(1) else folder.parent
            if not folder.is_relative_to(REPO):
                bad.append(f"{path.relative_to(REPO)}: {match.group(0)} is {folder}")
    assert checked > 50  # the walk really saw the project
    assert not bad, "\n".join(bad)


# --- at run time ---------------------------------------------------------------------------------

LOADERS = """
from reward_server.data import GSM8K_DIR
from reward_server.encoders import fidelity
from benchmarks.workload import grpo_step, load_gsm8k
from trainer_client.datasets import load_examples

problems, source = fidelity.load_problems()
assert source.startswith("gsm8k") and len(problems) == 400, source
fidelity.build_texts(problems, 60)
fidelity.build_completions(problems, 40)
assert load_gsm8k()
grpo_step(seed=0, prompts=2, generations=2)
assert len(load_examples("gsm8k", GSM8K_DIR, "test", limit=3)) == 3
assert len(load_examples("gsm8k", GSM8K_DIR, "train", limit=8)) == 8
"""


def test_data_loaders_read_only_inside_the_tree(tmp_path: Path) -> None:
    """The export's fidelity texts, the benchmark workload and the client's datasets."""
    cmd, log = audited(tmp_path, "-c", LOADERS)
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = opened(log)
    assert str(REPO / "reward_server" / "data" / "gsm8k" / "train.jsonl") in paths  # hook works
    bad = outside(paths, allowed_roots(tmp_path))
    assert not bad, f"read outside the project: {bad}"


@pytest.mark.slow
def test_server_reads_only_its_tree_the_interpreter_and_the_model_cache(tmp_path: Path) -> None:
    """A real ``sde2-reward serve`` (default model from the cache): start, score, drain."""
    model_store.resolve_model(None)  # export into the cache first (outside the audited process)
    port = free_port()
    cmd, log = audited(
        tmp_path, "-m", "reward_server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)
    )
    server = ServerProcess(None)
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server.args, server.env = cmd, child_env(tmp_path)
    server.start()
    try:
        body = {"items": step_items(seed=11, prompts=2, generations=4), "recipe": "sde2"}
        resp = httpx.post(server.url + "/v1/score", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["rewards"]) == 8
    finally:
        server.stop()
    assert server.proc is not None and server.proc.returncode == 0, server.log_tail()
    paths = opened(log)
    # onnxruntime and tokenizers read their files in native code, which raises no audit event;
    # the manifest is read from Python.
    assert any(p.endswith("manifest.json") for p in paths), "the audit log missed the model"
    bad = outside(paths, allowed_roots(tmp_path))
    assert not bad, f"the server read outside the project: {bad}"


# --- an installed wheel ---------------------------------------------------------------------------


def _copy_source(dest: Path) -> Path:
    """The checkout's sources without generated code, venvs or build output (what a clone has)."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "_generated", "__pycache__",
        ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", ".podman", "models", ".cache",
    )  # fmt: skip
    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)
    return dest


def _overlay_without(site_packages: Path, dest: Path, hidden: tuple[str, ...]) -> Path:
    """A folder of links to ``site_packages``'s entries minus ``hidden`` names (prefix match).

    Put on a fresh venv's path with a ``.pth`` line: the venv gets the test environment's
    dependencies without installing them again, but not protoc and not our own package.
    ``.pth`` files are not processed there, so no editable install leaks in either.
    """
    dest.mkdir()
    for entry in site_packages.iterdir():
        if entry.suffix == ".pth" or entry.name.lower().startswith(hidden):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def _set_writable(folders: list[Path], writable: bool) -> None:
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for folder in folders:
        for p in [folder, *folder.rglob("*")]:
            mode = p.lstat().st_mode
            p.chmod((mode | stat.S_IWUSR) if writable else (mode & ~bits))


@contextlib.contextmanager
def _read_only(folders: list[Path]) -> Iterator[None]:
    _set_writable(folders, False)
    try:
        yield
    finally:
        _set_writable(folders, True)  # so that pytest can remove tmp_path


def _in_read_only_mounts(folders: list[Path], cmd: list[str]) -> list[str]:
    """``cmd`` in a private mount namespace where ``folders`` are read-only bind mounts, when
    this process may make one (root with ``unshare``): file permissions do not stop root."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return cmd
    mounts = " && ".join(
        f"mount --bind {shlex.quote(str(f))} {shlex.quote(str(f))} && "
        f"mount -o remount,bind,ro {shlex.quote(str(f))}"
        for f in folders
    )
    witness = folders[0] / ".write-probe"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mounts} && ! touch {shlex.quote(str(witness))}"],
        capture_output=True,
    )
    witness.unlink(missing_ok=True)
    if probe.returncode != 0:  # no mount namespaces here (e.g. an unprivileged container)
        return cmd
    return ["unshare", "-m", "sh", "-c", f"{mounts} && exec {shlex.join(cmd)}"]


@pytest.mark.slow
def test_wheel_without_grpc_tools_serves_grpc_and_http_identically(
    tmp_path: Path, onnx_model_dir: Path
) -> None:
    # 1. `pip wheel .` on a copy of the sources without any generated code: pip's isolated build
    #    environment gets setuptools and grpcio-tools from pyproject's [build-system].
    src = _copy_source(tmp_path / "src")
    # Without PYTHONPATH: pip must not take the checkout (or its egg-info) for an installed sde2.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TMPDIR": str(tmp_path)}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("sde2-*.whl")

    # 2. A fresh venv: the wheel, and this environment's dependencies minus grpc_tools.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    hidden = (
        "grpc_tools",
        "grpcio_tools",
        "reward_server",
        "trainer_client",
        "sde2",
        "__editable__",
    )
    deps = _overlay_without(Path(site.getsitepackages()[0]), tmp_path / "deps", hidden)
    (target / "test-deps.pth").write_text(f"{deps}\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run(
        [python, "-c",
         "import importlib.util as u, reward_server.service.grpc_server as g; "
         "print(u.find_spec('grpc_tools')); print(g.__file__); print(g.pb.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    no_protoc, grpc_server_file, pb_file = probe.stdout.split()
    assert no_protoc == "None"  # protoc is not importable where the wheel runs
    assert Path(grpc_server_file).is_relative_to(target), grpc_server_file  # the wheel's code
    assert Path(pb_file).is_relative_to(target) and Path(pb_file).with_suffix(".pyi").is_file()

    # 3. Serve from the read-only package: chmod a-w, and for root (whom permissions do not
    #    stop) read-only bind mounts where possible; the package must be unchanged afterwards.
    package = [target / "reward_server", target / "trainer_client"]
    before = {str(p): _snapshot(p) for p in package}
    server = ServerProcess(onnx_model_dir, env=env)
    server.args = _in_read_only_mounts(package, [
        str(venv / "bin" / "sde2-reward"), "serve", "--host", "127.0.0.1",
        "--port", str(server.port), "--grpc-port", "0", "--model", str(onnx_model_dir),
    ])  # fmt: skip
    server.env = {**env, "PYTHONUNBUFFERED": "1"}
    with _read_only(package):
        server.start()
        try:
            found = re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", server.log())
            assert found is not None, server.log_tail()
            body: dict[str, Any] = {"items": step_items(seed=7, prompts=2, generations=4)}
            via_http = httpx.post(server.url + "/v1/score", json=body, timeout=60).json()
            with grpc.insecure_channel(f"127.0.0.1:{found.group(1)}") as channel:
                reply = RewardStub(channel).Score(request_from_dict(body), timeout=60)
            via_grpc = response_to_dict(reply)
        finally:
            server.stop()
    assert via_http == via_grpc
    assert len(via_http["rewards"]) == 8 and via_http["encoder"] == "all-MiniLM-L6-v2 onnx fp32"
    assert {str(p): _snapshot(p) for p in package} == before, "the server wrote into its package"
