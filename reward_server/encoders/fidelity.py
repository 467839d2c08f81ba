"""Fidelity measurement of an encoder backend against a reference, on reasoning-like texts.

Why a module of its own: the same text set and the same gate are used at export time (the numbers
go into ``manifest.json``), by the tests, and by anyone re-checking an export. The quantity that
matters for SD-E² is not cosine to the reference as such but whether the reward changes: ``Uniq``
thresholds pairwise similarities at δ, so a small embedding error flips a keep/drop decision when a
pair sits near δ. The int8 gate therefore compares per-completion ``Uniq`` decisions and rewards
(SPEC §3), not just vector distances.

Texts are built from GSM8K train solutions, because those are the kind of text a ``<reasoning>``
block holds: the package ships a 400-problem subset (:mod:`reward_server.data`), so an installed
server measures on the same texts as a source checkout and reads nothing outside the package. A
file given explicitly (``sde2-reward export --gsm8k``) replaces it (the manifest records which
file was used).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.core.components import semantic_exploration
from reward_server.core.geometry import cosine_matrix, kept_mask, semantic_gain
from reward_server.core.params import RewardParams
from reward_server.data import GSM8K_TRAIN
from reward_server.jsonl_files import InputError, json_type, jsonl_lines, parse_json_line

#: The similarity thresholds the int8 gate checks (the default δ is 0.80).
GATE_DELTAS: tuple[float, ...] = (0.70, 0.75, 0.80, 0.85, 0.90)
#: Minimum share of completions whose Uniq decisions must agree with fp32, at every δ.
GATE_MIN_AGREEMENT = 0.995

_CALC = re.compile(r"<<[^<>]*>>")


def find_gsm8k(path: str | Path | None = None) -> Path:
    """The GSM8K train file to use: ``path`` when given, else the subset shipped in the package."""
    if not path:
        return GSM8K_TRAIN
    if Path(path).is_dir():
        raise FileNotFoundError(f"GSM8K file {path} is a folder; name its train.jsonl")
    if not Path(path).is_file():
        raise FileNotFoundError(f"GSM8K file {path} not found")
    return Path(path)


def _clean_solution(answer: str, keep_calc: bool) -> list[str]:
    """GSM8K solution -> reasoning lines; ``#### N`` becomes a sentence as a model would write."""
    lines = []
    for raw in answer.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("####"):
            line = f"So the answer is {line[4:].strip()}."
        lines.append(line if keep_calc else _CALC.sub("", line))
    return lines


def read_gsm8k(path: Path) -> list[dict[str, str]]:
    """The rows of a GSM8K JSONL file, each a ``question`` and an ``answer`` string; a file
    that holds none, or a line that is no such row, is an :class:`InputError` naming the file,
    the line and the field (it was a ``KeyError`` or ``ZeroDivisionError`` traceback, after
    the export had loaded and traced the model)."""
    rows = []
    for number, text in jsonl_lines(path):
        row = parse_json_line(path, number, text)
        if not isinstance(row, dict):
            raise InputError(f"{path}: line {number}: expected a JSON object, got {json_type(row)}")
        for name in ("question", "answer"):
            if not isinstance(row.get(name), str) or not row[name].strip():
                got = json_type(row[name]) if name in row else "missing"
                raise InputError(
                    f"{path}: line {number}: {name}: must be a non-empty string, got {got}"
                )
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no GSM8K rows (question, answer)")
    return rows


def load_problems(
    gsm8k: str | Path | None = None, n: int = 400, seed: int = 0
) -> tuple[list[tuple[str, list[str]]], str]:
    """``n`` (question, solution lines) pairs and a description of where they came from; a
    file that holds no such pairs is an :class:`InputError` (:func:`read_gsm8k`)."""
    rng = random.Random(seed)
    path = find_gsm8k(gsm8k)
    rows = read_gsm8k(path)
    picked = rng.sample(rows, min(n, len(rows)))
    problems = [
        (r["question"], _clean_solution(r["answer"], keep_calc=(i % 5 == 0)))
        for i, r in enumerate(picked)
    ]
    return problems, f"gsm8k:{path.name}(seed={seed})"


def build_texts(
    problems: Sequence[tuple[str, list[str]]], n: int = 300, seed: int = 0
) -> list[str]:
    """A mixed set of ``n`` reasoning texts meant to stress an encoder backend.

    Mix: single solution lines (short), whole solutions (typical), question + solution, and
    concatenations of several solutions that run past 256 word pieces so truncation is exercised.
    Order is shuffled so that any batch mixes lengths (heavy padding unless the backend sorts).
    """
    rng = random.Random(seed)
    texts: list[str] = []
    kinds = ["line", "whole", "qa", "long"]
    i = 0
    while len(texts) < n:
        q, lines = problems[i % len(problems)]
        kind = kinds[i % len(kinds)]
        if kind == "line":
            texts.append(rng.choice(lines))
        elif kind == "whole":
            texts.append(" ".join(lines))
        elif kind == "qa":
            texts.append(q + "\n" + "\n".join(lines))
        else:
            parts = [" ".join(p[1]) for p in rng.sample(list(problems), min(8, len(problems)))]
            texts.append(" ".join(parts))
        i += 1
    rng.shuffle(texts)
    return texts


@dataclass(frozen=True)
class Completion:
    """The reasoning texts of one synthetic completion's strategies, in order."""

    texts: tuple[str, ...]


def build_completions(
    problems: Sequence[tuple[str, list[str]]], n: int = 400, seed: int = 1
) -> list[Completion]:
    """``n`` multi-strategy completions whose strategies are similar, as real ones are.

    Each takes 2-6 reasoning texts for ONE problem (lines, partial and whole solutions, question +
    solution), sometimes with a text from another problem mixed in. Same-problem texts have
    cosines spread around 0.6-0.95, which is where the δ thresholds bite.
    """
    rng = random.Random(seed)
    out = []
    for k in range(n):
        q, lines = problems[k % len(problems)]
        pool = [*lines, " ".join(lines), q + " " + " ".join(lines)]
        if len(lines) >= 3:
            pool.append(" ".join(lines[:2]))
            pool.append(" ".join(lines[1:]))
        m = rng.randint(2, min(6, len(pool)))
        chosen = rng.sample(pool, m)
        if rng.random() < 0.3:
            other = problems[rng.randrange(len(problems))][1]
            chosen.insert(rng.randrange(len(chosen) + 1), " ".join(other))
        out.append(Completion(tuple(chosen)))
    return out


def uniq_keep(emb: npt.NDArray[np.float32], delta: float) -> tuple[bool, ...]:
    """SPEC §3 Uniq walk (the core's): keep ``h_i`` iff its max cosine to the kept ones is <= δ."""
    return tuple(kept_mask(cosine_matrix(emb), delta))


def sd_reward(emb: npt.NDArray[np.float32], delta: float) -> float:
    """The core's ``R_sd`` for a completion with χ = 0 (the only case using the encoder)."""
    gain, _, _ = semantic_gain(emb, delta)
    return semantic_exploration(False, gain, RewardParams(similarity_threshold=delta))


@dataclass
class GateReport:
    """Outcome of comparing a candidate encoder with the reference on Uniq decisions."""

    n_completions: int
    agreement: dict[str, float] = field(default_factory=dict)  # δ (as str) -> share agreeing
    max_reward_diff: dict[str, float] = field(default_factory=dict)  # δ -> max |Δ sd reward|
    min_agreement_required: float = GATE_MIN_AGREEMENT
    passed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form for the manifest."""
        return asdict(self)


def uniq_gate(
    ref_emb: Sequence[npt.NDArray[np.float32]],
    cand_emb: Sequence[npt.NDArray[np.float32]],
    deltas: Sequence[float] = GATE_DELTAS,
    min_agreement: float = GATE_MIN_AGREEMENT,
) -> GateReport:
    """Per-completion Uniq decisions of ``cand`` vs ``ref`` at every δ; pass iff all agree enough.

    ``ref_emb[i]`` / ``cand_emb[i]`` are the ``(m_i, d)`` embeddings of completion ``i``. A
    completion agrees at δ when its whole keep/drop vector is identical.
    """
    if len(ref_emb) != len(cand_emb) or not ref_emb:
        raise ValueError("need the same, non-zero number of completions for both encoders")
    report = GateReport(n_completions=len(ref_emb), min_agreement_required=min_agreement)
    passed = True
    for delta in deltas:
        agree = 0
        worst = 0.0
        for r, c in zip(ref_emb, cand_emb, strict=True):
            agree += uniq_keep(r, delta) == uniq_keep(c, delta)
            worst = max(worst, abs(sd_reward(r, delta) - sd_reward(c, delta)))
        share = agree / len(ref_emb)
        report.agreement[f"{delta:.2f}"] = share
        report.max_reward_diff[f"{delta:.2f}"] = worst
        passed = passed and share >= min_agreement
    report.passed = passed
    return report


def row_cosines(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Cosine of each row of ``a`` with the same row of ``b`` (in float64)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    num = np.sum(a64 * b64, axis=1)
    den = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return np.asarray(num / np.maximum(den, 1e-30), dtype=np.float64)
