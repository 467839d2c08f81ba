"""Servers of different configurations answering the same fresh standard steps in turn.

Each side is a server: an encoder backend, and optionally another export folder, another
checkout of this project or extra environment variables (what a setting of one process, such
as a glibc tunable, needs). Every step goes to every server, the order rotating step by step,
so the machine's load moves all sides alike; each side's rewards must agree with the first's
within SPEC's 1e-5. Prints each server's median step time and ``x-encode-time``, and the
median over steps of each side's per-step speed-up over the first.

    python benchmarks/ab_servers.py --steps 14 onnx ctranslate2
    python benchmarks/ab_servers.py onnx "onnx model=/path/to/another/export"
    python benchmarks/ab_servers.py onnx "onnx tree=../other-checkout"
    python benchmarks/ab_servers.py onnx "onnx env=GLIBC_TUNABLES=glibc.malloc.hugetlb=1"

A side is its backend then ``key=value`` words (shell quoting applies inside): ``model=DIR``,
``tree=DIR``, ``env=NAME=VALUE`` (repeatable).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_score import start_server
from benchmarks.workload import grpo_step, load_gsm8k
from reward_server.encoders.loading import EXPORT_BACKENDS
from reward_server.encoders.model_store import resolve_model

#: Largest reward difference allowed between sides (SPEC's fidelity bound).
TOLERANCE = 1e-5


@dataclass
class Side:
    """One server's configuration (see the module docstring)."""

    label: str
    backend: str
    model: Path | None = None
    tree: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def parse_side(text: str) -> Side:
    """A side from its words.

    >>> side = parse_side("onnx env=A=1 model=/m")
    >>> side.backend, side.model, side.tree, side.env
    ('onnx', PosixPath('/m'), None, {'A': '1'})
    >>> parse_side("onnx colour=red")
    Traceback (most recent call last):
    ...
    ValueError: 'colour=red': a side's words are model=DIR, tree=DIR or env=NAME=VALUE
    """
    backend, *words = shlex.split(text)
    if backend not in EXPORT_BACKENDS:
        raise ValueError(f"{backend!r}: a side starts with one of {', '.join(EXPORT_BACKENDS)}")
    side = Side(text, backend)
    for word in words:
        key, _, value = word.partition("=")
        if key == "model" and value:
            side.model = Path(value)
        elif key == "tree" and value:
            side.tree = Path(value).resolve()
        elif key == "env" and "=" in value:
            name, _, setting = value.partition("=")
            side.env[name] = setting
        else:
            raise ValueError(f"{word!r}: a side's words are model=DIR, tree=DIR or env=NAME=VALUE")
    return side


def _serve_in_turn(
    clients: Sequence[httpx.Client], steps: Sequence[list[dict[str, Any]]]
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Each step to every server, the order rotating step by step; per server, each timed
    step's seconds and ``x-encode-time`` (the first step warms up, untimed), and its largest
    reward difference from the first server's."""
    seconds: list[list[float]] = [[] for _ in clients]
    encode: list[list[float]] = [[] for _ in clients]
    worst = [0.0 for _ in clients]
    order = list(range(len(clients)))
    for k, step in enumerate(steps):
        rewards: dict[int, list[float]] = {}
        for i in order[k % len(order) :] + order[: k % len(order)]:
            start = time.perf_counter()
            response = clients[i].post("/v1/score", json={"items": step})
            elapsed = time.perf_counter() - start
            response.raise_for_status()
            rewards[i] = response.json()["rewards"]
            if k:
                seconds[i].append(elapsed)
                encode[i].append(float(response.headers["x-encode-time"]) / 1000)
        for i in order:
            diff = float(np.max(np.abs(np.subtract(rewards[0], rewards[i]))))
            worst[i] = max(worst[i], diff)
    return seconds, encode, worst


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sides", nargs="+", help="two or more, each 'BACKEND [key=value ...]'")
    parser.add_argument("--steps", type=int, default=14, help="timed steps (after one warm-up)")
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    parser.add_argument("--port", type=int, default=18850)
    args = parser.parse_args(argv)
    try:
        sides = [parse_side(text) for text in args.sides]
    except ValueError as exc:
        parser.error(str(exc))
    if len(sides) < 2:
        parser.error("give two sides or more")
    default_model = resolve_model(args.model)
    rows = load_gsm8k()
    steps = [grpo_step(seed=700 + r, rows=rows) for r in range(args.steps + 1)]
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for i, side in enumerate(sides):
            server, _ = start_server(
                side.model or default_model,
                args.port + i,
                "cpu",
                side.backend,
                tree=side.tree,
                env=side.env,
            )
            servers.append(server)
        with ExitStack() as stack:
            clients = [
                stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300))
                for port in range(args.port, args.port + len(sides))
            ]
            seconds, encode, worst = _serve_in_turn(clients, steps)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    print(f"{args.steps} fresh standard steps, each to every server (order rotating)")
    width = max(len(side.label) for side in sides) + 2
    header = f"{'median s':>10}{'x-encode-time s':>18}{'vs first':>10}{'max diff':>10}"
    print(f"{'side':<{width}}{header}")
    for i, side in enumerate(sides):
        speed = statistics.median(a / b for a, b in zip(seconds[0], seconds[i], strict=True))
        print(
            f"{side.label:<{width}}{statistics.median(seconds[i]):>10.3f}"
            f"{statistics.median(encode[i]):>18.3f}{speed:>9.3f}x{worst[i]:>10.1e}"
        )
    ok = max(worst) <= TOLERANCE
    print(f"rewards agree with the first side (<= {TOLERANCE:g}): {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
