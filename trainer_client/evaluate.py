"""``sde2-eval``: the paper's Table 1 for one or several runs, scored through the reward server.

A run is either generated here (``--model``, on ``--dataset`` questions, with the
multi-strategy prompt) or read from a JSONL of completions (``--completions NAME=FILE``; each line
has ``completion`` and ``answer``, optionally ``answer_type`` and ``num_tokens``). Every
completion is scored by the server with ``diagnostics`` on — the same parser and matchers as the
training reward, so ACC here is the reward's own notion of correct — and summarized as ACC with
its 95% Wilson interval, S-ACC, #STR, #TOK (policy tokenizer), Words and distinct strategies.
Output: a Markdown table on stdout, ``--json`` for machines, and with several runs ``--plot``
draws ACC against #TOK per method (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reward_server.core.answers import gold_text
from trainer_client.client import RewardClient
from trainer_client.datasets import DATASETS, DEFAULT_SOURCES, Example, load_examples
from trainer_client.metrics import RunMetrics, markdown_table, summarize
from trainer_client.retry import RetryPolicy

log = logging.getLogger("sde2.eval")
SCORE_CHUNK = 256  # items per scoring request: well under the server's default max_items


@dataclass
class Run:
    """Completions of one method with their gold answers."""

    method: str
    completions: list[str]
    answers: list[str]
    answer_type: str
    num_tokens: list[int] | None


def build_parser() -> argparse.ArgumentParser:
    """All flags of ``sde2-eval``."""
    p = argparse.ArgumentParser(
        prog="sde2-eval",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--reward-url", action="append", required=True, help="reward server URL(s)")
    p.add_argument("--model", help="policy to generate with: hub id, folder, or .gguf file")
    p.add_argument("--gguf-file", help="GGUF file inside --model")
    p.add_argument("--adapter", help="a LoRA adapter folder (e.g. sde2-train's output/final)")
    p.add_argument("--method", help="label of the generated run (default: the model name)")
    p.add_argument(
        "--completions",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a run read from JSONL (completion, answer[, answer_type, num_tokens]); repeatable",
    )
    p.add_argument("--tokenizer", help="tokenizer for #TOK of read runs (default: --model)")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k")
    p.add_argument("--data", help=f"file, folder or hub id (default {DEFAULT_SOURCES})")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, help="evaluate at most this many questions")
    p.add_argument("--cop-base", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.2, help="paper: 0.1-0.3; 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--batch-size", type=int, default=8, help="questions per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--recipe", default="sde2", help="recipe whose parameters score (ACC is the same)"
    )
    p.add_argument("--save-completions", type=Path, help="write the generated run as JSONL")
    p.add_argument("--json", type=Path, help="write the metrics as JSON")
    p.add_argument("--plot", type=Path, help="PNG of ACC vs #TOK per method (needs matplotlib)")
    return p


def read_run(spec: str) -> Run:
    """``NAME=FILE`` to a run; a run must use one answer type (one scoring request family)."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).stem, spec
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no completions")
    types = {str(r.get("answer_type", "numeric")) for r in rows}
    if len(types) > 1:
        raise SystemExit(f"{path}: mixed answer types {sorted(types)}; split the file")
    have_tokens = all(r.get("num_tokens") is not None for r in rows)
    answers = []
    for line, row in enumerate(rows, 1):
        try:
            answers.append(gold_text(row.get("answer")))
        except ValueError as exc:
            raise SystemExit(f"{path}: completion {line}, answer: {exc}") from None
    return Run(
        method=name,
        completions=[str(r["completion"]) for r in rows],
        answers=answers,
        answer_type=types.pop(),
        num_tokens=[int(r["num_tokens"]) for r in rows] if have_tokens else None,
    )


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Completion lengths under the policy's tokenizer (no special tokens added)."""
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def generate_run(args: argparse.Namespace, examples: list[Example]) -> tuple[Run, Any]:
    """Generate one completion per question with the multi-strategy prompt."""
    import torch
    from tqdm.auto import tqdm

    from trainer_client.modeling import ModelRef, has_chat_template, load_model, load_tokenizer

    assert args.model is not None
    ref = ModelRef.parse(args.model, args.gguf_file)
    tokenizer = load_tokenizer(ref)
    model = load_model(ref, for_training=False)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    torch.manual_seed(args.seed)
    chat = has_chat_template(tokenizer)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        if args.temperature > 0
        else {"do_sample": False}
    )
    completions: list[str] = []
    for start in tqdm(range(0, len(examples), args.batch_size), desc="generating", unit="batch"):
        batch = examples[start : start + args.batch_size]
        if chat:
            texts = [
                tokenizer.apply_chat_template(
                    ex.record(True)["prompt"], add_generation_prompt=True, tokenize=False
                )
                for ex in batch
            ]
        else:
            texts = [ex.record(False)["prompt"] for ex in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        enc = {k: v.to(model.device) for k, v in enc.items()}
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    method = args.method or Path(ref.gguf_file or ref.name_or_path).stem
    run = Run(
        method,
        completions,
        [ex.answer for ex in examples],
        examples[0].answer_type,
        count_tokens(tokenizer, completions),
    )
    return run, tokenizer


def score_run(client: RewardClient, run: Run, recipe: str) -> RunMetrics:
    """Score every completion (raw, with diagnostics) and summarize."""
    items_out = []
    for start in range(0, len(run.completions), SCORE_CHUNK):
        stop = start + SCORE_CHUNK
        items = [
            {"completion": c, "answer": a}
            for c, a in zip(run.completions[start:stop], run.answers[start:stop], strict=True)
        ]
        result = client.score(
            items, recipe=recipe, answer_type=run.answer_type, normalize=False, diagnostics=True
        )
        items_out.extend(result.items)
    return summarize(run.method, items_out, run.completions, run.num_tokens)


def plot_runs(rows: Sequence[RunMetrics], path: Path) -> bool:
    """ACC (with its CI) against #TOK per method; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in rows:
        if r.tokens is None:
            continue
        ax.errorbar(
            r.tokens, r.acc, yerr=[[r.acc - r.ci_low], [r.ci_high - r.acc]], fmt="o", capsize=3
        )
        ax.annotate(r.method, (r.tokens, r.acc), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("#TOK (mean completion tokens)")
    ax.set_ylabel("ACC (%)")
    ax.set_title("Accuracy against tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sde2-eval``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if not args.model and not args.completions:
        raise SystemExit("give --model to generate, or --completions NAME=FILE to read runs")
    runs: list[Run] = []
    tokenizer: Any = None
    if args.model:
        examples = load_examples(args.dataset, args.data, args.split, args.limit, args.cop_base)
        run, tokenizer = generate_run(args, examples)
        runs.append(run)
        if args.save_completions:
            with args.save_completions.open("w") as f:
                for c, a, t in zip(run.completions, run.answers, run.num_tokens or [], strict=True):
                    row = {"completion": c, "answer": a, "answer_type": run.answer_type}
                    f.write(json.dumps({**row, "num_tokens": t}) + "\n")
    read = [read_run(spec) for spec in args.completions]
    if any(r.num_tokens is None for r in read) and (args.tokenizer or args.model):
        if tokenizer is None:
            from trainer_client.modeling import ModelRef, load_tokenizer

            tokenizer = load_tokenizer(ModelRef.parse(args.tokenizer or args.model, args.gguf_file))
        for r in read:
            if r.num_tokens is None:
                r.num_tokens = count_tokens(tokenizer, r.completions)
    runs.extend(read)

    retry = RetryPolicy(max_attempts=None, deadline=600.0)  # the deadline rules
    with RewardClient(args.reward_url, retry=retry) as client:
        rows = [score_run(client, r, args.recipe) for r in runs]
    print(markdown_table(rows))
    payload = {"runs": [r.as_dict() for r in rows]}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1))
    if args.plot:
        if len(rows) < 2:
            log.warning("--plot compares methods: give at least two runs")
        elif plot_runs(rows, args.plot):
            log.info("plot written to %s", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
