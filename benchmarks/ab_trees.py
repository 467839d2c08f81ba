"""Same-run A/B of (D) and (E) between two checkouts of this project (e.g. before/after a change).

On a shared machine the load moves between two runs of ``bench_score.py`` by more than most
changes gain, so a before/after must come from one run with the two trees interleaved:

- (D): one worker process per tree (its own ``PYTHONPATH``), driven in lockstep, step by step:
  ``prepare_batch`` → table → ``finish_batch`` of the same standard step, timed in the worker;
- (E): the standard app of each tree served with the same zero-cost table
  (``benchmarks/table_server.py`` of that tree), requests alternating between the two; with
  ``--worker-path``, the table does not answer the service's ``peek`` in either tree, so every
  request goes through the batcher's worker, as a step the cache does not hold.

Both trees must give the same rewards for every step, to within :data:`TOLERANCE` (a change
may round differently, never more): the largest difference is printed, 0 when they agree bit
for bit. The embeddings are the real encoder's (the embedded model, CPU), computed once here
into one table that both trees read: what everything but the encoder costs depends on the
cosines (the ``Uniq`` walk runs for the items with a pair closer than the threshold).

    python benchmarks/ab_trees.py --base ../other-checkout [--steps 300]
    python benchmarks/ab_trees.py --base ../other-checkout --shape "reasoning with line breaks"
    python benchmarks/ab_trees.py --base ../other-checkout --worker-path
    python benchmarks/ab_trees.py --pythons /usr/bin/python3.11,../venv-3.13/bin/python

``--pythons``: (D) only, of this tree under each interpreter given (each a Python whose
environment holds the core's dependencies: numpy, pydantic), driven in lockstep the same way:
what the interpreter's version and build cost, measured in one run.

The steps are made here, by this tree's ``benchmarks/workload.py`` (``--shape``: the standard
steps reshaped as real output is, :data:`~benchmarks.workload.SHAPES`), and handed to both
trees' workers in a file: the base need not know the shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Largest reward difference allowed between the trees (the gate (D) vs (E) of bench_score).
TOLERANCE = 1e-9


def _differ(answers: Sequence[list[float]], what: str, largest: list[float]) -> None:
    """Record the largest difference between the trees' rewards; stop beyond the tolerance."""
    diff = max(abs(a - b) for a, b in zip(answers[0], answers[-1], strict=True))
    largest[0] = max(largest[0], diff)
    if diff > TOLERANCE:
        raise SystemExit(f"{what}: the trees' rewards differ by {diff:.2e}")


def _steps(shape: str) -> list[list[dict[str, Any]]]:
    from benchmarks.workload import grpo_step, load_gsm8k, reshape

    rows = load_gsm8k()
    steps = [grpo_step(seed=100 + r, rows=rows) for r in range(8)]
    return steps if shape == STANDARD else [reshape(st, shape) for st in steps]


#: ``--shape`` of the steps as :func:`benchmarks.workload.grpo_step` makes them.
STANDARD = "standard"


def _workload(shape: str, folder: Path) -> tuple[list[list[dict[str, Any]]], Path, Path]:
    """The steps of ``shape``, and the files every worker reads them and their embeddings
    from, written into ``folder``: ``(steps, steps file, table file)``."""
    step_items = _steps(shape)
    steps_file, table = folder / "steps.json", folder / "table.npz"
    steps_file.write_text(json.dumps(step_items))
    _save_table(step_items, table)
    return step_items, steps_file, table


def _save_table(steps: list[list[dict[str, Any]]], path: Path) -> None:
    """The steps' needed texts embedded by the embedded model, saved as a table at ``path``."""
    from benchmarks.table_server import TableEncoder
    from reward_server.encoders.loading import export_engine
    from reward_server.encoders.model_store import resolve_model

    TableEncoder.of_steps(steps, export_engine("onnx")(resolve_model(None))).save(path)


def worker(steps_file: Path, table_file: Path) -> None:
    """Answer ``i`` on stdin with ``milliseconds rewards-json`` for step ``i % 8`` of
    ``steps_file``, embeddings from ``table_file``."""
    from benchmarks.table_server import TableEncoder
    from reward_server.core import ScoreItem, finish_batch, prepare_batch

    steps = json.loads(steps_file.read_text())
    table = TableEncoder.load(table_file)
    print("ready", flush=True)
    for line in sys.stdin:
        step = steps[int(line) % len(steps)]
        items = [ScoreItem(**i) for i in step]
        start = time.perf_counter()
        prepared = prepare_batch(items)
        rewards = finish_batch(prepared, table.encode(prepared.texts)).rewards
        ms = (time.perf_counter() - start) * 1000
        print(ms, json.dumps(rewards), flush=True)


def _spawn(tree: Path, *args: str, python: str = sys.executable) -> subprocess.Popen[str]:
    """``python`` running ``args`` in ``tree``, importing that tree's code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        [python, *args], cwd=tree, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def compare_in_process(
    workers: Sequence[tuple[Path, str]],
    steps: int,
    steps_file: Path,
    table: Path,
    largest: list[float],
) -> list[list[float]]:
    """(D) per worker, a ``(tree, interpreter)`` pair, alternating step by step: each worker's
    milliseconds, in order; rewards must agree (:func:`_differ`)."""
    # This file's worker, importing each tree's code (its PYTHONPATH): the base need not have it.
    me = str(Path(__file__).resolve())
    worker_args = ("--worker", "--steps-file", str(steps_file), "--table", str(table))
    procs = [_spawn(tree, me, *worker_args, python=python) for tree, python in workers]
    times: list[list[float]] = [[] for _ in procs]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for r in range(steps + 16):  # two passes over the 8 steps warm up
            answers = []
            for k, p in enumerate(procs):
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(f"{r}\n")
                p.stdin.flush()
                ms, rewards = p.stdout.readline().split(" ", 1)
                answers.append(json.loads(rewards))
                if r >= 16:
                    times[k].append(float(ms))
            _differ(answers, f"step {r}", largest)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return times


#: A tree's table server whose table answers ``encode`` only (``peek`` says "not cached"): set
#: here rather than by its ``--worker-path`` flag, which an older base does not have.
_WORKER_PATH_SERVER = (
    "import sys; from benchmarks import table_server as t; "
    "t.TableEncoder.peek = lambda self, texts: None; sys.exit(t.main(sys.argv[1:]))"
)


def compare_http(
    trees: Sequence[Path],
    steps: int,
    step_items: list[list[dict[str, Any]]],
    table: Path,
    port: int,
    largest: list[float],
    worker_path: bool = False,
) -> tuple[dict[Path, list[float]], dict[Path, list[float]]]:
    """(E) per tree through its standard app with the same table, alternating requests (each
    tree first in every other round): the client's milliseconds and the server's own
    (``x-total-time``). ``worker_path``: through the batcher's worker."""
    import httpx

    from benchmarks.bench_score import _wait_ready

    bodies = [json.dumps({"items": st}).encode() for st in step_items]
    times: dict[Path, list[float]] = {t: [] for t in trees}
    server_ms: dict[Path, list[float]] = {t: [] for t in trees}
    servers = []
    try:
        for k, tree in enumerate(trees):
            script = (
                ["-c", _WORKER_PATH_SERVER]
                if worker_path
                else [str(tree / "benchmarks" / "table_server.py")]
            )
            server = _spawn(tree, *script, "--table", str(table), "--port", str(port + k))
            servers.append(server)
            _wait_ready(server, port + k, time.perf_counter())  # type: ignore[arg-type]
        clients = [
            httpx.Client(base_url=f"http://127.0.0.1:{port + k}", timeout=60)
            for k in range(len(trees))
        ]
        headers = {"content-type": "application/json"}
        pairs = list(zip(trees, clients, strict=True))
        for r in range(steps + 16):
            answers = []
            for tree, client in pairs if r % 2 == 0 else pairs[::-1]:
                start = time.perf_counter()
                resp = client.post("/v1/score", content=bodies[r % 8], headers=headers)
                ms = (time.perf_counter() - start) * 1000
                resp.raise_for_status()
                answers.append(resp.json()["rewards"])  # compared whatever the order
                if r >= 16:
                    times[tree].append(ms)
                    server_ms[tree].append(float(resp.headers["x-total-time"]))
            _differ(answers, f"request {r}", largest)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    return times, server_ms


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the other checkout (the 'before')")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--port", type=int, default=18761)
    parser.add_argument("--shape", default=STANDARD, help="standard, or one of workload.SHAPES")
    parser.add_argument(
        "--worker-path",
        action="store_true",
        help="(E) through the batcher's worker (the table answers no peek), as uncached steps go",
    )
    parser.add_argument(
        "--pythons",
        type=lambda text: text.split(","),
        default=[],
        help="(D) only: this tree under each of these interpreters (comma-separated paths)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--table", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.steps_file, args.table)
        return 0
    if (args.base is None) == (not args.pythons):
        parser.error("give --base (two trees) or --pythons (one tree, several interpreters)")
    from benchmarks.workload import SHAPES

    if args.shape not in (STANDARD, *SHAPES):
        parser.error(f"--shape: one of {[STANDARD, *SHAPES]}")
    if args.pythons:
        return compare_interpreters(args.pythons, args.steps, args.shape)
    trees = [args.base.resolve(), ROOT]
    largest = [0.0]
    with tempfile.TemporaryDirectory() as tmp:
        step_items, steps_file, table = _workload(args.shape, Path(tmp))
        workers = [(tree, sys.executable) for tree in trees]
        in_process = compare_in_process(workers, args.steps, steps_file, table, largest)
        d = dict(zip(trees, in_process, strict=True))
        e, e_server = compare_http(
            trees, args.steps, step_items, table, args.port, largest, args.worker_path
        )
    print(
        f"{args.steps} steps per tree ({args.shape}), interleaved; rewards agree "
        f"(<= {TOLERANCE:.0e}): yes, largest difference {largest[0]:.1e}"
    )
    rows = (
        ("(D) in process", d),
        ("(E) through the " + ("encoder's worker" if args.worker_path else "server (httpx)"), e),
        ("(E) ... the server's x-total-time", e_server),
    )
    for label, quantile in (("p50", 0.5), ("p99", 0.99)):
        print(f"{label + ' ms / step':<44}{'base':>10}{'this tree':>12}{'speed-up':>10}")
        for name, times in rows:
            before, after = (_quantile(times[t], quantile) for t in trees)
            print(f"{name:<44}{before:>10.2f}{after:>12.2f}{before / after:>9.2f}x")
    return 0


def compare_interpreters(pythons: Sequence[str], steps: int, shape: str) -> int:
    """(D) of this tree under each of ``pythons``, interleaved; printed against the first."""
    labels = [_describe(python) for python in pythons]
    largest = [0.0]
    with tempfile.TemporaryDirectory() as tmp:
        _, steps_file, table = _workload(shape, Path(tmp))
        workers = [(ROOT, python) for python in pythons]
        d = compare_in_process(workers, steps, steps_file, table, largest)
    print(
        f"(D) in process, {steps} steps per interpreter ({shape}), interleaved; rewards agree "
        f"(<= {TOLERANCE:.0e}): yes, largest difference {largest[0]:.1e}"
    )
    print(f"{'interpreter':<44}{'p50 ms':>10}{'p99 ms':>10}{'vs first':>10}")
    first = _quantile(d[0], 0.5)
    for label, times in zip(labels, d, strict=True):
        p50, p99 = _quantile(times, 0.5), _quantile(times, 0.99)
        print(f"{label:<44}{p50:>10.2f}{p99:>10.2f}{first / p50:>9.2f}x")
    return 0


def _describe(python: str) -> str:
    """``python``'s version and path. (Its build, PGO or not, cannot be told from the outside:
    distributions build with PGO through their own rules, not ``--enable-optimizations``.)"""
    probe = "import sys; print(sys.version.split()[0])"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True)
    return f"{out.stdout.strip()} ({python})"


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (``q`` in hundredths: 0.5, 0.99...)."""
    return statistics.quantiles(values, n=100)[round(q * 100) - 1]


if __name__ == "__main__":
    if "--worker" not in sys.argv:  # a worker imports the tree its PYTHONPATH names
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
