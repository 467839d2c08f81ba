"""``sde2-eval``: the paper's Table 1 for one or several runs, scored through the reward server.

A run is either generated here (``--model``, on ``--dataset`` questions, with the
multi-strategy prompt, or ``--prompt single``'s single trace) or read from a JSONL of
completions (``--completions NAME=FILE``; each line has ``completion`` and ``answer``,
optionally ``answer_type`` (else ``--dataset``'s matcher:
numeric for gsm8k, the default, and aime, choice for medmcqa) and ``num_tokens`` — the latter on
every line or on none; a wrong type, or a field that is none of these nor ``sde2-reward
score``'s ``prompt`` and ``group``, is refused naming the file, line and field). Every
completion is scored by the server with ``diagnostics`` on — the same parser and matchers as the
training reward, so ACC here is the reward's own notion of correct — and summarized as ACC with
its 95% interval (normal, as the paper's tables; ``--ci wilson``), S-ACC, #STR, #TOK (the
tokens generated, as TRL counts them; a read run's ``num_tokens`` or its texts under a
tokenizer), Words and distinct strategies. The reward server is asked first, and a generated
run is written down before it is scored (``--save-completions``, else a temporary file named
when scoring fails): a generation is never lost to a typo or a server gone.
Output: a Markdown table on stdout, ``--json`` for machines, and with several runs ``--plot``
draws ACC against #TOK per method (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from reward_server.core import ANSWER_TYPES, RECIPES, RewardParams
from reward_server.core.answers import gold_text
from reward_server.jsonl_files import (
    InputError,
    OutputError,
    check_output,
    emit,
    json_type,
    jsonl_lines,
    parse_json_line,
    write_output,
)
from trainer_client.client import ItemError, RewardClient, probe_each
from trainer_client.datasets import ANSWER_TYPES as ANSWER_TYPES_OF
from trainer_client.datasets import (
    DATASETS,
    DEFAULT_SOURCES,
    EVAL_SPLITS,
    Example,
    load_examples,
)
from trainer_client.help_format import DefaultsShown
from trainer_client.metrics import INTERVALS, RunMetrics, markdown_table, summarize
from trainer_client.modeling import ModelRef, recorded_name
from trainer_client.prompts import add_prompt_flag, prompt_style
from trainer_client.responses import item_of_issue
from trainer_client.results import warned_item
from trainer_client.retry import (
    TRAINER_DEADLINE,
    RetryPolicy,
    RewardRequestError,
    RewardServiceError,
)
from trainer_client.sharding import check_weights
from trainer_client.train import (
    TRAINING_RECORD,
    FlagError,
    add_param_flag,
    check_sampling,
    checked_reward_params,
    read_training_record,
)

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
    #: The JSONL file the completions are in (read, or saved once generated), and the line of
    #: each: an error about one completion names them.
    source: Path | None = None
    lines: list[int] | None = None
    #: How a generated run was decoded (:func:`decoding_settings`), for the run's metadata.
    decoding: dict[str, Any] | None = None

    def span(self, first: int, count: int) -> str:
        """Completions ``first`` to ``first + count - 1``, for a message (a chunk scored)."""
        last = first + count - 1
        if self.source is not None and self.lines is not None:
            return f"{self.source}: lines {self.lines[first]}-{self.lines[last]}"
        return f"run {self.method}: completions {first + 1}-{last + 1}"

    def where(self, index: int) -> str:
        """Where completion ``index`` is, for a message: its file and line when known."""
        if self.source is not None and self.lines is not None:
            return f"{self.source}: line {self.lines[index]}"
        return f"run {self.method}: completion {index + 1}"


#: ``--base-quantization``'s choices; ``auto`` follows the adapter's training run.
BASE_QUANTIZATIONS = ("auto", "4bit", "none")


def training_record_of(adapter: str) -> tuple[Path, dict[str, Any]] | None:
    """The training run's record of ``adapter`` (``sde2-train``'s ``final/`` holds one; a
    ``checkpoint-N/`` folder's is in the folder above), or None; a record that cannot be read
    is a :class:`ValueError` naming it."""
    folder = Path(adapter)
    for path in (folder / TRAINING_RECORD, folder.parent / TRAINING_RECORD):
        if path.is_file():
            return path, read_training_record(path)
    return None


def check_adapter(adapter: str | None) -> None:
    """A :class:`ValueError` naming ``--adapter`` when it names a local path that does not
    exist, or a file: a typo was taken for a hub id, found only once the base model had loaded
    (minutes, then PEFT's traceback), and its training record was silently not read.

    >>> check_adapter("./no-such-adapter")
    Traceback (most recent call last):
    ...
    ValueError: --adapter: no such file or folder: ./no-such-adapter
    """
    if adapter is None:
        return
    if Path(adapter).is_file():
        raise ValueError(
            f"--adapter {adapter}: is a file; name the adapter's folder (e.g. sde2-train's "
            "output/final)"
        )
    ModelRef(adapter).check("--adapter")


def adapter_record(args: argparse.Namespace) -> tuple[Path, dict[str, Any]] | None:
    """``--adapter``'s training record (:func:`training_record_of`), or None without an adapter.

    :func:`check_arguments` reads it once and hands it to each decision it shapes (the scoring,
    the base quantization, the prompt warning): they all follow one reading of the file, not
    each its own.

    >>> adapter_record(argparse.Namespace(adapter=None)) is None
    True
    """
    return training_record_of(args.adapter) if args.adapter else None


def base_quantization(
    args: argparse.Namespace, found: tuple[Path, dict[str, Any]] | None
) -> tuple[bool, str]:
    """Whether the base model loads in 4-bit, and why (for the log and ``--json``); ``found``
    is :func:`adapter_record`'s.

    An adapter trained on a 4-bit base (the paper's QLoRA) is evaluated on the same 4-bit base
    unless ``--base-quantization`` says otherwise: a LoRA update learned against NF4 weights is
    not the same model on bf16 ones. 4-bit that cannot load (no CUDA, no bitsandbytes, GGUF
    weights) is a :class:`ValueError` naming the flag, never a silent full-precision run.
    """
    from trainer_client.modeling import can_load_4bit, qlora_install_hint

    choice = args.base_quantization
    if choice == "none":
        return False, "--base-quantization none"
    if choice == "4bit":
        why = "--base-quantization 4bit"
    else:
        if found is None or not found[1].get("load_in_4bit"):
            source = "no training record" if found is None else f"{found[0]}"
            return False, f"auto: full precision ({source})"
        why = f"auto: {found[0]} says the adapter was trained on a 4-bit base"
    if not can_load_4bit(ModelRef.parse(args.model, args.gguf_file)):
        raise ValueError(
            f"--base-quantization: {why}; 4-bit loading needs CUDA, bitsandbytes and non-GGUF "
            "weights; "
            + qlora_install_hint("--base-quantization none to evaluate on the full-precision base")
        )
    return True, why


def warn_training_mismatch(
    args: argparse.Namespace, found: tuple[Path, dict[str, Any]] | None
) -> None:
    """A warning when ``--adapter``'s training run (``found``, :func:`adapter_record`'s) used
    another ``--prompt`` or another base model than this one: the table would measure the
    adapter on a prompt or a base it was not trained on (allowed: a cross-prompt or cross-base
    evaluation is a legitimate question, but never an unnoticed one)."""
    trained = None if found is None else found[1].get("prompt")
    if trained is not None and trained != args.prompt:
        log.warning(
            "--prompt %s, but %s says the adapter was trained with --prompt %s",
            args.prompt,
            found[0] if found else "?",
            trained,
        )
    base = None if found is None else found[1].get("model")
    if isinstance(base, str):
        recorded = ModelRef.parse(base, found[1].get("gguf_file") if found else None)
        if _model_key(recorded) != _model_key(ModelRef.parse(args.model, args.gguf_file)):
            log.warning(
                "--model %s, but %s says the adapter was trained on %s: the table measures it "
                "on another base",
                args.model,
                found[0] if found else "?",
                base + (f" ({recorded.gguf_file})" if recorded.gguf_file else ""),
            )


def _model_key(ref: ModelRef) -> tuple[str, str | None]:
    """A model as compared across commands (:func:`recorded_name`: a training record holds a
    local path absolute)."""
    return recorded_name(ref.name_or_path), ref.gguf_file


def follow_training_record(
    args: argparse.Namespace, found: tuple[Path, dict[str, Any]] | None
) -> None:
    """``args.recipe`` and ``args.params`` (the checked ``--param``) as the scoring uses them:
    what the user gave, else what ``--adapter``'s training run (``found``,
    :func:`adapter_record`'s) used (an adapter trained at δ = 0.75 has its Uniq counted at
    0.75, not at the server's 0.80), else ``sde2`` and the server's defaults; said in the log,
    and where each came from in ``args.scoring_from`` (``--json``'s meta). A user's recipe or
    parameters other than the run's are a warning: a legitimate question, never an unnoticed
    one. A record whose parameters do not validate is a :class:`ValueError` naming it."""
    recipe_from = "--recipe" if args.recipe is not None else "default"
    params_from = "--param" if args.param else "default"
    record: dict[str, Any] = {} if found is None else found[1]
    trained_recipe, trained_params = record.get("recipe"), record.get("params")
    if found is not None and args.recipe is None and trained_recipe in RECIPES:
        args.recipe, recipe_from = trained_recipe, str(found[0])
        log.info("--recipe %s: as the adapter's training run (%s)", args.recipe, found[0])
    elif found is not None and trained_recipe is not None and args.recipe != trained_recipe:
        log.warning(
            "--recipe %s, but %s says the adapter was trained with --recipe %s",
            args.recipe or "sde2",
            found[0],
            trained_recipe,
        )
    if args.recipe is None:
        args.recipe = "sde2"
    args.params = checked_reward_params(args)  # --param's weights: of the recipe's components
    if found is not None:
        path = found[0]
        if not args.param and isinstance(trained_params, dict):
            args.params, params_from = dict(trained_params), str(path)
            log.info("reward parameters %s: as the adapter's training run (%s)", args.params, path)
        elif isinstance(trained_params, dict) and args.params != trained_params:
            log.warning(
                "--param %s, but %s says the adapter was trained with %s: the table's Uniq "
                "and the scoring use this command's",
                args.params,
                path,
                trained_params,
            )
    if params_from not in ("--param", "default"):  # the record's, checked as --param is
        try:
            RewardParams(**args.params)
            check_weights(args.recipe, args.params, "params.weights.{}")
        except ValueError as exc:  # pydantic's ValidationError included
            raise ValueError(
                f"{params_from}: its params cannot score with --recipe {args.recipe}: "
                f"{str(exc).splitlines()[0]}; give --param"
            ) from None
    args.scoring_from = {"recipe": recipe_from, "params": params_from}


def _splits_help() -> str:
    return ", ".join(f"{name} {split}" for name, split in EVAL_SPLITS.items())


def build_parser() -> argparse.ArgumentParser:
    """All flags of ``sde2-eval``."""
    p = argparse.ArgumentParser(
        prog="sde2-eval",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=DefaultsShown,
    )
    p.add_argument("--reward-url", action="append", required=True, help="reward server URL(s)")
    p.add_argument(
        "--reward-deadline",
        type=float,
        default=TRAINER_DEADLINE,
        help="seconds a scoring request keeps retrying a server that fails or is busy",
    )
    p.add_argument("--model", help="policy to generate with: hub id, folder, or .gguf file")
    p.add_argument("--gguf-file", help="GGUF file inside --model")
    p.add_argument(
        "--adapter",
        # "~" expanded as --model's is: the shell leaves it in --adapter=~/run/final, and the
        # folder was then refused as missing (PEFT and the record do not expand it either)
        type=os.path.expanduser,
        help="a LoRA adapter folder (e.g. sde2-train's output/final)",
    )
    p.add_argument(
        "--base-quantization",
        choices=BASE_QUANTIZATIONS,
        default="auto",
        help="the base model's weights under --adapter: auto = as its training run "
        f"({TRAINING_RECORD} beside the adapter or in the folder above; 4bit needs CUDA and "
        "bitsandbytes), else full precision",
    )
    p.add_argument(
        "--method",
        help="label of the generated run (default: the model's hub id or folder name, "
        "+ the adapter folder)",
    )
    p.add_argument(
        "--completions",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a run read from JSONL (completion, answer[, answer_type, num_tokens]); repeatable",
    )
    p.add_argument("--tokenizer", help="tokenizer for #TOK of read runs (default: --model)")
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="gsm8k",
        help="questions to generate on; for read runs, the matcher of lines without answer_type "
        "(gsm8k, aime: numeric; medmcqa: choice)",
    )
    p.add_argument("--data", help=f"file, folder or hub id (default {DEFAULT_SOURCES})")
    p.add_argument("--split", help=f"default: the paper's evaluation split ({_splits_help()})")
    p.add_argument("--limit", type=int, help="evaluate at most this many questions")
    p.add_argument("--cop-base", type=int, default=0, help="MedMCQA: index of option A in cop")
    add_prompt_flag(p)
    p.add_argument("--max-new-tokens", type=int, default=1024, help="completion tokens")
    p.add_argument("--temperature", type=float, default=0.2, help="paper: 0.1-0.3; 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling")
    p.add_argument("--batch-size", type=int, default=8, help="questions per generate call")
    p.add_argument("--seed", type=int, default=0, help="sampling")
    p.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default=None,
        help="recipe whose parameters score (default: the --adapter's training run's, as its "
        "--param; else sde2)",
    )
    add_param_flag(p)
    p.add_argument(
        "--ci",
        choices=list(INTERVALS),
        default="normal",
        help="ACC's 95%% interval: normal, as the paper's tables, or Wilson",
    )
    p.add_argument("--save-completions", type=Path, help="write the generated run as JSONL")
    p.add_argument(
        "--json",
        type=Path,
        help="write the metrics as JSON (-: to stdout, the table then to stderr)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        help="image of ACC vs #TOK per method, in its suffix's format (.png, .svg, .pdf...)",
    )
    return p


class RunFileError(ValueError):
    """A completions file that cannot be a run; the message names the file, the line and the
    field (a wrong value is refused, never coerced: ACC and #TOK are evaluation signal)."""


class RunRow(NamedTuple):
    """One line of a completions file, checked."""

    line: int
    completion: str
    answer: str
    answer_type: str
    num_tokens: int | None


#: The fields of a completions file's line; any other is refused (:func:`run_row`). ``prompt``
#: and ``group`` are ``sde2-reward score``'s item fields, read there and not here (a run is
#: scored without normalization, so no group matters): its input files are runs as they are.
RUN_FIELDS = ("completion", "answer", "answer_type", "num_tokens", "prompt", "group")


def run_row(path: Path, number: int, record: Any, answer_type: str = "numeric") -> RunRow:
    """The checked fields of line ``number``: a wrong type is a :class:`RunFileError` naming
    the file, the line and the field (``null`` is no completion, 9.9 no token count), and so is
    a field that is not one of :data:`RUN_FIELDS` — a misspelt ``answer_typo`` was ignored, the
    line scored with another matcher than meant, as ``sde2-reward score`` refuses it.
    ``answer_type`` is the matcher of a line that names none (``--dataset``'s)."""
    where = f"{path}: line {number}"
    if not isinstance(record, dict):
        raise RunFileError(f"{where}: expected a JSON object, got {json_type(record)}")
    unknown = next((key for key in record if key not in RUN_FIELDS), None)
    if unknown is not None:
        raise RunFileError(
            f"{where}: {unknown}: not a field of a run line (the fields: {', '.join(RUN_FIELDS)})"
        )
    completion = record.get("completion")
    if not isinstance(completion, str):
        got = "missing" if "completion" not in record else json_type(completion)
        raise RunFileError(f"{where}: completion: must be a string, got {got}")
    try:
        gold = gold_text(record.get("answer"))
    except ValueError as exc:
        raise RunFileError(f"{where}: answer: {exc}") from None
    answer_type = record.get("answer_type", answer_type)
    if answer_type not in ANSWER_TYPES:
        shown = json.dumps(answer_type)
        raise RunFileError(f"{where}: answer_type: one of {', '.join(ANSWER_TYPES)}, got {shown}")
    tokens = record.get("num_tokens")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS
    ):
        whole = isinstance(tokens, int) and not isinstance(tokens, bool)
        shown = _short(tokens) if whole else json.dumps(tokens)
        raise RunFileError(f"{where}: num_tokens: must be an integer from 0 to 2^63-1, got {shown}")
    return RunRow(number, completion, gold, answer_type, tokens)


#: The largest ``num_tokens`` read (what gRPC's int64 carries): #TOK is a mean of them, and a
#: count past a float's range ended the run with an OverflowError after scoring it all.
MAX_TOKENS = 2**63 - 1


def _short(number: int) -> str:
    """An integer for a message, its digits elided past 20.

    >>> _short(12), _short(10**40)
    ('12', '1000000000... (41 digits)')
    """
    digits = str(abs(number))
    sign = "-" if number < 0 else ""
    return sign + digits if len(digits) <= 20 else f"{sign}{digits[:10]}... ({len(digits)} digits)"


def _lines_list(numbers: Sequence[int], most: int = 10) -> str:
    """Line numbers for a message, the first ``most`` of them.

    >>> _lines_list([2, 3]), _lines_list(range(1, 15), 3)
    ('2, 3', '1, 2, 3 and 11 more')
    """
    shown = ", ".join(map(str, numbers[:most]))
    return shown if len(numbers) <= most else f"{shown} and {len(numbers) - most} more"


def split_run_spec(spec: str) -> tuple[str, str]:
    """``NAME=FILE`` as (name, file): at the first ``=`` after which a file exists (a name
    may hold ``=``, as ``lr=5e-6``), else the first; a spec without ``=`` is a file named by
    its stem.

    >>> split_run_spec("base=runs/a.jsonl"), split_run_spec("runs/b.jsonl")
    (('base', 'runs/a.jsonl'), ('b', 'runs/b.jsonl'))
    """
    cuts = [i for i, char in enumerate(spec) if char == "="]
    if not cuts:
        return Path(spec).stem, spec
    at = next((i for i in cuts if Path(spec[i + 1 :]).is_file()), cuts[0])
    return spec[:at], spec[at + 1 :]


#: A gold answer that is a multiple-choice option's letter (what MedMCQA's golds are).
_OPTION_LETTER = re.compile(r"\s*\(?[A-Ea-e]\)?\s*")


def read_run(spec: str, limit: int | None = None, answer_type: str = "numeric") -> Run:
    """``NAME=FILE`` to a run of at most ``limit`` completions (the first ones); a line without
    ``answer_type`` is scored with ``answer_type`` (the matcher of ``--dataset``: a MedMCQA
    file was scored with the numeric matcher whatever ``--dataset`` said).

    A run must use one answer type (one scoring request family), and give ``num_tokens`` on
    every line or on none: a mean over some lines would not be the run's #TOK.
    """
    name, where = split_run_spec(spec)
    path = Path(where)
    if path.is_dir():
        raise RunFileError(f"{path}: is a folder, not a JSONL file of completions")
    rows: list[RunRow] = []
    try:
        for number, text in jsonl_lines(path):
            if limit is not None and len(rows) >= limit:
                break
            record = parse_json_line(path, number, text)
            rows.append(run_row(path, number, record, answer_type))
    except InputError as exc:
        raise RunFileError(str(exc)) from None
    except OSError as exc:
        raise RunFileError(f"{path}: {exc.strerror or exc}") from None
    if not rows:
        raise RunFileError(f"{path}: no completions")
    types = {row.answer_type for row in rows}
    if len(types) > 1:
        raise RunFileError(f"{path}: mixed answer types {sorted(types)}; split the file")
    if types == {"numeric"} and all(_OPTION_LETTER.fullmatch(row.answer) for row in rows):
        log.warning(
            "%s: every gold answer is an option letter, read with the numeric matcher (which "
            "matches '(B) Paris' to no letter): pass --dataset medmcqa, or answer_type \"choice\" "
            "on each line",
            path,
        )
    lacking = [row.line for row in rows if row.num_tokens is None]
    if lacking and len(lacking) < len(rows):
        raise RunFileError(
            f"{path}: num_tokens is missing on line{'s' if len(lacking) > 1 else ''} "
            f"{_lines_list(lacking)}: give it on every line or on none (then --tokenizer counts "
            "them)"
        )
    return Run(
        method=name,
        completions=[row.completion for row in rows],
        answers=[row.answer for row in rows],
        answer_type=types.pop(),
        num_tokens=None
        if lacking
        else [row.num_tokens for row in rows if row.num_tokens is not None],
        source=path,
        lines=[row.line for row in rows],
    )


def generated_lengths(rows: Sequence[Sequence[int]], eos: int | Sequence[int] | None) -> list[int]:
    """#TOK of generated completions as TRL counts a completion's tokens: up to and with the
    first EOS (what follows is padding), else every token generated. The decoded text counted
    again by the tokenizer was another number (a text does not tokenize back to the ids that
    made it, and the EOS was skipped in decoding): past ``--max-new-tokens`` even.

    >>> generated_lengths([[5, 6, 2, 0, 0], [5, 6, 7, 8, 9]], [2])
    [3, 5]
    """
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    return [next((i + 1 for i, t in enumerate(row) if t in ends), len(row)) for row in rows]


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Completion lengths under the policy's tokenizer (no special tokens added)."""
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def eos_token_ids(tokenizer: Any, checkpoint_eos: int | list[int] | None) -> list[int]:
    """The tokens that end a completion, as TRL 1.16's ``GRPOTrainer`` gathers them: the
    tokenizer's EOS first, then the checkpoint generation config's own (Qwen2.5-Instruct
    ends turns with ``<|im_end|>`` and ``<|endoftext|>``).

    >>> class Tok: eos_token_id = 2
    >>> eos_token_ids(Tok(), [7, 2]), eos_token_ids(Tok(), None)
    ([7, 2], [2])
    """
    ids = (
        []
        if checkpoint_eos is None
        else [checkpoint_eos]
        if isinstance(checkpoint_eos, int)
        else list(checkpoint_eos)
    )
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def generation_config(args: argparse.Namespace, tokenizer: Any, checkpoint_eos: Any) -> Any:
    """The complete decoding of ``sde2-eval``: the paper's temperature and top-p held fixed
    (Sec. 4, "decoding uses temperature T∈[0.1,0.3] and top-p 0.90–0.95"), as ``sde2-train``
    samples through TRL (``top_k=0``, ``min_p=None``, ``repetition_penalty=1.0``), greedy at
    ``--temperature 0``.

    Every setting is given, not left to the checkpoint: ``generate`` fills what a config leaves
    unset from the model's own ``generation_config.json``, and Qwen2.5-3B-Instruct's carries
    ``repetition_penalty=1.05`` and ``top_k=20`` — evaluation then decoded otherwise than
    training sampled (the penalty applied even greedily). Only the end and pad tokens are kept
    from the checkpoint (:func:`eos_token_ids`)."""
    from transformers import GenerationConfig

    sampled = args.temperature > 0
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=sampled,
        temperature=args.temperature if sampled else 1.0,  # 1.0, 0 and 1.0: no processor
        top_p=args.top_p if sampled else 1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids(tokenizer, checkpoint_eos),
    )


#: The decoding settings a run's metadata records (:func:`decoding_settings`).
DECODING_FIELDS = (
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "eos_token_id",
    "pad_token_id",
)


def decoding_settings(config: Any) -> dict[str, Any]:
    """Every setting of :func:`generation_config` that shapes a completion, for ``--json``."""
    return {name: getattr(config, name) for name in DECODING_FIELDS}


def generate_run(args: argparse.Namespace, examples: list[Example]) -> tuple[Run, Any]:
    """Generate one completion per question with the ``--prompt`` system prompt, decoded by
    :func:`generation_config` alone (the checkpoint's own sampling settings never apply)."""
    import torch
    from tqdm.auto import tqdm

    from trainer_client.modeling import has_chat_template, load_model, load_tokenizer

    assert args.model is not None
    ref = ModelRef.parse(args.model, args.gguf_file)
    tokenizer = load_tokenizer(ref)
    quantize, why = args.base_4bit  # base_quantization's, decided by check_arguments
    log.info("base model in %s (%s)", "4-bit NF4" if quantize else "full precision", why)
    model = load_model(ref, quantize_4bit=quantize, for_training=False)
    decoding = generation_config(args, tokenizer, model.generation_config.eos_token_id)
    # generate() fills a passed config's unset fields from the model's own: it is replaced
    # too (on the base model, whose generate a PEFT model calls), so nothing of it remains.
    model.generation_config = decoding
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    torch.manual_seed(args.seed)
    chat = has_chat_template(tokenizer)
    style = prompt_style(args)
    completions: list[str] = []
    lengths: list[int] = []
    for start in tqdm(range(0, len(examples), args.batch_size), desc="generating", unit="batch"):
        batch = examples[start : start + args.batch_size]
        if chat:
            texts = [
                tokenizer.apply_chat_template(
                    ex.record(True, style)["prompt"], add_generation_prompt=True, tokenize=False
                )
                for ex in batch
            ]
        else:
            texts = [ex.record(False, style)["prompt"] for ex in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        enc = {k: v.to(model.device) for k, v in enc.items()}
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=decoding)
        new = out[:, enc["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
        lengths.extend(generated_lengths(new.tolist(), decoding.eos_token_id))
    run = Run(
        args.method or generated_label(args),
        completions,
        [ex.answer for ex in examples],
        examples[0].answer_type,
        lengths,
        decoding=decoding_settings(decoding),
    )
    return run, tokenizer


def generated_label(args: argparse.Namespace) -> str:
    """The default name of the generated run: the model (:meth:`ModelRef.label`), and the
    adapter's folder as given after a ``+`` (its name alone is ``final`` for every run of
    ``sde2-train``), so that a base model and its trained adapters differ."""
    label = ModelRef.parse(args.model, args.gguf_file).label()
    return f"{label}+{args.adapter.rstrip('/')}" if args.adapter else label


def score_run(
    client: RewardClient,
    run: Run,
    recipe: str,
    interval: str = "normal",
    params: dict[str, Any] | None = None,
) -> ScoredRun:
    """Score every completion (raw, with diagnostics, in chunks of :data:`SCORE_CHUNK`) under
    the SPEC §4 ``params`` (``--param``: Uniq is counted at their ``similarity_threshold``) and
    summarize. A completion that cannot be sent (:class:`RunFileError`) or that the server
    refused (:class:`RewardRequestError`) is named by its file and line, not by its index in
    the chunk sent. The parameters the completions took (the server's defaults filled in:
    Uniq depends on δ, ACC on ``max_strategies``) and the encoder come back with the row, as
    the server answered the first chunk."""
    items_out = []
    scored_with: dict[str, Any] = {}
    for start in range(0, len(run.completions), SCORE_CHUNK):
        stop = start + SCORE_CHUNK
        items = [
            {"completion": c, "answer": a}
            for c, a in zip(run.completions[start:stop], run.answers[start:stop], strict=True)
        ]
        try:
            result = client.score(
                items,
                recipe=recipe,
                answer_type=run.answer_type,
                params=params or None,
                normalize=False,
                diagnostics=True,
            )
        except ItemError as exc:
            raise RunFileError(
                f"{run.where(start + exc.item)}: {exc.field}: {exc.reason}"
            ) from None
        except RewardRequestError as exc:
            raise located(exc, run, start) from None
        except RewardServiceError as exc:  # which run, which lines: the chunk's
            exc.args = (f"{run.span(start, len(items))}: {exc}",)
            raise
        scored_with = scored_with or {"params": result.params, "encoder": result.encoder}
        for warning in result.warnings:
            if warned_item(warning) is None:  # about every chunk (mixed encoders): once
                client.log_warnings([warning])
            else:  # a gold no answer matches ("####"): its file line
                log.warning("%s: %s", run.method, located_warning(warning, run, start))
        items_out.extend(result.items)
    metrics = summarize(run.method, items_out, run.completions, run.num_tokens, interval)
    return ScoredRun(metrics, scored_with)


class ScoredRun(NamedTuple):
    """What :func:`score_run` gives: the run's row, and what its completions were scored with
    (``params`` and ``encoder``, for ``--json``'s ``meta.scored_with``; empty for no
    completions)."""

    metrics: RunMetrics
    scored_with: dict[str, Any]


def located_warning(warning: str, run: Run, start: int) -> str:
    """A scoring answer's ``warning`` about completion ``start + N`` of ``run`` (``items.N.…``)
    named by its file and line, as :func:`located` names refusals."""
    named = warned_item(warning)
    return warning if named is None else f"{run.where(start + named[0])}: {named[1]}"


def located(exc: RewardRequestError, run: Run, start: int) -> RewardRequestError:
    """``exc`` (the server refused a chunk of ``run`` beginning at completion ``start``) with
    each refused completion named by its file and line, and the field and the reason."""
    issues = exc.attempts[-1].issues if exc.attempts else ()
    named = []
    for issue in issues:
        item = item_of_issue(issue.get("loc"))
        if item is not None:
            field = ".".join(map(str, issue["loc"][2:])) or "item"
            named.append(f"{run.where(start + item)}: {field}: {issue.get('msg', '')}")
    if not named:
        return exc
    return RewardRequestError(f"the reward service refused {'; '.join(named)}", exc.attempts)


def plot_formats() -> dict[str, str] | None:
    """The image formats matplotlib writes (suffix: description); None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return None
    return dict(FigureCanvasAgg.get_supported_filetypes())


def plot_format(path: Path) -> str:
    """The image format ``path`` names: its suffix, lower case, without the dot.

    >>> plot_format(Path("runs/ACC.SVG")), plot_format(Path("plot"))
    ('svg', '')
    """
    return path.suffix.lower().removeprefix(".")


def plot_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot take the plot (checked before the runs are scored), or None.
    matplotlib picks the format from the suffix, and wrote ``NAME.png`` for a name without
    one (``/dev/full``, ``-``) while the log said it wrote ``NAME``."""
    if str(path) == "-":
        return "a plot is an image file, not stdout: name one (e.g. acc_vs_tokens.png)"
    formats = plot_formats()
    if formats is not None and plot_format(path) not in formats:
        known = ", ".join(f".{s}" for s in sorted(formats))
        return f"name the image with one of the suffixes {known}"
    return None


def plot_runs(rows: Sequence[RunMetrics], path: Path) -> bool:
    """ACC (with its CI) against #TOK per method, written to ``path`` in its suffix's format;
    False when matplotlib is missing. ``OSError`` when the file cannot be written."""
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
    try:
        fig.savefig(path, dpi=120, format=plot_format(path))
    finally:
        plt.close(fig)
    return True


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse arguments that cannot work (``parser.error``: usage, exit status 2) before
    anything is read, generated or scored. What ``--adapter``'s training record decides is
    kept in ``args`` for the run: the scoring (:func:`follow_training_record`) and, with
    ``--model``, ``args.base_4bit`` (:func:`base_quantization`), so the record is read once."""
    if not args.model and not args.completions:
        parser.error("give --model to generate, or --completions NAME=FILE to read runs")
    try:  # a --param typo fails now, not after generation
        check_adapter(args.adapter)
        found = adapter_record(args)
        follow_training_record(args, found)
    except ValueError as exc:  # FlagError included
        parser.error(str(exc))
    if not (math.isfinite(args.reward_deadline) and args.reward_deadline > 0):
        parser.error(
            f"--reward-deadline must be a number of seconds > 0, got {args.reward_deadline}"
        )
    for flag, value in (
        ("--limit", args.limit),
        ("--batch-size", args.batch_size),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    try:
        check_sampling(args.temperature, args.top_p, greedy_allowed=True)
    except FlagError as exc:
        parser.error(str(exc))
    try:
        RewardClient(args.reward_url).close()  # checks the URLs' form; connects to nothing
    except ValueError as exc:
        parser.error(f"--reward-url: {exc}")
    try:
        if args.model:
            ModelRef.parse(args.model, args.gguf_file).check()
        if args.tokenizer:
            ModelRef.parse(args.tokenizer).check("--tokenizer")
        if args.model:
            # a 4-bit base that cannot load stops here, not after
            args.base_4bit = base_quantization(args, found)
            warn_training_mismatch(args, found)
    except ValueError as exc:
        parser.error(str(exc))
    names = [split_run_spec(spec)[0] for spec in args.completions]
    if args.model:
        names.insert(0, args.method or generated_label(args))
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        parser.error(
            f"two runs named {', '.join(map(repr, twice))}: their rows and points could not be "
            "told apart (name each --completions NAME=FILE, or the generated run --method)"
        )
    outputs = {
        "--json": args.json,
        "--plot": args.plot,
        "--save-completions": args.save_completions,
    }
    runs = [("--completions", Path(split_run_spec(spec)[1])) for spec in args.completions]
    named: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None or str(path) == "-":
            continue
        if (first := named.setdefault(path.resolve(), flag)) != flag:
            parser.error(f"{flag} {path}: is also {first}'s file: name another file")
        try:
            check_output(path, flag, inputs=runs)  # not a file the runs are read from
        except OutputError as exc:
            parser.error(str(exc))
    if args.plot is not None and (problem := plot_path_problem(args.plot)):
        parser.error(f"--plot {args.plot}: {problem}")


def unscored_path(run: Run) -> Path:
    """Where a generated run waits to be scored when ``--save-completions`` names no file: in
    the temporary folder, kept if scoring fails (hours of generation are never lost to a
    server that went away), removed once scored."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run.method)
    return Path(tempfile.gettempdir()) / f"sde2-eval-{safe}-{os.getpid()}.jsonl"


def run_meta(
    args: argparse.Namespace, split: str, decoding: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the table was measured on, for ``--json``: the model and adapter, the data, the
    decoding (``decoding``: every setting the generated run used, :func:`decoding_settings`)
    and the scoring (a row's label alone does not say it)."""
    meta: dict[str, Any] = {
        "recipe": args.recipe,
        "params": getattr(args, "params", None) or {},
        # where the recipe and the params came from: the flag, the adapter's training record,
        # or the defaults (sde2, the server's)
        "scoring_from": getattr(args, "scoring_from", None),
        "ci": args.ci,
        "reward_url": args.reward_url,
        "completions": args.completions,
    }
    if args.model:
        meta.update(
            model=args.model,
            gguf_file=args.gguf_file,
            adapter=args.adapter,
            base_quantization=dict(zip(("4bit", "why"), args.base_4bit, strict=True)),
            dataset=args.dataset,
            data=args.data or DEFAULT_SOURCES[args.dataset],
            split=split,
            limit=args.limit,
            prompt=args.prompt,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            decoding=decoding,
        )
    return meta


def keep_run(run: Run, asked: Path | None) -> Path | None:
    """Write the generated run to ``asked`` (``--save-completions``), else to
    :func:`unscored_path`, until scored; where it went. A file that cannot be written (a disk
    filled, a folder removed during hours of generation) is said and the temporary folder tried
    next: the run ended with a traceback, its completions lost. ``None``: nowhere (the run is
    scored from memory)."""
    for path in ([asked] if asked is not None else []) + [unscored_path(run)]:
        try:
            save_run(run, path)
            return path
        except OSError as exc:
            log.error("cannot write the generated completions to %s: %s", path, exc.strerror or exc)
    return None


def say_kept(path: Path, method: str, args: argparse.Namespace) -> None:
    """Where the generated run ``method`` is kept, unscored or with an output lost, and how to
    score it again (:func:`rescore_flags`)."""
    print(
        f"sde2-eval: the generated completions are in {path}: score them again with "
        + rescore_flags(method, path, args),
        file=sys.stderr,
    )


def rescore_flags(method: str, path: Path, args: argparse.Namespace) -> str:
    """The flags that score a saved run again as this command scored it: its recipe and
    parameters too (they may have come from the adapter's training record, which a command
    given the file alone would not read: its Uniq was counted at the server's δ).

    >>> ns = argparse.Namespace(recipe="cfl", params={"length_target": 64})
    >>> rescore_flags("base", Path("/tmp/r.jsonl"), ns)
    '--completions base=/tmp/r.jsonl --recipe cfl --param=length_target=64'
    """
    flags = ["--completions", f"{method}={path}"]
    if args.recipe is not None:
        flags += ["--recipe", args.recipe]
    flags += [f"--param={k}={json.dumps(v)}" for k, v in (args.params or {}).items()]
    return shlex.join(flags)


def save_run(run: Run, path: Path) -> None:
    """The generated run as JSONL (``--completions`` reads it back)."""
    lines = (
        json.dumps({"completion": c, "answer": a, "answer_type": run.answer_type, "num_tokens": t})
        + "\n"
        for c, a, t in zip(run.completions, run.answers, run.num_tokens or [], strict=True)
    )
    write_output(path, lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sde2-eval``; exit status 2 on a bad argument, file or request, 1 when
    an output cannot be written."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    try:  # read first: a bad file stops the command before minutes of generation
        default_type = ANSWER_TYPES_OF[args.dataset]
        read = [read_run(spec, args.limit, default_type) for spec in args.completions]
    except RunFileError as exc:
        print(f"sde2-eval: {exc}", file=sys.stderr)
        return 2
    retry = RetryPolicy(max_attempts=None, deadline=args.reward_deadline)  # the deadline rules
    split = args.split or EVAL_SPLITS[args.dataset]
    try:
        probe_each(args.reward_url)  # before minutes of generation
    except RewardServiceError as exc:
        print(f"sde2-eval: {exc}", file=sys.stderr)
        return 2
    runs: list[Run] = []
    tokenizer: Any = None
    saved: Path | None = None  # where the generated run is kept
    if args.model:
        try:
            examples = load_examples(args.dataset, args.data, split, args.limit, args.cop_base)
        except (ValueError, OSError) as exc:
            print(f"sde2-eval: --data: {exc}", file=sys.stderr)
            return 2
        run, tokenizer = generate_run(args, examples)
        runs.append(run)
        saved = keep_run(run, args.save_completions)
        if saved is not None:
            run.source, run.lines = saved, list(range(1, len(run.completions) + 1))
            log.info("generated completions saved to %s", saved)
    if any(r.num_tokens is None for r in read) and (args.tokenizer or args.model):
        if args.tokenizer or tokenizer is None:  # --tokenizer wins over the policy's
            from trainer_client.modeling import load_tokenizer

            named = ModelRef.parse(args.tokenizer) if args.tokenizer else None
            tokenizer = load_tokenizer(named or ModelRef.parse(args.model, args.gguf_file))
        for r in read:
            if r.num_tokens is None:
                r.num_tokens = count_tokens(tokenizer, r.completions)
    runs.extend(read)

    try:
        with RewardClient(args.reward_url, retry=retry) as client:
            client.logs_warnings = False  # score_run names each one's file and line
            scored = [score_run(client, r, args.recipe, args.ci, args.params) for r in runs]
    except (RewardServiceError, RunFileError, KeyboardInterrupt) as exc:  # with the reason
        stopped = isinstance(exc, KeyboardInterrupt)  # Ctrl-C while the retries wait
        print(f"sde2-eval: {'stopped while scoring' if stopped else exc}", file=sys.stderr)
        if saved is not None:
            say_kept(saved, runs[0].method, args)
        return 130 if stopped else 2
    rows = [s.metrics for s in scored]
    table = markdown_table(rows) + "\n"
    if args.json is not None and str(args.json) == "-":  # stdout is the JSON's alone
        sys.stderr.write(table)
        status = 0
    else:
        status = emit("sde2-eval", Path("-"), [table])  # quiet on `| head`
    meta = {**run_meta(args, split, runs[0].decoding), "scored_with": scored[0].scored_with}
    payload = {"runs": [r.as_dict() for r in rows], "meta": meta}
    if args.json:
        written = emit("sde2-eval", args.json, [json.dumps(payload, indent=1) + "\n"])
        status = status or written
    if args.plot:
        placed = [r.method for r in rows if r.tokens is not None]
        if len(rows) < 2:
            log.warning("--plot compares methods: give at least two runs")
        elif len(placed) < 2:  # an empty chart was written and reported
            log.warning(
                "--plot places runs by #TOK: %s of the runs have token counts (give "
                "num_tokens on each line, or --tokenizer): no plot",
                len(placed) or "none",
            )
        else:
            try:
                if plot_runs(rows, args.plot):
                    log.info("plot written to %s", args.plot)
            except OSError as exc:
                print(
                    f"sde2-eval: cannot write {args.plot}: {exc.strerror or exc}", file=sys.stderr
                )
                status = status or 1
    if saved is not None and args.save_completions is None:
        if status == 0:  # scored, and every output written: no longer needed
            saved.unlink(missing_ok=True)
        else:  # an output lost (a full disk): the generation is kept for another try
            say_kept(saved, runs[0].method, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
