"""Tiny Qwen2-type checkpoints built in-process (no hub access), for tests that need a real
``transformers`` model and tokenizer but not a trained one: decoding settings, GRPO steps.

The tokenizer is a byte-level BPE (Qwen2's kind: ``AutoTokenizer`` loads it as
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the saved vocabulary; a word-level
vocabulary would read every text as no tokens) trained here on a few words, so any text
round-trips. A chat template is optional: with one, the project's prompts are conversational
(as for an Instruct checkpoint); without, plain text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A minimal chat template: each message's content on its own line, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}answer: {% endif %}"
)
PAD, EOS = "<|endoftext|>", "<|im_end|>"
CORPUS = "<strategy> <reasoning> <strategy_outcome> <final_answer> <answer> the answer is 18 \n"


def tiny_qwen2(
    folder: Path,
    *,
    chat: bool = False,
    generation: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Save a 1-layer Qwen2 causal LM (width 32) and its tokenizer in ``folder``; ``generation``
    is written as the checkpoint's ``generation_config.json`` (e.g. the ``repetition_penalty``
    and ``top_k`` Qwen2.5-Instruct ships)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([CORPUS] * 8, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, eos_token=EOS)
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    pad, eos = tk.token_to_id(PAD), tk.token_to_id(EOS)
    model_config = Qwen2Config(
        vocab_size=tk.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(model_config).save_pretrained(folder)
    if generation is not None:
        settings = {"eos_token_id": eos, "pad_token_id": pad, **generation}
        GenerationConfig(**settings).save_pretrained(folder)
    return folder
