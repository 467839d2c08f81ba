"""``sde2-reward score``: score a JSONL file offline through the server's own code path.

Each input line is one SPEC §6 item (``completion``, ``answer``, optional ``prompt``, ``group``,
``num_tokens``). The whole file is one batch, so normalization and group advantages are those of
a single ``/v1/score`` request holding every line. Each output line holds the item's diagnostics
(SPEC §6 ``items[]``) plus its components, normalized components, reward and advantage.

Each line is parsed as the server parses a request (pydantic's strict JSON): what the server
refuses with a 422 — a lone surrogate such as ``"\\ud800"``, ``"3"`` for a number — is refused
here too, naming the file, the line and the field, and never reaches the tokenizer or the output.
The output is checked before any work and written atomically: a failed write leaves the previous
file as it was, never a shorter file that looks complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from reward_server.core import (
    ANSWER_TYPES,
    RECIPES,
    BatchScore,
    InvalidBatch,
    NonFiniteRewardError,
    PreparedBatch,
    RewardParams,
    ScoreItem,
    finish_batch,
    prepare_batch,
)
from reward_server.core.answers import MathJudge
from reward_server.encoders.base import EMBEDDING_DIM, Encoder
from reward_server.encoders.loading import BACKENDS, Backend, model_problem
from reward_server.encoders.model_store import (
    ModelExportError,
    ModelLoadError,
)
from reward_server.field_names import unknown_field_hint
from reward_server.jsonl_files import (
    InputError,
    OutputError,
    check_output,
    emit,
    json_error,
    json_type,
    jsonl_lines,
)
from reward_server.math_judge import IsolatedMathJudge
from reward_server.service.config import MAX_SECONDS
from reward_server.service.errors import wire_kind

#: Texts per encoder call: small enough for a live progress bar, large enough to batch well.
CHUNK = 256
_ITEM: TypeAdapter[ScoreItem] = TypeAdapter(ScoreItem)


def item_error(path: Path, number: int, text: str, exc: ValidationError) -> InputError:
    """The first issue of item line ``number`` (``text``: :func:`first_issue`), as the file's
    line and the field's name."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return json_error(path, number, str(first["msg"]).removeprefix("Invalid JSON: "), text)
    if not first["loc"]:
        got = json_type(first.get("input"))
        return InputError(f"{path}: line {number}: expected a JSON object, got {got}")
    return InputError(f"{path}: line {number}: {first_issue(exc, ScoreItem, '')}")


def first_issue(exc: ValidationError, model: type, whole: str) -> str:
    """``field: message`` of the issue of ``exc`` to read first, ``model``'s misspelt field
    named with its likely meaning, and how many more there are (``whole``: the field's name
    when the issue is about the value as a whole). A misspelt field comes before the field it
    left missing: ``answr`` is what to fix, not ``answer``.

    >>> try:
    ...     _ITEM.validate_json('{"completion": "x", "answr": "7"}')
    ... except ValidationError as exc:
    ...     first_issue(exc, ScoreItem, "")
    "answr: Extra inputs are not permitted (did you mean 'answer'?) (and 1 more)"
    """
    issues = exc.errors()
    first = next((e for e in issues if wire_kind(e["type"], "")[0] == "extra_forbidden"), None)
    if first is None or all(e["type"] != "missing" for e in issues):
        first = issues[0]
    where = ".".join(str(p) for p in first["loc"]) or whole
    kind, msg = wire_kind(first["type"], first["msg"])
    hint = unknown_field_hint(model, kind, first["loc"])
    more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
    return f"{where}: {msg}{hint}{more}"


def read_items(path: Path) -> Iterator[tuple[int, ScoreItem]]:
    """``(line number, item)`` of each item line of ``path``, parsed as the server parses a
    request: strict types (``"3"`` is no number), no unknown fields, no lone surrogates."""
    for number, text in jsonl_lines(path):
        try:
            yield number, _ITEM.validate_json(text)
        except ValidationError as exc:
            raise item_error(path, number, text, exc) from None


@dataclass(frozen=True)
class InputItems:
    """The items of an input file with the line each came from: a batch error names an item by
    its index (``items.3.group``), which the user finds by its line."""

    path: Path
    items: list[ScoreItem]
    lines: list[int]

    def batch_error(self, exc: InvalidBatch) -> InputError:
        """``exc`` with its item index turned into the file's line."""
        return InputError(self.where(exc.loc, exc.message))

    def where(self, loc: tuple[str | int, ...], message: str) -> str:
        """``message`` about the field at ``loc``, its item named by the file's line."""
        index = loc[1] if len(loc) >= 2 and loc[0] == "items" else None
        if isinstance(index, int) and 0 <= index < len(self.lines):
            field = ".".join(str(p) for p in loc[2:]) or "item"
            return f"{self.path}: line {self.lines[index]}: {field}: {message}"
        if loc == ("items",):
            return f"{self.path}: {message}"
        return f"{'.'.join(map(str, loc))}: {message}"


def load_items(path: Path) -> InputItems:
    """Every item of ``path`` with its line number (:func:`read_items`)."""
    pairs = list(read_items(path))
    return InputItems(path, [item for _, item in pairs], [number for number, _ in pairs])


def params_from_flag(text: str) -> RewardParams:
    """``--params`` validated, its first issue on one line naming the parameter."""
    try:
        return RewardParams.model_validate_json(text)
    except ValidationError as exc:
        raise InputError(f"--params: {first_issue(exc, RewardParams, 'params')}") from None


def math_timeout(text: str) -> float:
    """``--math-timeout``: seconds, a finite number > 0, at most a year (the server's rule,
    :data:`~reward_server.service.config.MAX_SECONDS`: beyond ~68 years the judge's ``select()``
    overflows, and ``inf`` would mean a check that never ends).

    ``0`` or ``-5`` would stop every check at once and ``inf`` or ``nan`` never (or crash the
    judge): either way a wrong verdict, never silently clamped.

    >>> math_timeout("2.5")
    2.5
    >>> math_timeout("inf")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number of seconds > 0 (at most 31536000), got 'inf'
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0 (at most {MAX_SECONDS}), got {text!r}"
        )
    return value


def check_input(path: Path, flag: str = "--in") -> None:
    """Refuse an input path (given as ``flag``) that is no readable file, naming the flag:
    it was the OS's ``[Errno 21] Is a directory: 'x'``.

    >>> check_input(Path("/"))
    Traceback (most recent call last):
    ...
    reward_server.jsonl_files.InputError: --in /: is a folder; name a JSONL file
    """
    if str(path) == "-":
        raise InputError(f"{flag} -: not read from stdin; name a JSONL file (or /dev/stdin)")
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; name a JSONL file")
    if not path.exists():
        raise InputError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{flag} {path}: not readable")


def check_model(backend: Backend, model: str | None) -> None:
    """Refuse a ``--model`` that names no usable folder before the parse (the encoder loads only
    after it, which may be minutes later): :func:`~reward_server.encoders.loading.model_problem`."""
    problem = model_problem(backend, model)
    if problem is not None:
        raise InputError(f"--model: {problem}")


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
    text needs it (loading costs seconds, and a batch may need no encoder at all). A model that
    cannot be loaded is an :class:`InputError` naming ``--model``."""
    if not texts:
        return np.zeros((0, EMBEDDING_DIM), np.float32)
    from reward_server.encoders.loading import load_encoder

    if not show and backend == "torch":  # --quiet: transformers' own bar while it loads too
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        encoder = load_encoder(backend, model)
    except (OSError, ModelExportError, ModelLoadError) as exc:
        raise InputError(f"--model {model or '(default)'}: cannot load the encoder: {exc}") from exc
    return encode_with_progress(encoder, texts, show)


def counted(judge: MathJudge, tick: Callable[[], object]) -> MathJudge:
    """``judge``, calling ``tick`` after each check (a progress bar's)."""

    def judged(prediction: str, gold: str) -> bool:
        verdict = judge(prediction, gold)
        tick()
        return verdict

    return judged


def prepare_input(
    args: argparse.Namespace, judge: IsolatedMathJudge, diagnostics: bool
) -> tuple[InputItems, PreparedBatch]:
    """Read ``--in`` and run the batch's phase 1; every error an :class:`InputError` naming the
    file and line (or the flag), every warning printed so named."""
    from tqdm import tqdm

    params = params_from_flag(args.params)
    inputs = load_items(args.input)
    show = args.answer_type == "math" and not args.quiet  # ~10 ms a check: minutes for a file
    with tqdm(unit="check", desc="math checks", disable=not show) as bar:
        try:
            prepared = prepare_batch(
                inputs.items,
                recipe=args.recipe,
                answer_type=args.answer_type,
                params=params,
                diagnostics=diagnostics,
                math_judge=counted(judge, bar.update),
            )
        except InvalidBatch as exc:
            raise inputs.batch_error(exc) from None
    for warning in prepared.warnings:  # scored, but the user should know (a wrong answer column)
        print(f"warning: {inputs.where(warning.loc, warning.message)}", file=sys.stderr)
    return inputs, prepared


def report_timeouts(judge: IsolatedMathJudge, limit: float) -> None:
    """Say how many math checks ran out of time: each counted as not equivalent."""
    if judge.timeouts:
        checks = "1 math check" if judge.timeouts == 1 else f"{judge.timeouts} math checks"
        print(
            f"{checks} ran past {limit} s, counted as not equivalent (each named above by its "
            "answer and gold)",
            file=sys.stderr,
        )


def output_records(score: BatchScore, lines: Sequence[int]) -> Iterator[dict[str, Any]]:
    """One JSON-able record per item: the input ``line`` it answers (blank lines are no items,
    so the k-th record need not be line k), diagnostics, components, normalized values, reward."""
    for i, item in enumerate(score.items):
        yield {
            "line": lines[i],
            **item._asdict(),
            "reward": score.rewards[i],
            "components": {k: v[i] for k, v in score.components.items()},
            "normalized": {k: v[i] for k, v in score.normalized.items()},
            "advantage": None if score.advantages is None else score.advantages[i],
        }


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """``--recipe`` and ``--answer-type``, their choices read from the core (the registered
    recipes when the parser is built, and :data:`ANSWER_TYPES`)."""
    parser.add_argument("--recipe", choices=list(RECIPES), default="sde2", help="default sde2")
    matcher = "the answer matcher (default numeric)"
    parser.add_argument("--answer-type", choices=ANSWER_TYPES, default="numeric", help=matcher)


def add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend`` (choices from :data:`BACKENDS`), ``--model`` and ``--quiet``: how the offline
    commands load the encoder and whether they show its progress."""
    parser.add_argument("--backend", choices=BACKENDS, default="onnx", help="default onnx")
    parser.add_argument(
        "--model", default=None, help="ONNX folder, HF folder or hub id (default: the embedded one)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_math_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """``--math-timeout`` (:func:`math_timeout`), the same rule for ``score`` and ``explain``."""
    parser.add_argument(
        "--math-timeout",
        type=math_timeout,
        default=2.0,
        help="seconds one answer-type=math check may run before it counts as not equivalent "
        "(default 2)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``sde2-reward score``."""
    parser.add_argument("--in", dest="input", type=Path, required=True, help="input JSONL")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL ('-' for stdout)")
    add_recipe_arguments(parser)
    parser.add_argument(
        "--params", default="{}", help="reward parameters as JSON, e.g. '{\"explore_cap\": 0.7}'"
    )
    add_math_timeout_argument(parser)
    parser.add_argument("--no-normalize", action="store_true", help="sum raw components")
    parser.add_argument("--diagnostics", action="store_true", help="Uniq/Div for every item")
    add_encoder_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Score ``--in`` into ``--out``; exit status 2 on bad input or arguments (an ``--out``
    that cannot be written is found before any work), 1 when writing the output fails."""
    command = "sde2-reward score"
    try:
        check_input(args.input)
        check_output(args.out, inputs=[("--in", args.input)])
        check_model(args.backend, args.model)
    except (OutputError, InputError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    judge = IsolatedMathJudge(time_limit=args.math_timeout)  # starts a process only if used
    try:
        inputs, prepared = prepare_input(args, judge, args.diagnostics)
    except (ValueError, OSError, RuntimeError) as exc:  # InputError is a ValueError
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    finally:
        judge.close()
    report_timeouts(judge, args.math_timeout)
    show = not args.quiet
    if show:
        print(f"{len(inputs.items)} items, {len(prepared.texts)} texts to embed", file=sys.stderr)
    try:
        embeddings = embed_with_progress(prepared.texts, args.backend, args.model, show)
        score = finish_batch(prepared, embeddings, normalize=not args.no_normalize)
    except (InputError, NonFiniteRewardError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    lines = (
        json.dumps(record, ensure_ascii=False) + "\n"
        for record in output_records(score, inputs.lines)
    )
    return emit(command, args.out, lines)
