"""What the trainers' reward paths need besides the reward: a tokenizer and a generation engine.

The trainers' own code (OpenRLHF's rollout executor, verl's reward-loop manager) is run for real;
only the language model is replaced. The tokenizer is a real Hugging Face byte-level BPE tokenizer
(the kind GPT-2, Llama 3 and Qwen use), trained in milliseconds on the texts at hand: decoding
its ids gives the text back exactly, as with those models. Loading a real model's tokenizer
would cost tens of seconds here (SmolLM2's GGUF) for no difference in the reward path.

Imported by ``tests/verl_checks.py`` in the verl venv too: keep it free of project imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def byte_level_tokenizer(texts: Iterable[str] = ()) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) trained on ``texts``, with a pad/eos token."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        list(texts) or ["a"], vocab_size=600, min_frequency=1, special_tokens=["<|endoftext|>"]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    finish_reason: str = "stop"
    logprobs: Any = None


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


@dataclass
class ScriptedEngine:
    """Stands in for OpenRLHF's vLLM engine: ``generate`` answers with the next scripted text."""

    tokenizer: Any
    script: list[str]
    prompts_seen: list[list[int]] = field(default_factory=list)

    async def generate(
        self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None
    ) -> _RequestOutput:
        self.prompts_seen.append(list(prompt_token_ids))
        text = self.script.pop(0)
        ids = self.tokenizer(text=text, add_special_tokens=False)["input_ids"]
        return _RequestOutput([_Completion(list(ids), text)])


@dataclass
class SamplingParams:
    """The two fields OpenRLHF's executor reads from vLLM's ``SamplingParams``."""

    max_tokens: int | None = 256
    logprobs: int | None = None
