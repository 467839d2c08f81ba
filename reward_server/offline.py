"""``sde2-reward score``: score a JSONL file offline through the server's own code path.

Each input line is one SPEC §6 item (``completion``, ``answer``, optional ``prompt``, ``group``,
``num_tokens``). The whole file is one batch, so normalization and group advantages are those of
a single ``/v1/score`` request holding every line. Each output line holds the item's diagnostics
(SPEC §6 ``items[]``) plus its components, normalized components, reward and advantage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO, get_args

import numpy as np
from pydantic import ValidationError

from reward_server.core import (
    RECIPES,
    AnswerType,
    BatchScore,
    NonFiniteRewardError,
    RewardParams,
    ScoreItem,
    finish_batch,
    prepare_batch,
)
from reward_server.encoders.base import EMBEDDING_DIM, Encoder
from reward_server.encoders.loading import BACKENDS, Backend
from reward_server.math_judge import IsolatedMathJudge

#: Texts per encoder call: small enough for a live progress bar, large enough to batch well.
CHUNK = 256


class InputError(ValueError):
    """A malformed input line, reported with its line number and field."""


def read_items(lines: TextIO) -> Iterator[ScoreItem]:
    """Parse JSONL items, naming the line and field of the first bad one."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"line {number}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise InputError(f"line {number}: expected a JSON object, got {type(record).__name__}")
        try:
            yield ScoreItem(**record)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "item"
            raise InputError(f"line {number}: {where}: {first['msg']}") from exc
        except TypeError as exc:  # unexpected keyword arguments
            raise InputError(f"line {number}: {exc}") from exc


def encode_with_progress(encoder: Encoder, texts: Sequence[str], show: bool) -> np.ndarray:
    """Encode in chunks behind a progress bar (long files take minutes on a CPU)."""
    from tqdm import tqdm

    parts = []
    with tqdm(total=len(texts), unit="text", desc="encoding", disable=not show) as bar:
        for start in range(0, len(texts), CHUNK):
            chunk = texts[start : start + CHUNK]
            parts.append(encoder.encode(chunk))
            bar.update(len(chunk))
    return np.concatenate(parts) if parts else np.zeros((0, EMBEDDING_DIM), np.float32)


def embed_with_progress(
    texts: Sequence[str], backend: Backend, model: str | None, show: bool
) -> np.ndarray:
    """The embeddings of ``texts`` behind a progress bar; the encoder is loaded only when some
    text needs it (loading costs seconds, and a batch may need no encoder at all)."""
    if not texts:
        return np.zeros((0, EMBEDDING_DIM), np.float32)
    from reward_server.encoders.loading import load_encoder

    return encode_with_progress(load_encoder(backend, model), texts, show)


def output_records(score: BatchScore) -> Iterator[dict[str, Any]]:
    """One JSON-able record per item: diagnostics, components, normalized values, reward."""
    for i, item in enumerate(score.items):
        yield {
            **item._asdict(),
            "reward": score.rewards[i],
            "components": {k: v[i] for k, v in score.components.items()},
            "normalized": {k: v[i] for k, v in score.normalized.items()},
            "advantage": None if score.advantages is None else score.advantages[i],
        }


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """``--recipe`` and ``--answer-type``, their choices read from the core (the registered
    recipes when the parser is built, and :data:`AnswerType`)."""
    parser.add_argument("--recipe", choices=list(RECIPES), default="sde2")
    parser.add_argument("--answer-type", choices=get_args(AnswerType), default="numeric")


def add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend`` (choices from :data:`BACKENDS`), ``--model`` and ``--quiet``: how the offline
    commands load the encoder and whether they show its progress."""
    parser.add_argument("--backend", choices=BACKENDS, default="onnx")
    parser.add_argument("--model", default=None, help="ONNX folder, HF folder or hub id")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``sde2-reward score``."""
    parser.add_argument("--in", dest="input", type=Path, required=True, help="input JSONL")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL ('-' for stdout)")
    add_recipe_arguments(parser)
    parser.add_argument(
        "--params", default="{}", help="reward parameters as JSON, e.g. '{\"explore_cap\": 0.7}'"
    )
    parser.add_argument(
        "--math-timeout",
        type=float,
        default=2.0,
        help="seconds one answer-type=math check may run before it counts as not equivalent",
    )
    parser.add_argument("--no-normalize", action="store_true", help="sum raw components")
    parser.add_argument("--diagnostics", action="store_true", help="Uniq/Div for every item")
    add_encoder_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Score ``--in`` into ``--out``; exit status 2 on bad input."""
    if args.math_timeout <= 0:
        print(
            f"sde2-reward score: --math-timeout must be > 0, got {args.math_timeout}",
            file=sys.stderr,
        )
        return 2
    judge = IsolatedMathJudge(time_limit=args.math_timeout)  # starts a process only if used
    try:
        params = RewardParams.model_validate_json(args.params)
        with args.input.open(encoding="utf-8") as f:
            items = list(read_items(f))
        prepared = prepare_batch(
            items,
            recipe=args.recipe,
            answer_type=args.answer_type,
            params=params,
            diagnostics=args.diagnostics,
            math_judge=judge,
        )
    except (InputError, ValidationError, ValueError, OSError, RuntimeError) as exc:
        print(f"sde2-reward score: {exc}", file=sys.stderr)
        return 2
    finally:
        judge.close()
    if judge.timeouts:
        print(
            f"{judge.timeouts} math checks ran past {args.math_timeout} s (not equivalent)",
            file=sys.stderr,
        )
    show = not args.quiet
    if show:
        print(f"{len(items)} items, {len(prepared.texts)} texts to embed", file=sys.stderr)
    embeddings = embed_with_progress(prepared.texts, args.backend, args.model, show)
    try:
        score = finish_batch(prepared, embeddings, normalize=not args.no_normalize)
    except NonFiniteRewardError as exc:
        print(f"sde2-reward score: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout if str(args.out) == "-" else args.out.open("w", encoding="utf-8")
    try:
        for record in output_records(score):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
