"""What TRL hands a reward function, read as the reward server reads it: a completion's text
(standard or conversational, the model's reasoning fields first) and a stable group key for
a prompt, the same in every process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

#: Where a parsed assistant message holds the model's reasoning, first found first (the order of
#: transformers' ``chat_template_utils._REASONING_FIELDS``).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def completion_text(completion: Any) -> str:
    """The text of a standard (``str``) or conversational (list of messages) completion.

    Conversational completions are ``[{"role": "assistant", "content": ...}]``; content may be a
    string or a list of typed parts (``{"type": "text", "text": ...}``). A chat template with a
    response schema puts the model's reasoning in ``reasoning_content``, ``thinking`` or
    ``reasoning`` (transformers reads the three as one, in that order; TRL's gpt-oss template
    writes ``thinking``): it comes first, as the model wrote it (the strategies are often there).
    Assistant turns are joined in order (tool turns in between are not the model's words).

    >>> completion_text([{"role": "assistant", "reasoning_content": "R", "content": "C"}])
    'R\\nC'
    >>> completion_text([{"role": "assistant", "thinking": "R", "content": "C"}])
    'R\\nC'
    >>> completion_text(None)
    Traceback (most recent call last):
    ...
    ValueError: a completion is a string or a list of messages, got NoneType
    """
    if isinstance(completion, str):
        return completion
    parts: list[str] = []
    for message in _messages(completion):
        if not _is_model_turn(message):
            continue
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k)), None)
        if isinstance(reasoning, str):
            parts.append(reasoning)
        content = message.get("content")
        if isinstance(content, str):
            if content:
                parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
            )
    return "\n".join(parts)


def _messages(completion: Any) -> Sequence[Mapping[str, Any]]:
    """A conversational completion's messages (one message alone is a list of one); a
    :class:`ValueError` naming what else it is."""
    if isinstance(completion, Mapping):
        return [completion]
    if isinstance(completion, str) or not isinstance(completion, Sequence):
        kind = type(completion).__name__
        raise ValueError(f"a completion is a string or a list of messages, got {kind}")
    for message in completion:
        if not isinstance(message, Mapping):
            kind = type(message).__name__
            raise ValueError(f"a completion's messages are mappings, got a {kind}")
    return completion


def _is_model_turn(message: Mapping[str, Any]) -> bool:
    """Whether a message holds the model's words (an assistant turn; no role: the model's)."""
    return message.get("role", "assistant") == "assistant"


def has_tool_turns(completion: Any) -> bool:
    """Whether a conversational completion holds a turn that is not the model's (a tool's).

    >>> has_tool_turns([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "9"}])
    True
    >>> has_tool_turns("a"), has_tool_turns([{"role": "assistant", "content": "a"}])
    (False, False)
    """
    return not isinstance(completion, str) and not all(map(_is_model_turn, _messages(completion)))


def prompt_key(prompt: Any) -> str:
    """A stable group id for a prompt: identical prompts (text or messages) share it, images
    included (TRL puts a vision prompt's PIL images in its messages), across processes too.

    >>> prompt_key("2 + 2?") == prompt_key("2 + 2?") != prompt_key("2 + 3?")
    True
    """
    canonical = (
        prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=_digest)
    )
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _digest(value: Any) -> Any:
    """A prompt part JSON cannot write, as something it can that names its content alike in
    every process: an image (PIL, numpy: anything with ``tobytes``) by a digest of its pixels,
    mode and size; a set by its members in order; anything else by its ``repr``, unless that is
    the default one, which shows an address (each process would group the same prompt apart).

    >>> _digest({"b", "a"}), _digest(b"x")
    ({'set': ['"a"', '"b"']}, "bytes:b'x'")
    >>> _digest(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a prompt holds a object, which names no content: ... (give it a tobytes() ...)
    """
    if isinstance(value, set | frozenset):  # members as JSON, nested sets included
        return {"set": sorted(json.dumps(m, sort_keys=True, default=_digest) for m in value)}
    tobytes = getattr(value, "tobytes", None)
    if not callable(tobytes):
        if type(value).__repr__ is object.__repr__:
            raise ValueError(
                f"a prompt holds a {type(value).__name__}, which names no content: JSON cannot "
                "write it and its repr is its address (give it a tobytes() or a __repr__)"
            )
        return f"{type(value).__name__}:{value!r}"
    shape = (
        getattr(value, "size", None),
        getattr(value, "mode", None),
        getattr(value, "shape", None),
    )
    pixels = hashlib.blake2b(tobytes(), digest_size=16).hexdigest()
    return f"{type(value).__name__}:{shape}:{pixels}"
