"""``sde2-train``: GRPO with LoRA through TRL, rewarded by the SD-E² reward server.

Defaults are the paper's (Sec. 4.2 and App. F): lr 5e-6 with cosine decay, warmup ratio 0.1,
gradient clipping 0.1, G = 6 completions per prompt, LoRA r = 64, α = 32, dropout 0, sequences of
at most 2048 tokens, sampling at temperature 0.2 and top-p 0.95 (the paper's decoding: T in
0.1-0.3, top-p 0.90-0.95), 4-bit weights and 8-bit AdamW on CUDA (bitsandbytes, the ``qlora``
extra: without it the command refuses to start, ``--no-4bit`` opts out), and the multi-strategy
prompt (``--prompt single``: the paper's single-trace baseline). What the run used (quantized or
not, optimizer, precision, reward, decoding, prompt) is written to ``sde2_training.json`` in
``--output-dir`` and beside the final adapter, where ``sde2-eval`` reads it. The GRPO advantages
are the paper's (App. A.2: the group's population std): the reward returns the server's group
advantages and TRL, with ``scale_rewards="none"``, keeps them (returning ``R_final``, TRL's sample
std made them √((G−1)/G) of the paper's); ``sde2/raw_reward`` logs the step's un-normalized
reward ``Σ_k w_k · mean(R_k)`` (``R_final``'s mean is 0 by construction). The recipe
(``--recipe``, any registered one) and ablations (``--weight sd=0``, a component of the recipe)
only change the reward request. Everything can be shrunk for a CPU smoke run (``--max-steps 2
--num-generations 2 --max-new-tokens 16 --batch-size 2``).

Checkpoints go to ``--output-dir`` every ``--save-steps``, each with the run's
``sde2_training.json``; ``--resume`` continues from the latest one (or from the given checkpoint
folder) with optimizer, scheduler and RNG state, and with the run's settings: a resume command
whose prompt, reward, data, model, quantization, LoRA, decoding or GRPO settings differ from the
run's record is refused (exit status 2, each differing flag named with its recorded value), and
the record is never rewritten with other values. A run stopped by the reward service (out for
longer than ``--reward-deadline``) or by a signal saves a checkpoint of the steps it finished first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from reward_server.core import RECIPES, RewardParams
from reward_server.jsonl_files import json_type
from reward_server.signal_handlers import exit_with_status, handling
from trainer_client.datasets import (
    DATASETS,
    DEFAULT_SOURCES,
    Example,
    load_examples,
    looks_like_path,
)
from trainer_client.help_format import DefaultsShown
from trainer_client.modeling import ModelRef, recorded_name
from trainer_client.prompts import add_prompt_flag, prompt_style
from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy, RewardServiceError
from trainer_client.sharding import check_weights, params_issues

log = logging.getLogger("sde2.train")


def parse_assignments(pairs: Sequence[str], what: str) -> dict[str, Any]:
    """``["k=v", ...]`` to a dict; values parsed as JSON when they are JSON (numbers), else str."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{what} must look like key=value, got {pair!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


class FlagError(ValueError):
    """An argument or input that cannot work, found before the model loads; ``main`` reports
    it as argparse does (usage, the message, exit status 2)."""


def add_param_flag(group: Any) -> None:
    """``--param key=value``, SPEC §4 reward parameters, on a parser or an argument group: one
    definition for ``sde2-train`` and ``sde2-eval`` (a model trained at δ = 0.75 is evaluated at
    δ = 0.75: the eval table's Uniq is counted at the server's similarity threshold). Read with
    :func:`checked_reward_params`."""
    group.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="reward parameter (SPEC §4), e.g. similarity_threshold=0.75; repeatable",
    )


def reward_params(args: argparse.Namespace) -> dict[str, Any]:
    """SPEC §4 parameters from ``--param`` and ``--weight`` (a command without ``--weight``:
    none), validated (a typo fails now)."""
    params = parse_assignments(args.param, "--param")
    weights = parse_assignments(getattr(args, "weight", []), "--weight")
    if weights:
        given = params.get("weights", {})
        if not isinstance(given, dict):
            raise FlagError(f"--param weights must be a JSON object, got {given!r}")
        params["weights"] = {**given, **weights}
    RewardParams(**params)
    try:
        check_weights(args.recipe, params, "--weight {}")
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    return params


def checked_reward_params(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`reward_params`, each problem a one-line :class:`FlagError` naming the flag."""
    try:
        return reward_params(args)
    except argparse.ArgumentTypeError as exc:
        raise FlagError(str(exc)) from None
    except ValidationError as exc:
        flags = "--param/--weight" if hasattr(args, "weight") else "--param"
        raise FlagError(f"{flags}: {params_issues(exc, prefix='')}") from None


def check_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The reward parameters, once every flag that needs no file or network is known to work:
    a run must not load a model (minutes) to fail on a typo."""
    from trainer_client.client import RewardClient

    try:
        RewardClient(args.reward_url).close()  # checks the URLs' form; connects to nothing
    except ValueError as exc:
        raise FlagError(f"--reward-url: {exc}") from None
    if args.max_length <= args.max_new_tokens:
        raise FlagError(
            f"--max-length ({args.max_length}) must exceed --max-new-tokens "
            f"({args.max_new_tokens}): the prompt needs room"
        )
    counts = (
        ("--limit", args.limit),
        ("--sample", args.sample),
        ("--grad-accum", args.grad_accum),  # 0 passed TRL's config, then failed after loading
        ("--lora-r", args.lora_r),  # PEFT accepts 0 and fails once the model is loaded
        ("--lora-alpha", args.lora_alpha),  # 0 scales the adapter to nothing: nothing learns
        ("--max-new-tokens", args.max_new_tokens),  # TRL refuses 0 once the model is loaded
        ("--batch-size", args.batch_size),  # 0 was read as one group; -2 failed once loaded
    )
    for flag, value in counts:
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be >= 1, got {value}")
    if args.max_steps == 0 or args.max_steps < -1:  # 0 trained one step, -7 none (exit 0)
        raise FlagError(f"--max-steps must be >= 1, or -1 to run --epochs, got {args.max_steps}")
    if args.max_steps == -1 and not (math.isfinite(args.epochs) and args.epochs > 0):
        raise FlagError(
            f"--epochs must be a finite number > 0 (with --max-steps -1), got {args.epochs}"
        )
    check_reward_flags(args)
    if args.limit is not None and args.sample is not None:
        raise FlagError("--limit and --sample: give one (the first N questions, or N at random)")
    try:
        ModelRef.parse(args.model, args.gguf_file).check()
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    if args.resume and args.resume != "latest":
        check_checkpoint(Path(args.resume))
    if not 0 <= args.warmup_ratio < 1:  # TRL reads a warmup of 1 or more as a step count
        raise FlagError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if not 0 <= args.lora_dropout < 1:  # PEFT accepts it; torch's Dropout fails once loaded
        raise FlagError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    check_sampling(args.temperature, args.top_p, greedy_allowed=False)
    # TRL takes each of these as given: a negative --lr trained away from the reward, and a
    # nan --max-grad-norm turned the clipping off (nan > 0 is false), both without a word.
    for flag, value, zero_allowed in (
        ("--lr", args.lr, False),
        ("--beta", args.beta, True),
        ("--max-grad-norm", args.max_grad_norm, True),
    ):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
            low = ">= 0" if zero_allowed else "> 0"
            raise FlagError(f"{flag} must be a finite number {low}, got {value}")
    out = Path(args.output_dir)
    check_creatable(out, "--output-dir")
    earlier = sorted(p.name for p in out.glob("checkpoint-*")) if out.is_dir() else []
    if earlier and not args.resume:  # a later --resume would take the newest, maybe not ours
        raise FlagError(
            f"--output-dir {out} holds checkpoints of an earlier run ({', '.join(earlier[:3])}"
            f"{', ...' if len(earlier) > 3 else ''}): continue it with --resume, or give "
            "another --output-dir"
        )
    if (out / "final").exists() and not args.resume:  # its adapter and record were replaced
        raise FlagError(
            f"--output-dir {out} holds an earlier run (final): continue it with --resume, or "
            "give another --output-dir"
        )
    return checked_reward_params(args)


#: What a checkpoint folder holds once the trainer has saved it whole (it writes the state last).
TRAINER_STATE = "trainer_state.json"


def check_checkpoint(folder: Path) -> None:
    """Refuse (``FlagError``) a ``--resume`` folder that is no whole checkpoint: a run's
    output folder (its ``checkpoint-N`` are named), or a save cut short. Both failed only
    once the model was loaded."""
    if not folder.is_dir():
        raise FlagError(f"--resume: no checkpoint folder {folder}")
    if not (folder / TRAINER_STATE).is_file():
        inside = sorted(p.name for p in folder.glob("checkpoint-*"))
        hint = f"; its checkpoints: {', '.join(inside)}" if inside else ""
        raise FlagError(f"--resume {folder}: not a whole checkpoint (no {TRAINER_STATE}){hint}")


def checkpoint_step(folder: Path) -> int:
    """The step a whole checkpoint was saved at (its ``trainer_state.json``); ``FlagError``
    naming the file when it cannot be read."""
    path = folder / TRAINER_STATE
    try:
        step = json.loads(path.read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlagError(f"--resume: {path} cannot be read ({type(exc).__name__}: {exc})") from None
    if isinstance(step, bool) or not isinstance(step, int):
        raise FlagError(f"--resume: {path}: global_step is not a step number: {step!r}")
    return step


def latest_checkpoint(out: Path) -> Path | None:
    """The newest whole checkpoint in ``out`` (``--resume``), a save cut short (no
    ``trainer_state.json``: a kill while saving) passed over with a warning; transformers'
    own pick takes the highest number whatever it holds."""
    numbered = []
    for folder in out.glob("checkpoint-*") if out.is_dir() else []:
        suffix = folder.name.removeprefix("checkpoint-")
        if suffix.isdigit() and folder.is_dir():
            numbered.append((int(suffix), folder))
    for _, folder in sorted(numbered, reverse=True):
        if (folder / TRAINER_STATE).is_file():
            return folder
        log.warning("--resume: %s was not saved whole (no %s); passed over", folder, TRAINER_STATE)
    return None


def check_sampling(temperature: float, top_p: float, *, greedy_allowed: bool) -> None:
    """A :class:`FlagError` for a ``--temperature`` that is not a finite number > 0 (>= 0
    where 0 means greedy decoding) or a ``--top-p`` outside (0, 1]: ``sde2-eval`` decoded a
    negative or nan temperature greedily, without a word, and a top-p of 2 failed only once
    the model had loaded.

    >>> check_sampling(0.2, 0.95, greedy_allowed=False)
    >>> check_sampling(float("nan"), 0.95, greedy_allowed=True)
    Traceback (most recent call last):
    ...
    trainer_client.train.FlagError: --temperature must be a finite number >= 0 (0: greedy), got nan
    """
    low = ">= 0 (0: greedy)" if greedy_allowed else "> 0"
    if (
        not math.isfinite(temperature)
        or temperature < 0
        or (temperature == 0 and not greedy_allowed)
    ):
        raise FlagError(f"--temperature must be a finite number {low}, got {temperature}")
    if not 0 < top_p <= 1:  # nan fails too
        raise FlagError(f"--top-p must be in (0, 1], got {top_p}")


def check_creatable(folder: Path, flag: str) -> None:
    """A :class:`FlagError` naming ``flag`` when ``folder`` cannot be made or written: a file
    there or on its path, or a nearest existing folder without write permission. The run wrote there
    first once the model had loaded (minutes), and failed in a traceback."""
    if folder.exists() and not folder.is_dir():
        raise FlagError(f"{flag} {folder}: is a file, not a folder")
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise FlagError(f"{flag} {folder}: not writable")
        return
    existing = next((p for p in folder.absolute().parents if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise FlagError(f"{flag} {folder}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FlagError(f"{flag} {folder}: cannot be made: {existing} is not writable")


def check_reward_flags(args: argparse.Namespace) -> None:
    """The reward client's flags: a timeout of 0 failed every request against a healthy server
    (after the model loaded, blaming the server), and the retry policy's own refusals were
    tracebacks that named no flag."""
    from trainer_client.client import check_timeout

    try:
        check_timeout(args.reward_timeout, "--reward-timeout")
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    try:
        RetryPolicy(max_attempts=args.reward_retries, deadline=args.reward_deadline)
    except ValueError as exc:
        flag = "--reward-retries" if "max_attempts" in str(exc) else "--reward-deadline"
        raise FlagError(f"{flag}: {exc}") from None


def check_enough_prompts(args: argparse.Namespace, prompts: int) -> None:
    """Refuse data that cannot fill one step (``FlagError``): the trainer ran no step, said
    nothing and saved the untouched adapter as ``final`` (exit 0), or failed once loaded."""
    processes = int(os.environ.get("WORLD_SIZE") or 1)
    per_step = per_device_batch(args) * args.grad_accum * processes // args.num_generations
    if prompts < per_step:
        raise FlagError(
            f"the data holds {prompts} prompt(s) (after --limit/--sample), one step takes "
            f"{per_step}: --batch-size ({per_device_batch(args)}) x --grad-accum "
            f"({args.grad_accum}) x {processes} process(es) / --num-generations "
            f"({args.num_generations})"
        )


def per_device_batch(args: argparse.Namespace) -> int:
    """Completions per device step: ``--batch-size``, else one group (``--num-generations``)."""
    return int(args.batch_size or args.num_generations)


def check_whole_groups(args: argparse.Namespace) -> None:
    """TRL's rule that a generation's completions are whole groups, in this command's flags:
    TRL words it in its own settings (``generation_batch_size (6) must be divisible by
    num_generations (4)``), none of which is a flag. The processes are torchrun's or
    accelerate's ``WORLD_SIZE`` (TRL's ``world_size``), 1 when launched alone."""
    processes = int(os.environ.get("WORLD_SIZE") or 1)
    per_step = per_device_batch(args)
    completions = per_step * args.grad_accum * processes
    if args.num_generations >= 1 and completions % args.num_generations:
        raise FlagError(
            f"--batch-size ({per_step}) x --grad-accum ({args.grad_accum}) x {processes} "
            f"process(es) = {completions} completions a generation, not a multiple of "
            f"--num-generations ({args.num_generations}): each prompt's completions are one "
            "group"
        )


def check_grpo_flags(args: argparse.Namespace) -> None:
    """TRL's own checks of the GRPO flags (the batch a multiple of G, G >= 2, ...), and
    transformers' of ``--report-to``, run before the model loads rather than after; whether
    CUDA and 4-bit are used, which only pick the optimizer and precision, is left to
    :func:`grpo_config` then. Seconds (TRL's import): run after the cheaper checks."""
    from transformers.integrations import get_reporting_integration_callbacks

    check_whole_groups(args)
    try:
        config = grpo_config(args, quantize_4bit=False, cuda=False)
    except ValueError as exc:
        raise FlagError(f"TRL's GRPOConfig refuses these flags: {exc}") from None
    try:  # what the trainer asks of --report-to once the model is loaded
        get_reporting_integration_callbacks(config.report_to)
    except ValueError as exc:
        raise FlagError(f"--report-to: {exc}") from None


def use_4bit(args: argparse.Namespace) -> bool:
    """Whether the base model loads in 4-bit (the paper's QLoRA: NF4 weights, 8-bit AdamW).

    On CUDA it is the default, and a missing ``bitsandbytes`` is a :class:`FlagError` naming
    the extra and the opt-out: the run would otherwise train in bf16 with ``adamw_torch`` (not
    the paper's setting, far more memory) without a word. Without CUDA 4-bit cannot load, and a
    GGUF file cannot be re-quantized: both are said in the log, never left to be guessed.
    """
    from trainer_client.modeling import bitsandbytes_available, cuda_available, qlora_install_hint

    if args.no_4bit:
        log.info("--no-4bit: full-precision base weights, adamw_torch")
        return False
    if not cuda_available():
        log.info(
            "no CUDA device: 4-bit QLoRA and 8-bit AdamW are off (full precision, adamw_torch)"
        )
        return False
    if args.gguf_file or ModelRef.parse(args.model, args.gguf_file).gguf_file:
        log.warning("GGUF weights cannot load in 4-bit: full-precision base, adamw_torch")
        return False
    if not bitsandbytes_available():
        raise FlagError(
            "4-bit QLoRA and 8-bit AdamW (the paper's setting, the default on CUDA) need "
            "bitsandbytes, which is not installed: "
            + qlora_install_hint("--no-4bit to train the full-precision base with adamw_torch")
        )
    return True


#: The run's settings, in ``--output-dir`` and beside the final adapter (``sde2-eval`` reads
#: whether the base was 4-bit from it).
TRAINING_RECORD = "sde2_training.json"


def training_record(
    args: argparse.Namespace, config: Any, quantize_4bit: bool, params: dict[str, Any]
) -> dict[str, Any]:
    """What the run trained with, beyond the flags' defaults: the precision of the base and the
    optimizer as TRL received them, the reward, the decoding, the adapter's shape."""
    return {
        "model": recorded_name(args.model),
        "gguf_file": args.gguf_file,
        "load_in_4bit": quantize_4bit,
        "quantization": "nf4, double quantization" if quantize_4bit else None,
        "optimizer": str(getattr(config.optim, "value", config.optim)),
        "bf16": bool(config.bf16),
        "lora": {
            "r": args.lora_r,
            "alpha": args.lora_alpha,
            "dropout": args.lora_dropout,
            "target_modules": args.lora_target,
        },
        "recipe": args.recipe,
        "params": params,
        "num_generations": args.num_generations,
        "advantages": "the reward server's group advantages (population std), scale_rewards=none",
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "dataset": args.dataset,
        "data": args.data,
        "split": args.split,
        "limit": args.limit,
        "sample": args.sample,
        "cop_base": args.cop_base,
        "prompt": args.prompt,
        "seed": args.seed,
        "lr": args.lr,
        "beta": args.beta,
        "warmup_ratio": args.warmup_ratio,
        "max_grad_norm": args.max_grad_norm,
        "batch_size": per_device_batch(args),
        "grad_accum": args.grad_accum,
        "max_length": args.max_length,
    }


#: The record's settings a resumed run must share with the run it continues, and the flag that
#: sets each (``lora`` is compared field by field): the steps after ``--resume`` would
#: otherwise train on another prompt, reward or data than the checkpoint's, and the record
#: would say only one of them.
RESUMED_SETTINGS: dict[str, str] = {
    "model": "--model",
    "gguf_file": "--gguf-file",
    "load_in_4bit": "--no-4bit",
    "optimizer": "--no-4bit",
    "bf16": "the precision (bf16 on a CUDA device that has it)",
    "lora.r": "--lora-r",
    "lora.alpha": "--lora-alpha",
    "lora.dropout": "--lora-dropout",
    "lora.target_modules": "--lora-target",
    "recipe": "--recipe",
    "params": "--param/--weight",
    "num_generations": "--num-generations",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "max_new_tokens": "--max-new-tokens",
    "dataset": "--dataset",
    "data": "--data",
    "split": "--split",
    "limit": "--limit",
    "sample": "--sample",
    "cop_base": "--cop-base",
    "prompt": "--prompt",
    "seed": "--seed",
    "lr": "--lr",
    "beta": "--beta",
    "warmup_ratio": "--warmup-ratio",
    "max_grad_norm": "--max-grad-norm",
    "batch_size": "--batch-size",
    "grad_accum": "--grad-accum",
    "max_length": "--max-length",
}


def _setting(record: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(whether ``record`` holds ``key`` — ``lora.r`` is ``record["lora"]["r"]``, its value)."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def record_differences(recorded: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Each :data:`RESUMED_SETTINGS` entry ``recorded`` holds with another value than
    ``record``, as ``flag: recorded key=value, this command value`` (a setting an older record
    lacks is not compared: what it was is not known).

    >>> record_differences({"prompt": "single", "lora": {"r": 8}}, {"prompt": "multi",
    ...                     "lora": {"r": 8}})
    ['--prompt: the run has prompt="single", this command "multi"']
    """
    out = []
    for key, flag in RESUMED_SETTINGS.items():
        held, was = _setting(recorded, key)
        now = _setting(record, key)[1]
        same = (
            comparable_targets(was) == comparable_targets(now)
            if key == "lora.target_modules"
            else was == now
        )
        if held and not same:
            out.append(
                f"{flag}: the run has {key}={json.dumps(was)}, this command {json.dumps(now)}"
            )
    return out


def resumed_record(
    args: argparse.Namespace, target: str | None, record: dict[str, Any]
) -> dict[str, Any]:
    """The record a run resumed from checkpoint ``target`` keeps: the one it was trained with
    (in the checkpoint, else in ``--output-dir``), never one of other values. A command whose
    settings differ from it is a :class:`FlagError` naming each flag and its recorded value;
    a fresh run (no ``target``) or one without a record writes ``record``."""
    if target is None:
        return record
    kept: dict[str, Any] = {}
    for path in (Path(target) / TRAINING_RECORD, Path(args.output_dir) / TRAINING_RECORD):
        if not path.is_file():
            continue
        try:
            recorded = read_training_record(path)
        except ValueError as exc:
            raise FlagError(f"--resume: {exc}") from None
        differences = record_differences(recorded, record)
        if differences:
            raise FlagError(
                f"--resume continues a run trained with other settings ({path}): "
                + "; ".join(differences)
                + ". Give the run's settings, or train anew in another --output-dir"
            )
        kept = {**recorded, **kept}
    return {**record, **kept}  # a value the run recorded is never replaced


def record_checkpoints(record: dict[str, Any]) -> Any:
    """A ``TrainerCallback`` that writes ``record`` into each ``checkpoint-N/`` as it is saved:
    ``sde2-eval --adapter out/checkpoint-N`` reads what that checkpoint was trained with (the
    folder above holds the latest run's record, which a later run may have written)."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class RecordCheckpoints(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if state.is_world_process_zero and folder.is_dir():
                write_training_record(folder, record)

    return RecordCheckpoints()


class SignalStop:
    """A first SIGINT or SIGTERM (Ctrl-C, ``timeout``, a scheduler's stop) turned into a
    checkpoint and a stop at the end of the step in progress: either ended the process at
    once, and every step since the last save (``--save-steps``, 500) was lost without a word.
    A second one stops at once. :attr:`received`: the signal, once one came."""

    def __init__(self) -> None:
        self.received: int | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            exit_with_status(signum, frame)
        self.received = signum
        log.warning(
            "%s: saving a checkpoint once this step ends, then stopping (again: stop now)",
            signal.Signals(signum).name,
        )

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """The handlers, for the block (main thread only, where Python runs them)."""
        return handling([signal.SIGINT, signal.SIGTERM], self.handle)

    def callback(self) -> Any:
        """The ``TrainerCallback`` that saves and stops at the step's end once a signal came."""
        from transformers import TrainerCallback

        stop = self

        class StopOnSignal(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if stop.received is not None:
                    control.should_save = True
                    control.should_training_stop = True

        return StopOnSignal()


def save_after_failure(trainer: Any, out: Path, record: dict[str, Any]) -> Path | None:
    """A checkpoint of the steps done when a reward failure stopped the run, and the newest
    whole checkpoint (``None``: none, as at step 0).

    The reward is asked for at a step's start, before its backward pass (TRL generates and
    scores at the first micro-step of an optimizer step), so the model, the optimizer and the
    scheduler are those of the last finished step: the checkpoint is the one ``--save-steps``
    would have written there. Without it a service out for longer than the reward deadline lost
    every step since the last save (500 by default). A failed save is said and passed over:
    the run's error is the reward's.
    """
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    step = trainer.state.global_step
    folder = out / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    first = trainer.is_world_process_zero()
    missing = step > 0 and not (folder / TRAINER_STATE).is_file()
    # Every process looks before any saves: one that looked after the first one's save had
    # ended (its state written last) skipped its own, and its RNG state was never written.
    trainer.accelerator.wait_for_everyone()
    if missing:
        # Every process saves (its RNG state; the save's collectives need them all): the
        # trainer's gather made each of them fail at this step.
        try:
            trainer._save_checkpoint(trainer.model, trial=None)
            if first:
                write_training_record(folder, record)
                log.info("saved %s: the %d steps done", folder, step)
        except Exception as exc:  # a full disk: the reward's failure is the one to report
            log.error(
                "could not save a checkpoint at step %d: %s: %s", step, type(exc).__name__, exc
            )
    # Under several processes the others wait for the first one's save: one that went on to
    # exit had the launcher stop the first mid-save (a checkpoint without its state).
    trainer.accelerator.wait_for_everyone()
    return latest_checkpoint(out)


def read_training_record(path: Path) -> dict[str, Any]:
    """The record written by :func:`write_training_record` at ``path``; a :class:`ValueError`
    naming the file when it cannot be read or is not a JSON object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object, got {json_type(record)}")
    return record


def write_training_record(folder: Path, record: dict[str, Any]) -> None:
    """``record`` as :data:`TRAINING_RECORD` in ``folder`` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def local_data(args: argparse.Namespace) -> bool:
    """Whether ``--data`` names a local file or folder (or was meant to): reading it costs
    milliseconds, so it is checked first; a hub dataset is fetched after the server probe."""
    return args.data is not None and (Path(args.data).exists() or looks_like_path(args.data))


def training_examples(args: argparse.Namespace) -> list[Example]:
    """The ``--data`` questions, read and checked (a bad row names its file and line)."""
    try:
        examples = load_examples(args.dataset, args.data, args.split, args.limit, args.cop_base)
    except (ValueError, OSError) as exc:
        raise FlagError(f"--data: {exc}") from None
    if args.sample is None:
        return examples
    if args.sample > len(examples):
        raise FlagError(f"--sample {args.sample}: the data holds {len(examples)} questions")
    return random.Random(args.seed).sample(examples, args.sample)


def build_parser() -> argparse.ArgumentParser:
    """All flags of ``sde2-train``."""
    p = argparse.ArgumentParser(
        prog="sde2-train",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=DefaultsShown,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="hub id, local folder, or a .gguf file")
    g.add_argument("--gguf-file", help="GGUF file name inside --model (a folder or hub repo)")
    g.add_argument(
        "--no-4bit",
        action="store_true",
        help="train the full-precision base with adamw_torch (on CUDA the default is the paper's "
        "4-bit NF4 + 8-bit AdamW, which needs bitsandbytes: pip install 'sde2[train,qlora]', Linux "
        "and Windows)",
    )
    g.add_argument("--lora-r", type=int, default=64, help="LoRA rank")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA scaling alpha")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout, in [0, 1)")
    g.add_argument(
        "--lora-target",
        type=lora_targets,
        default="all-linear",
        help="LoRA target modules: all-linear, names separated by commas (q_proj,v_proj), or a "
        "regular expression over the modules' dotted names",
    )

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default="gsm8k", help="which task's answers")
    g.add_argument(
        "--data", help=f"jsonl file, folder with {{split}}.jsonl, or hub id ({DEFAULT_SOURCES})"
    )
    g.add_argument("--split", default="train", help="the split of --data to train on")
    g.add_argument("--limit", type=int, help="use the first N questions")
    g.add_argument(
        "--sample",
        type=int,
        metavar="N",
        help="use N questions drawn at random (by --seed), as the paper's 7,500 of MedMCQA",
    )
    g.add_argument("--cop-base", type=int, default=0, help="MedMCQA: index of option A in cop")
    add_prompt_flag(g)

    g = p.add_argument_group("reward")
    g.add_argument(
        "--reward-url",
        action="append",
        required=True,
        help="reward server base URL; repeat for replicas (the batch is sharded)",
    )
    g.add_argument("--recipe", choices=list(RECIPES), default="sde2", help="the reward")
    g.add_argument("--weight", action="append", default=[], help="ablation weight, e.g. sd=0")
    add_param_flag(g)
    g.add_argument(
        "--reward-timeout",
        type=float,
        default=180.0,
        help="seconds per try of a request, to its answer's last byte",
    )
    g.add_argument(
        "--reward-retries",
        type=int,
        default=None,
        help="attempts per request (default: as many as --reward-deadline allows)",
    )
    g.add_argument(
        "--reward-deadline",
        type=float,
        default=TRAINER_DEADLINE,
        help="give up on a batch after this many seconds of retries (training then stops)",
    )

    g = p.add_argument_group("GRPO")
    g.add_argument("--output-dir", default="outputs/sde2-grpo", help="checkpoints and records")
    g.add_argument("--max-steps", type=int, default=-1, help="-1: run --epochs")
    g.add_argument("--epochs", type=float, default=1.0, help="passes over the data")
    g.add_argument("--num-generations", type=int, default=6, help="G completions per prompt")
    g.add_argument("--batch-size", type=int, help="completions per device step (default: G)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    g.add_argument("--lr", type=float, default=5e-6, help="learning rate")
    g.add_argument("--warmup-ratio", type=float, default=0.1, help="share of steps warming up")
    g.add_argument("--max-grad-norm", type=float, default=0.1, help="gradient clipping")
    g.add_argument("--beta", type=float, default=0.02, help="KL coefficient")
    g.add_argument("--max-length", type=int, default=2048, help="prompt + completion tokens")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="completion tokens")
    g.add_argument("--temperature", type=float, default=0.2, help="paper: 0.1-0.3")
    g.add_argument("--top-p", type=float, default=0.95, help="paper: 0.90-0.95")
    g.add_argument("--save-steps", type=int, default=500, help="steps between checkpoints")
    g.add_argument("--logging-steps", type=int, default=1, help="steps between log lines")
    g.add_argument("--report-to", default="none", help="none, wandb, tensorboard, ...")
    g.add_argument("--seed", type=int, default=42, help="sampling, data order and init")
    g.add_argument("--no-gradient-checkpointing", action="store_true", help="faster, more memory")
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        help="resume from the latest checkpoint in --output-dir, or from the given folder",
    )
    return p


def build_dataset(
    args: argparse.Namespace, tokenizer: Any, conversational: bool, examples: list[Example]
) -> Any:
    """The ``examples`` (:func:`training_examples`) as prompts with their gold columns,
    dropping prompts that leave no room to answer (:func:`check_flags` made sure there is
    some: ``--max-length`` exceeds ``--max-new-tokens``)."""
    from datasets import Dataset

    rows = [ex.record(conversational, prompt_style(args)) for ex in examples]
    budget = args.max_length - args.max_new_tokens

    def prompt_tokens(row: dict[str, Any]) -> int:
        if conversational:
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return len(ids)
        return len(tokenizer(row["prompt"])["input_ids"])

    kept = [r for r in rows if prompt_tokens(r) <= budget]
    if len(kept) < len(rows):
        log.warning("dropped %d prompts longer than %d tokens", len(rows) - len(kept), budget)
    if not kept:
        raise SystemExit("no prompt fits in --max-length minus --max-new-tokens")
    if len(kept) < len(rows):
        try:
            check_enough_prompts(args, len(kept))
        except FlagError as exc:
            raise FlagError(f"{exc}, once the prompts over --max-length are dropped") from None
    return Dataset.from_list(kept)


def build_trainer(
    args: argparse.Namespace,
    model: Any = None,
    tokenizer: Any = None,
    examples: list[Example] | None = None,
    params: dict[str, Any] | None = None,
    quantize: bool | None = None,
) -> tuple[Any, Any]:
    """The GRPOTrainer and the reward holder (:class:`~trainer_client.trl.SDE2Reward`).

    ``model``/``tokenizer`` may be passed preloaded (tests reuse one load across trainers);
    otherwise they are loaded from ``--model``, after the flags, the reward server and the
    data are checked (:class:`FlagError`, :class:`RewardServiceError`): a model takes minutes
    to load, and nothing is loaded or created to fail on one of those. ``examples`` and
    ``params`` a caller already read and checked (:func:`main`) are not read or checked again,
    nor ``quantize`` (:func:`use_4bit`) decided again.
    """
    from trl import GRPOTrainer

    from trainer_client.client import probe_each
    from trainer_client.modeling import (
        ModelRef,
        cuda_available,
        has_chat_template,
        load_model,
        load_tokenizer,
        model_skeleton,
    )
    from trainer_client.trl import SDE2Reward

    params = params if params is not None else check_flags(args)
    quantize = quantize if quantize is not None else use_4bit(args)
    retry = RetryPolicy(max_attempts=args.reward_retries, deadline=args.reward_deadline)
    info = probe_each(args.reward_url)[0]  # fail fast on a wrong URL
    log.info("reward server: %s (%d replica(s))", info.get("encoder"), len(args.reward_url))
    examples = examples if examples is not None else training_examples(args)

    ref = ModelRef.parse(args.model, args.gguf_file)
    if model is None and not ref.gguf_file:  # (a GGUF file's config is read with its weights)
        skeleton = model_skeleton(ref)
        if skeleton is not None:
            check_lora_target(args.lora_target, skeleton)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ref)
    model = model if model is not None else load_model(ref, quantize_4bit=quantize)
    check_lora_target(args.lora_target, model)
    conversational = has_chat_template(tokenizer)
    dataset = build_dataset(args, tokenizer, conversational, examples)
    answer_type = dataset[0]["answer_type"]

    holder = SDE2Reward(
        args.reward_url,
        recipe=args.recipe,
        answer_type=answer_type,
        params=params,
        timeout=args.reward_timeout,
        retry=retry,
        # The paper's advantages (population std), which TRL leaves as they are with
        # scale_rewards="none" (grpo_config): returning R_final, TRL's sample std made them
        # √((G−1)/G) times the paper's.
        returns="advantages",
        num_generations=args.num_generations,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[holder.reward_function],
        args=grpo_config(args, quantize_4bit=quantize, cuda=cuda_available()),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(args),
    )
    holder.check_trainer_args(trainer)  # its config, reward functions and weights
    return trainer, holder


def grpo_config(args: argparse.Namespace, *, quantize_4bit: bool, cuda: bool) -> Any:
    """TRL's ``GRPOConfig`` from the flags: the paper's Sec. 4 setup with the defaults (cosine
    decay, warmup 0.1, grad clip 0.1, G = 6); 8-bit Adam with 4-bit weights, bf16 on CUDA."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=args.output_dir,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_ratio,  # a float in [0, 1) is a ratio of the total steps
        max_grad_norm=args.max_grad_norm,
        num_generations=args.num_generations,
        per_device_train_batch_size=per_device_batch(args),
        gradient_accumulation_steps=args.grad_accum,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        beta=args.beta,
        # The reward returns the paper's group advantages: TRL only centres them (a no-op).
        scale_rewards="none",
        max_steps=args.max_steps,
        num_train_epochs=args.epochs,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        report_to=args.report_to,
        seed=args.seed,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        optim="adamw_8bit" if quantize_4bit else "adamw_torch",
        bf16=cuda and _bf16_ok(),
        use_cpu=not cuda,
        # The completions table carries the reward's per-completion columns (log_extra: the
        # components, n_strat, uniq, correct, final_answer); a few rows per logging step.
        log_completions=True,
        num_completions_to_print=args.num_generations,
    )


def lora_targets(value: str) -> str | list[str]:
    r"""``--lora-target``: ``all-linear`` (in any case, as PEFT reads it), a regular expression
    over the modules' dotted names (a value holding one of :data:`_REGEX_CHARACTERS`: PEFT's
    reading of a string), else module names separated by commas. The text went to PEFT whole:
    ``q_proj,v_proj``, read as one regular expression, matched no module, and the run failed
    once the model was loaded.

    >>> lora_targets("ALL-linear"), lora_targets(" q_proj, v_proj"), lora_targets(r".*\.q_proj")
    ('all-linear', ['q_proj', 'v_proj'], '.*\\.q_proj')
    """
    text = value.strip()
    if text.lower() == "all-linear":
        return "all-linear"
    if _REGEX_CHARACTERS & set(text):
        try:
            re.compile(text)
        except re.error as exc:
            raise argparse.ArgumentTypeError(
                f"{value!r}: not a regular expression: {exc}"
            ) from None
        return text
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"{value!r}: module names separated by commas (q_proj,v_proj), a regular "
            "expression, or all-linear"
        )
    return names


#: What makes ``--lora-target`` a regular expression rather than names.
_REGEX_CHARACTERS = set("^$*+?()[]{}|\\")


def comparable_targets(value: Any) -> Any:
    """``lora.target_modules`` of a training record as a resumed run compares it: names in
    any order (and an older record's text read as this command reads the flag).

    >>> comparable_targets("v_proj,q_proj") == comparable_targets(["q_proj", "v_proj"])
    True
    """
    if isinstance(value, str):
        try:
            value = lora_targets(value)
        except argparse.ArgumentTypeError:
            return value
    return sorted(value) if isinstance(value, list) else value


def check_lora_target(targets: str | list[str], model: Any) -> None:
    """A :class:`FlagError` when ``--lora-target`` names no layer of ``model`` (a skeleton before
    the load, where the config tells the modules: PEFT said so only once the weights were in)."""
    from trainer_client.modeling import lora_target_issue

    issue = lora_target_issue(model, targets)
    if issue is not None:
        raise FlagError(f"--lora-target: {issue}")


def lora_config(args: argparse.Namespace) -> Any:
    """PEFT's ``LoraConfig`` from the flags (paper: r = 64, alpha = 32, every linear layer)."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target,
        task_type="CAUSAL_LM",
    )


def _cuda() -> bool:
    from trainer_client.modeling import cuda_available

    return cuda_available()


def _bf16_ok() -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported())


def resume_target(args: argparse.Namespace) -> str | None:
    """The checkpoint to resume from, or None (a fresh run, also when none exists yet); a
    checkpoint at or past ``--max-steps`` is refused (``FlagError``: it trained one step more,
    and wrote ``final`` from it)."""
    if not args.resume:
        return None
    if args.resume == "latest":
        target = latest_checkpoint(Path(args.output_dir))
        if target is None:
            log.warning("--resume: no checkpoint in %s yet; starting fresh", args.output_dir)
            return None
    else:
        target = Path(args.resume)
        check_checkpoint(target)
    step = checkpoint_step(target)
    if 0 < args.max_steps <= step:
        raise FlagError(
            f"--resume: {target} is at step {step}, --max-steps {args.max_steps}: nothing "
            "left to train (raise --max-steps)"
        )
    log.info("resuming from %s (step %d)", target, step)
    return str(target)


def how_to_continue(last: str | Path | None, first: str = "fix the reward service and ") -> str:
    """What to do after the training stopped (``first``: what to do before): ``--resume``
    only when a checkpoint exists (it was advised after a failure at step 0, with nothing to
    resume).

    >>> how_to_continue(None)
    'no checkpoint was saved: fix the reward service and run the same command again'
    >>> how_to_continue("out/checkpoint-500", first="")
    'last checkpoint: out/checkpoint-500; rerun with --resume'
    """
    if last is None:
        return f"no checkpoint was saved: {first}run the same command again"
    return f"last checkpoint: {last}; {first}rerun with --resume"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sde2-train``."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # the cheap checks first: the server probe and the model come after
        params = check_flags(args)
        examples = training_examples(args) if local_data(args) else None
        check_grpo_flags(args)
        if examples is not None:
            check_enough_prompts(args, len(examples))
        quantize = use_4bit(args)
        target = resume_target(args)
        config = grpo_config(args, quantize_4bit=quantize, cuda=_cuda())
        record = resumed_record(args, target, training_record(args, config, quantize, params))
    except FlagError as exc:
        parser.error(str(exc))
    try:
        trainer, _ = build_trainer(args, examples=examples, params=params, quantize=quantize)
    except (FlagError, RewardServiceError) as exc:
        print(f"sde2-train: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    # Under several processes (accelerate launch) the first one writes the run's files: every
    # process wrote each of them at once, and said so.
    main_process = trainer.is_world_process_zero()
    if main_process:
        write_training_record(out, record)  # the checkpoints' folder: a resumed run has it too
    trainer.add_callback(record_checkpoints(record))
    stop = SignalStop()
    trainer.add_callback(stop.callback())
    try:
        with stop.installed():
            trainer.train(resume_from_checkpoint=target)
    except RewardServiceError as exc:
        # No step is ever taken on invented rewards: stop, say why, say how to continue.
        last = save_after_failure(trainer, out, record)
        if main_process:
            log.error("training stopped at step %d: %s", trainer.state.global_step, exc)
            log.error("%s", how_to_continue(last))
        return 2
    if stop.received is not None:
        if main_process:
            log.error(
                "training stopped by %s at step %d; %s",
                signal.Signals(stop.received).name,
                trainer.state.global_step,
                how_to_continue(latest_checkpoint(out), first=""),
            )
        return 128 + stop.received
    trainer.save_model(str(out / "final"))  # every process: the trainer saves on the first
    if main_process:
        write_training_record(out / "final", record)
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        log.info("saved the LoRA adapter to %s", out / "final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
