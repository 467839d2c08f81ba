"""Load benchmark of the reward server: throughput and latency at concurrency 1, 4, 16, 32.

    python -m benchmarks.bench_load                 # 60 s per level, starts its own server
    python -m benchmarks.bench_load --duration 10   # shorter
    python -m benchmarks.bench_load --url http://127.0.0.1:8000   # an already running server

Each client sends valid ``/v1/score`` requests back to back: one prompt's GRPO group by default
(``--completions 8`` completions with 1-10 strategies of 30-120 words, from GSM8K solutions).
Every answer is checked against the in-process scorer (same model; numbers within 1e-4, since a
text's embedding moves by ~1e-7 with the batch it is padded in). The expected answers are
computed *before* the timed runs so checking costs no server CPU, and the server runs with its
embedding cache off (``--cache-size 0``) so the pool of bodies, which is cycled, is re-encoded
every time. Any non-2xx answer or mismatch makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.workload import grpo_step, load_gsm8k

LEVELS = (1, 4, 16, 32)
ATOL = 1e-4


@dataclass
class LevelResult:
    """What one concurrency level measured."""

    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    non_2xx: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    mismatches: int = 0
    completions: int = 0

    def row(self) -> str:
        n = len(self.latencies)
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p99 = lat[min(n - 1, int(0.99 * n))] if lat else float("nan")
        return (
            f"{self.concurrency:>11} {n:>8} {self.non_2xx:>7} {self.mismatches:>10} "
            f"{n / self.seconds:>9.2f} {self.completions / self.seconds:>13.1f} "
            f"{p50 * 1000:>9.0f} {p99 * 1000:>9.0f}"
        )


HEADER = (
    f"{'concurrency':>11} {'requests':>8} {'non-2xx':>7} {'mismatches':>10} {'req/s':>9} "
    f"{'completions/s':>13} {'p50 ms':>9} {'p99 ms':>9}"
)


def close(a: Any, b: Any) -> bool:
    """Equal JSON values, floats within :data:`ATOL`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= ATOL
    return bool(a == b)


def make_bodies(count: int, completions: int) -> list[dict[str, Any]]:
    """``count`` distinct requests of ``completions`` completions (one GRPO group each)."""
    rows = load_gsm8k()
    return [
        {"items": grpo_step(seed=1000 + i, prompts=1, generations=completions, rows=rows)}
        for i in range(count)
    ]


def expected_answers(bodies: list[dict[str, Any]], model: str | None) -> list[dict[str, Any]]:
    """The in-process scorer's answer to each body (same model as the server)."""
    from reward_server.core import ScoreItem, score_batch
    from reward_server.encoders.loading import load_encoder

    encoder = load_encoder("onnx", model)
    out = []
    for body in bodies:
        score = score_batch([ScoreItem(**it) for it in body["items"]], encoder)
        out.append({**json.loads(json.dumps(score.as_dict())), "encoder": encoder.name})
    return out


def run_level(
    client: httpx.Client,
    url: str,
    bodies: list[dict[str, Any]],
    expected: list[dict[str, Any]],
    concurrency: int,
    duration: float,
) -> LevelResult:
    """``concurrency`` closed-loop clients for ``duration`` seconds."""
    result = LevelResult(concurrency, duration)
    lock = threading.Lock()
    counter = iter(range(10**9))
    stop_at = time.monotonic() + duration

    def client_loop() -> None:
        while time.monotonic() < stop_at:
            with lock:
                i = next(counter) % len(bodies)
            t0 = time.monotonic()
            r = client.post(url + "/v1/score", json=bodies[i])
            elapsed = time.monotonic() - t0
            ok = r.is_success
            same = ok and close(r.json(), expected[i])
            with lock:
                if not ok:
                    result.non_2xx += 1
                    result.statuses[r.status_code] = result.statuses.get(r.status_code, 0) + 1
                    continue
                result.latencies.append(elapsed)
                result.completions += len(bodies[i]["items"])
                if not same:
                    result.mismatches += 1

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - t0  # includes the last requests' tails
    return result


def batch_stats(client: httpx.Client, url: str) -> str:
    """Mean requests and texts per encoder call, from the server's metrics."""
    values: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        for name in (
            "sde2_batch_requests_sum",
            "sde2_batch_requests_count",
            "sde2_batch_texts_sum",
        ):
            if line.startswith(name + " "):
                values[name] = float(line.split()[-1])
    calls = values.get("sde2_batch_requests_count", 0.0)
    if not calls:
        return "no encoder calls"
    return (
        f"{calls:.0f} encoder calls, {values['sde2_batch_requests_sum'] / calls:.2f} requests "
        f"and {values['sde2_batch_texts_sum'] / calls:.1f} distinct texts per call"
    )


def main(argv: list[str] | None = None) -> int:
    """Run every level; 1 if any answer was non-2xx or differed from the in-process scorer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per level")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies")
    parser.add_argument("--completions", type=int, default=8, help="completions per request")
    parser.add_argument("--pool", type=int, default=48, help="distinct request bodies (cycled)")
    parser.add_argument("--url", default=None, help="use this running server instead")
    parser.add_argument("--model", default=None, help="model for the server and the checker")
    parser.add_argument(
        "--server-args", default="", help="extra flags for the server it starts, e.g. '--workers 2'"
    )
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]

    bodies = make_bodies(args.pool, args.completions)
    t0 = time.monotonic()
    expected = expected_answers(bodies, args.model)
    print(f"expected answers for {len(bodies)} bodies in {time.monotonic() - t0:.1f} s")

    server = None
    url = args.url
    if url is None:
        from tests.server_process import ServerProcess

        model_dir = Path(args.model) if args.model else _default_model()
        # Closed-loop clients queue by design (latency ~ concurrency x service time); on a
        # small shared CPU 32 of them can outlast the default 120 s deadline, which would
        # measure the deadline rather than the server.
        extra = ("--cache-size", "0", "--queue-capacity", str(max(levels) * 2))
        extra += ("--request-timeout", "900")
        extra += tuple(args.server_args.split())
        server = ServerProcess(model_dir, *extra, grpc=False).start()
        url = server.url
    results = []
    try:
        with httpx.Client(timeout=300.0, limits=httpx.Limits(max_connections=128)) as client:
            run_level(client, url, bodies[:2], expected[:2], 1, 0.1)  # warm the connection
            print(HEADER)
            for level in levels:
                res = run_level(client, url, bodies, expected, level, args.duration)
                results.append(res)
                print(
                    res.row() + (f"  statuses {res.statuses}" if res.statuses else ""), flush=True
                )
            print(batch_stats(client, url))
    finally:
        if server is not None:
            server.stop()
    bad = sum(r.non_2xx + r.mismatches for r in results)
    print("OK: every answer 2xx and equal to the in-process scorer" if not bad else "FAILED")
    return 1 if bad else 0


def _default_model() -> Path:
    from reward_server.encoders.model_store import resolve_model

    return Path(resolve_model(None))


if __name__ == "__main__":
    sys.exit(main())
