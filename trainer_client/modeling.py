"""Loading the policy model and tokenizer from a hub id, a local folder, or a GGUF file.

Shared by ``sde2-train`` and ``sde2-eval`` so that both count tokens with the same tokenizer
(#TOK is measured with the policy's own tokenizer, paper Sec. 4.4). GGUF weights (e.g. the small
SmolLM2 checkpoint used in CPU tests) are dequantized by ``transformers`` on load. 4-bit loading
(the paper's QLoRA setting) needs CUDA and ``bitsandbytes`` (the ``qlora`` extra); the commands
decide whether to use it and say so (``sde2-train`` refuses to start on CUDA without
``bitsandbytes`` rather than train another setting than asked), and this module loads as told.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sde2.model")


@dataclass(frozen=True)
class ModelRef:
    """Where a model comes from: ``name_or_path`` plus an optional GGUF file inside it."""

    name_or_path: str
    gguf_file: str | None = None

    @classmethod
    def parse(cls, model: str, gguf_file: str | None = None) -> ModelRef:
        """``--model`` may itself be a ``.gguf`` path: split it into folder and file."""
        path = Path(model).expanduser()
        if gguf_file is None and path.suffix == ".gguf" and path.is_file():
            return cls(str(path.parent), path.name)
        return cls(str(path) if path.exists() else model, gguf_file)

    def check(self, flag: str = "--model") -> None:
        """ValueError (naming ``flag``) when the model names a local path that does not exist
        (``./typo``, ``/models/x``): taken for a hub id, it would fail only after the work
        before the load, with a hub library's traceback."""
        from reward_server.encoders.model_store import names_a_path

        if names_a_path(self.name_or_path) and not Path(self.name_or_path).exists():
            raise ValueError(f"{flag}: no such file or folder: {self.name_or_path}")
        folder = Path(self.name_or_path)
        if self.gguf_file and folder.is_dir() and not (folder / self.gguf_file).is_file():
            raise ValueError(f"--gguf-file: no {self.gguf_file} in {self.name_or_path}")

    def label(self) -> str:
        """How a run of this model is named in tables: a hub id whole (``Path.stem`` cut
        ``Qwen/Qwen2.5-3B-Instruct`` to ``Qwen2``), a local folder by its name, a GGUF file by
        its name without ``.gguf``."""
        if self.gguf_file:
            return Path(self.gguf_file).stem
        path = Path(self.name_or_path)
        return path.name if path.exists() else self.name_or_path

    def kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def recorded_name(model: str) -> str:
    """``--model`` as a training record keeps it and commands compare it: a local path made
    absolute (the record is read from other folders, by ``sde2-eval``'s base check and by a
    resume), a hub id as given.

    >>> recorded_name("org/no-such-local-folder")
    'org/no-such-local-folder'
    """
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def cuda_available() -> bool:
    """Whether torch sees a CUDA device."""
    import torch

    return bool(torch.cuda.is_available())


#: What to install for 4-bit QLoRA and 8-bit AdamW (pyproject's ``qlora`` extra).
QLORA_EXTRA = "sde2[qlora]"

#: Where the ``qlora`` extra installs bitsandbytes (its marker): PyPI has CUDA wheels of
#: bitsandbytes >= 0.46.1 for Linux and Windows (``win_amd64``); elsewhere there is no CUDA.
QLORA_PLATFORMS = ("linux", "win32")


def platform() -> str:
    """``sys.platform`` (a function: the tests pretend another one here only)."""
    return sys.platform


def qlora_install_hint(opt_out: str) -> str:
    """What to do without bitsandbytes on this platform: install the extra where it installs
    bitsandbytes, else (the extra installs nothing here) the ``opt_out`` flag alone.

    >>> import sys; hint = qlora_install_hint("--no-4bit")
    >>> hint.startswith("pip install") == (sys.platform in QLORA_PLATFORMS)
    True
    """
    if platform() in QLORA_PLATFORMS:
        return f"pip install '{QLORA_EXTRA}', or pass {opt_out}"
    return (
        f"the {QLORA_EXTRA} extra installs bitsandbytes on Linux and Windows only, not on "
        f"{platform()}: pass {opt_out}"
    )


def bitsandbytes_available() -> bool:
    """Whether ``bitsandbytes`` (4-bit weights, 8-bit AdamW) can be imported."""
    return importlib.util.find_spec("bitsandbytes") is not None


def can_load_4bit(ref: ModelRef) -> bool:
    """4-bit needs CUDA and bitsandbytes, and GGUF weights cannot be re-quantized on load."""
    return cuda_available() and bitsandbytes_available() and ref.gguf_file is None


def load_tokenizer(ref: ModelRef) -> Any:
    """The policy's tokenizer, left-padded for batched generation, with a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref.name_or_path, **ref.kwargs())
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(ref: ModelRef, *, quantize_4bit: bool = False, for_training: bool = True) -> Any:
    """The causal LM; 4-bit (NF4, double quantization) when asked for and possible."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(ref.kwargs())
    if cuda_available():
        kwargs["dtype"] = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        kwargs["device_map"] = {"": 0}
    else:
        kwargs["dtype"] = torch.float32
    if quantize_4bit:
        if can_load_4bit(ref):
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=kwargs["dtype"],
            )
        else:
            log.info("4-bit loading skipped: needs CUDA, bitsandbytes and non-GGUF weights")
    model = AutoModelForCausalLM.from_pretrained(ref.name_or_path, **kwargs)
    if ref.gguf_file:
        _forget_gguf_quantization(model)
    if "quantization_config" in kwargs and for_training:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model)
    return model


def lora_target_issue(model: Any, targets: str | list[str]) -> str | None:
    r"""Why ``targets`` (``--lora-target``: ``"all-linear"``, a regular expression over the
    modules' dotted names, or module names, each matched as PEFT matches a list: the whole
    dotted name or its last parts) fails on ``model``, else ``None``: a name that no layer LoRA
    can adapt carries (a linear, embedding or convolution module), or a regular expression that
    matches none. Stricter than PEFT, which adapts the names it finds and drops a misspelt one
    without a word. ``model`` may be a skeleton on the meta device (:func:`model_skeleton`).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> lora_target_issue(net, ["0"]) is None, lora_target_issue(net, r"\d")
    (True, None)
    >>> lora_target_issue(net, ["1", "q_proj"])
    "no layer LoRA can adapt is named '1', 'q_proj'; the model's: 0"
    """
    if targets == "all-linear":
        return None
    layers = [name for name, module in model.named_modules() if _adaptable(module)]
    shown = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in layers))
    if isinstance(targets, str):
        if any(re.fullmatch(targets, name) for name in layers):
            return None
        return (
            f"the regular expression {targets!r} matches no layer LoRA can adapt; "
            f"the model's: {shown}"
        )
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in layers)]
    if not missing:
        return None
    return f"no layer LoRA can adapt is named {', '.join(map(repr, missing))}; the model's: {shown}"


def _adaptable(module: Any) -> bool:
    """Whether LoRA adapts ``module``'s kind (PEFT's LoRA layers: linear ones, 4- and 8-bit
    ones included, embeddings, convolutions, GPT-2's ``Conv1D``, multi-head attention)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds = (
        torch.nn.Linear,
        torch.nn.Embedding,
        torch.nn.Conv1d,
        torch.nn.Conv2d,
        torch.nn.Conv3d,
        torch.nn.MultiheadAttention,
        Conv1D,
    )
    return isinstance(module, kinds)


def model_skeleton(ref: ModelRef) -> Any | None:
    """The causal LM's modules without weights (the meta device: no memory, no reading of the
    weights): what is known of the model before the minutes of its load. ``None`` when its
    config cannot be built so (the load then says why, or loads what this could not)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(ref.name_or_path, **ref.kwargs())
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an early check only: the load is the judge
        log.debug("no skeleton of %s before its load: %s", ref.name_or_path, exc)
        return None


def _forget_gguf_quantization(model: Any) -> None:
    """GGUF weights are dequantized to ordinary float tensors on load, but the model keeps a GGUF
    quantizer tag, and ``Trainer`` refuses to train "GGUF-quantized" models. The tensors are
    plain floats, so the tag is dropped: LoRA training and saving then work as for any model."""
    model.hf_quantizer = None
    if "is_quantized" in vars(model):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def has_chat_template(tokenizer: Any) -> bool:
    """Whether prompts should be conversational (the tokenizer knows the chat format)."""
    return bool(getattr(tokenizer, "chat_template", None))
