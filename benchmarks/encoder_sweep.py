"""Encoder settings alternated in one process: tokens/s and % of the same-round fp32 floor.

The matrix-product floor (``bench_score.matmul_floor_gflops``) moves 2× with the machine's load,
so a setting is only compared with the others inside one round: each round measures the floor,
then encodes the texts of the standard steps once with every setting, in turn. Embeddings are
checked against the first setting's first (min cosine, max |diff|).

Settings: ``default`` (what the server runs), ``threads1`` (one intra-op thread), ``streamsN``
(N batches at once, sharing the threads: ``streams1`` is one batch at a time with every
thread), ``spin`` (spinning intra-op threads), ``tokensN`` (``max_batch_tokens=N``),
``noarena`` (no CPU memory arena): onnxruntime's encoder with one setting changed.
``openvino`` is the OpenVINO backend (``--backend openvino``, the ``openvino`` extra) with its
defaults, and ``openvino-<change>`` it with one of the changes above (``openvino-tokens2048``);
``ctranslate2`` and ``ctranslate2-<change>`` the same for CTranslate2 (``--backend ctranslate2``).

    python benchmarks/encoder_sweep.py --rounds 5 --settings default,streams1,threads1
    python benchmarks/encoder_sweep.py --rounds 6 --steps 2 --settings default,openvino
    python benchmarks/encoder_sweep.py --rounds 6 --steps 2 --settings default,ctranslate2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_score import every_reasoning, ideal_flops, matmul_floor_gflops
from benchmarks.workload import grpo_step, load_gsm8k
from reward_server.core import ScoreItem, prepare_batch
from reward_server.encoders.batched import BatchedEncoder
from reward_server.encoders.loading import EXPORT_BACKENDS, export_engine
from reward_server.encoders.model_store import resolve_model

#: The engines a setting may name before its change (``openvino-tokens2048``).
OTHER_ENGINES = tuple(b for b in EXPORT_BACKENDS if b != "onnx")


def make_encoder(setting: str, model: Path) -> BatchedEncoder:
    """The encoder of one setting (see the module docstring), warmed up."""
    engine, change = "onnx", setting
    if setting.startswith(OTHER_ENGINES):
        engine, _, change = setting.partition("-")
    kwargs: dict[str, Any] = {}
    if change == "threads1":
        kwargs["intra_op_threads"] = 1
    elif change == "spin" and engine == "onnx":
        kwargs["allow_spinning"] = True
    elif change == "noarena" and engine == "onnx":
        kwargs["memory_arena"] = False
    elif change.startswith("tokens"):
        kwargs["max_batch_tokens"] = int(change.removeprefix("tokens"))
    elif change.startswith("streams"):
        kwargs["streams"] = int(change.removeprefix("streams"))
    elif change not in ("default", ""):
        raise SystemExit(f"unknown setting {setting!r}")
    encoder = export_engine(engine)(model, **kwargs)  # type: ignore[arg-type]
    encoder.warmup()
    return encoder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settings", default="default,threads1")
    parser.add_argument("--steps", type=int, default=1, help="standard steps whose texts to encode")
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    parser.add_argument(
        "--texts",
        choices=("all", "needed"),
        default="all",
        help="every reasoning text of the steps, or only those the reward needs (what the "
        "server encodes: the step's distinct texts of items with chi = 0 and m >= 2)",
    )
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    model = resolve_model(args.model)
    rows = load_gsm8k()
    # Without diagnostics, the prepared texts are those the reward needs (the server's work).
    steps = [
        prepare_batch([ScoreItem(**i) for i in grpo_step(seed=100 + seed, rows=rows)])
        for seed in range(args.steps)
    ]
    texts = [
        text
        for prepared in steps
        for text in (prepared.texts if args.texts == "needed" else every_reasoning(prepared))
    ]
    encoders = {name: make_encoder(name, model) for name in names}
    reference = encoders[names[0]].encode(texts)
    for name, encoder in encoders.items():
        out = encoder.encode(texts)
        cosine = np.sum(out * reference, axis=1) / (
            np.linalg.norm(out, axis=1) * np.linalg.norm(reference, axis=1)
        )
        print(
            f"{name}: min cosine vs {names[0]} {float(np.min(cosine)):.9f}, "
            f"max |diff| {float(np.max(np.abs(out - reference))):.1e}"
        )
    flops = ideal_flops(encoders[names[0]]._tokenizer, texts)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        floor = matmul_floor_gflops(repeats=3)
        line = []
        for name, encoder in encoders.items():
            start = time.perf_counter()
            _, stats = encoder.encode_with_stats(texts)
            tokens_per_s = stats.tokens / (time.perf_counter() - start)
            share = tokens_per_s / (stats.tokens / (flops / (floor * 1e9)))
            results[name].append((tokens_per_s, share))
            line.append(f"{name} {tokens_per_s:,.0f} tokens/s ({100 * share:.0f}%)")
        print(f"round {r} (floor {floor:.0f} GFLOP/s): " + ", ".join(line), flush=True)
    print(f"{'setting':<14}{'tokens/s':>10}{'% of floor':>12}{'vs ' + names[0]:>16}  (medians)")
    for name in names:
        ratio = statistics.median(
            a[0] / b[0] for a, b in zip(results[name], results[names[0]], strict=True)
        )
        tokens = statistics.median(x[0] for x in results[name])
        share = statistics.median(x[1] for x in results[name])
        print(f"{name:<14}{tokens:>10,.0f}{100 * share:>11.0f}%{ratio:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
