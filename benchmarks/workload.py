"""The standard GRPO-step workload shared by the benchmarks and the load tests.

One step is 8 prompts × 8 completions; each completion holds 1–10 strategies whose reasoning is
30–120 words cut from GSM8K train solutions (so texts look like real math reasoning; the subset
shipped in ``reward_server/data``), and about half of the completions contain a strategy whose
outcome is the gold answer.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from reward_server.encoders.fidelity import find_gsm8k, read_gsm8k

_CALC = re.compile(r"<<[^>]*>>")


def load_gsm8k(path: Path | None = None, limit: int = 2000) -> list[dict[str, str]]:
    """Questions with their worked solution (calculator annotations removed) and gold answer.

    Default: the 400-problem subset shipped in the package (:mod:`reward_server.data`); a file
    is read as the export's fidelity check reads it (:func:`read_gsm8k`: a bad row names its
    line and field).
    """
    rows = []
    for record in read_gsm8k(find_gsm8k(path))[:limit]:
        solution, _, gold = record["answer"].rpartition("####")
        rows.append(
            {
                "question": record["question"],
                "solution": _CALC.sub("", solution),
                "gold": gold.strip(),
            }
        )
    return rows


def _reasoning(rng: random.Random, words: list[str]) -> str:
    n = rng.randint(30, 120)
    start = rng.randrange(max(1, len(words) - n))
    text = words[start : start + n]
    while len(text) < n:  # short pool: wrap around
        text += words[: n - len(text)]
    return " ".join(text)


def grpo_step(
    seed: int = 0, prompts: int = 8, generations: int = 8, rows: list[dict[str, str]] | None = None
) -> list[dict[str, Any]]:
    """One step's items in the SPEC §6 wire shape, with ``group`` = prompt index."""
    rng = random.Random(seed)
    rows = rows if rows is not None else load_gsm8k()
    pool = " ".join(r["solution"] for r in rng.sample(rows, 200)).split()
    items = []
    for p in range(prompts):
        row = rng.choice(rows)
        for _ in range(generations):
            n = rng.randint(1, 10)
            correct_at = rng.randrange(n) if rng.random() < 0.5 else -1
            blocks = []
            for j in range(n):
                outcome = row["gold"] if j == correct_at else str(rng.randint(0, 999))
                blocks.append(
                    f'<strategy id="{j + 1}">\n<reasoning>{_reasoning(rng, pool)}</reasoning>\n'
                    f"<strategy_outcome>{outcome}</strategy_outcome>\n</strategy>"
                )
            final = row["gold"] if rng.random() < 0.4 else str(rng.randint(0, 999))
            completion = "\n".join(blocks) + f"\n<final_answer>{final}</final_answer>"
            items.append(
                {
                    "completion": completion,
                    "answer": row["gold"],
                    "prompt": row["question"],
                    "group": str(p),
                }
            )
    return items


#: What real model output holds and the standard step does not, for ``bench_score.py``'s (D):
#: reasoning broken into lines (field cleaning folds the breaks, so the reward is the standard
#: step's), one character beyond Latin-1 in the step (an arrow at the end of one reasoning),
#: a comparison in each completion's first reasoning (a "<" that is text, not a tag), and
#: Markdown in every reasoning (a bold lead and a fenced line of code).
SHAPES = (
    "reasoning with line breaks",
    "one character beyond Latin-1",
    "a '<' in the reasoning",
    "Markdown in the reasoning",
)


def reshape(step: list[dict[str, Any]], shape: str) -> list[dict[str, Any]]:
    """``step`` with its completions in one of :data:`SHAPES`."""
    if shape == SHAPES[0]:
        return _replaced(step, ". ", ".\n")
    if shape == SHAPES[1]:
        return [*_replaced(step[:1], "</reasoning>", " \u2192</reasoning>", 1), *step[1:]]
    if shape == SHAPES[2]:
        return _replaced(step, "</reasoning>", ", as 3 < 5</reasoning>", 1)
    if shape == SHAPES[3]:
        bold = _replaced(step, "<reasoning>", "<reasoning>**Step:** ")
        return _replaced(bold, "</reasoning>", "\n```py\nx = 1\n```</reasoning>")
    raise ValueError(f"unknown shape {shape!r}: one of {SHAPES}")


def _replaced(
    step: list[dict[str, Any]], old: str, new: str, count: int = -1
) -> list[dict[str, Any]]:
    return [{**item, "completion": item["completion"].replace(old, new, count)} for item in step]
