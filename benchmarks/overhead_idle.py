"""(D), everything but the encoder in process, after different things: what the benchmark's (D)
pays for being taken between two requests.

``bench_score.py`` times (D) and (E) alternately, so each (D) follows a ``POST /v1/score``. This
script times (D) on the same standard steps (embeddings from the zero-cost table,
:mod:`benchmarks.table_server`) after each of: nothing (back to back), one request to the table
server, the request then a sleep, the request then a busy loop. The settings take turns, each
``--steps`` times, over ``--cycles`` cycles; it prints each setting's p50 per cycle (the rewards
must be the same every time: the same work).

    python benchmarks/overhead_idle.py [--steps 200] [--cycles 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_score import start_table_server
from benchmarks.table_server import TableEncoder
from benchmarks.workload import grpo_step, load_gsm8k
from reward_server.core import ScoreItem, finish_batch, prepare_batch
from reward_server.encoders.loading import export_engine
from reward_server.encoders.model_store import resolve_model

_JSON = {"content-type": "application/json"}


def _sleep(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


def _spin(seconds: float) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return spin


#: Each setting: whether a request comes first, then what runs before (D).
SETTINGS: dict[str, tuple[bool, Callable[[], None] | None]] = {
    "nothing (back to back)": (False, None),
    "one POST /v1/score": (True, None),
    "the request, then 2 ms asleep": (True, _sleep(0.002)),
    "the request, then 2 ms of busy loop": (True, _spin(0.002)),
    "the request, then 20 ms asleep": (True, _sleep(0.02)),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed (D)s a setting a cycle")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--port", type=int, default=18741)
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    args = parser.parse_args(argv)

    encoder = export_engine("onnx")(resolve_model(args.model))
    rows = load_gsm8k()
    steps = [grpo_step(seed=100 + r, prompts=8, rows=rows) for r in range(8)]
    table = TableEncoder.of_steps(steps, encoder)
    items = [[ScoreItem(**i) for i in st] for st in steps]
    bodies = [json.dumps({"items": st}).encode() for st in steps]

    def in_process(i: int) -> float:
        """(D) of step ``i`` in ms; its rewards must be the back-to-back ones."""
        t0 = time.perf_counter()
        prepared = prepare_batch(items[i % len(items)])
        rewards = finish_batch(prepared, table.encode(prepared.texts)).rewards
        ms = (time.perf_counter() - t0) * 1000
        if rewards != expected[i % len(items)]:
            raise RuntimeError(f"step {i % len(items)}: other rewards than back to back")
        return ms

    expected: list[list[float]] = []
    for st in items:
        prepared = prepare_batch(st)
        expected.append(finish_batch(prepared, table.encode(prepared.texts)).rewards)
    with tempfile.TemporaryDirectory() as tmp:
        table.save(Path(tmp) / "table.npz")
        server = start_table_server(Path(tmp) / "table.npz", args.port)
    results: dict[str, list[float]] = {name: [] for name in SETTINGS}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as http:

            def timed(request: bool, then: Callable[[], None] | None, i: int) -> float:
                if request:
                    http.post("/v1/score", content=bodies[i % len(items)], headers=_JSON)
                if then is not None:
                    then()
                return in_process(i)

            for _ in range(args.cycles):
                for name, (request, then) in SETTINGS.items():
                    times = [timed(request, then, i) for i in range(args.steps + len(items))]
                    results[name].append(statistics.median(times[len(items) :]))  # warm-up off
    finally:
        server.terminate()
        server.wait(30)
    print(f"(D) p50 ms, {args.steps} steps a setting, {args.cycles} cycles (settings in turn):")
    for name, p50s in results.items():
        print(f"  {name:<40}" + "".join(f"{p:>8.2f}" for p in p50s))
    print("rewards: the same in every setting")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
