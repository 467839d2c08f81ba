"""Two encoder backends behind two servers, answering the same fresh standard steps in turn.

Each step goes to both servers (the order alternating step by step), so the machine's load
moves both alike; the rewards of the two must agree within SPEC's 1e-5. Prints each server's
median step time and ``x-encode-time``, and the median over steps of the per-step speed-up of
the second backend over the first.

    python benchmarks/ab_backends.py --backends onnx,ctranslate2 --steps 14
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_score import start_server
from benchmarks.workload import grpo_step, load_gsm8k
from reward_server.encoders.loading import EXPORT_BACKENDS
from reward_server.encoders.model_store import resolve_model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="onnx,ctranslate2", help="two, comma-separated")
    parser.add_argument("--steps", type=int, default=14, help="timed steps (after one warm-up)")
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    parser.add_argument("--port", type=int, default=18850)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if len(backends) != 2 or not set(backends) <= set(EXPORT_BACKENDS):
        parser.error(f"--backends takes two of {', '.join(EXPORT_BACKENDS)}")
    model_dir = resolve_model(args.model)
    rows = load_gsm8k()
    steps = [grpo_step(seed=700 + r, rows=rows) for r in range(args.steps + 1)]
    servers = [start_server(model_dir, args.port + i, "cpu", b)[0] for i, b in enumerate(backends)]
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    encode: dict[str, list[float]] = {b: [] for b in backends}
    worst = 0.0
    try:
        clients = {
            b: httpx.Client(base_url=f"http://127.0.0.1:{args.port + i}", timeout=300)
            for i, b in enumerate(backends)
        }
        for k, step in enumerate(steps):
            rewards = {}
            for b in backends if k % 2 == 0 else backends[::-1]:
                start = time.perf_counter()
                response = clients[b].post("/v1/score", json={"items": step})
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                rewards[b] = response.json()["rewards"]
                if k:  # step 0 warms both up
                    seconds[b].append(elapsed)
                    encode[b].append(float(response.headers["x-encode-time"]) / 1000)
            worst = max(worst, float(np.max(np.abs(np.subtract(*rewards.values())))))
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    print(f"{args.steps} fresh standard steps, each to both servers (order alternating)")
    print(f"{'backend':<14}{'median s':>10}{'x-encode-time s':>18}")
    for b in backends:
        print(f"{b:<14}{statistics.median(seconds[b]):>10.3f}{statistics.median(encode[b]):>18.3f}")
    first, second = backends
    speed = statistics.median(a / b for a, b in zip(seconds[first], seconds[second], strict=True))
    print(f"{second} vs {first}, median of per-step speed-ups: {speed:.3f}x")
    print(f"rewards agree (<= 1e-5): {'yes' if worst <= 1e-5 else 'NO'} ({worst:.1e})")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
