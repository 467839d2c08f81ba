"""The completion schema parser of SPEC §1: strategy blocks and the final answer.

It never raises and runs in time linear in the input: every regular expression below is
anchored on a literal ``<`` and its variable part (``[^<>]*`` or whitespace) cannot run past
the next ``<``, so scans from different start positions never overlap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from reward_server.core.text import field_text


@dataclass(frozen=True)
class Strategy:
    """One kept strategy block: its reasoning text ``r`` and outcome text ``o`` (field texts)."""

    reasoning: str
    outcome: str


@dataclass(frozen=True)
class ParsedCompletion:
    """What the reward needs from one (preprocessed) completion."""

    strategies: tuple[Strategy, ...]
    final_answer: str | None

    @property
    def n_strat(self) -> int:
        """``n_strat(a) = |S(a)|``."""
        return len(self.strategies)


def _ascii_caseless(name: str) -> str:
    # Explicit [xX] classes rather than re.IGNORECASE, whose Unicode folding would let look-alikes
    # such as the Kelvin sign match "k".
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in name)


@cache
def _opening(name: str) -> re.Pattern[str]:
    # `<NAME>` or `<NAME` + one whitespace character + anything but `<`/`>` + `>`.
    return re.compile(rf"<{_ascii_caseless(name)}(?:\s[^<>]*)?>")


@cache
def _closing(name: str) -> re.Pattern[str]:
    return re.compile(rf"</{_ascii_caseless(name)}\s*>")


@cache
def _opening_or_closing(name: str) -> re.Pattern[str]:
    n = _ascii_caseless(name)
    return re.compile(rf"<(/)?{n}(?:(?(1)\s*|(?:\s[^<>]*)?))>")


def first_field(text: str, name: str, start: int = 0, end: int | None = None) -> str:
    """Field text between the first ``<name…>`` in ``text[start:end]`` and the first closing
    after it; ``""`` when either tag is missing."""
    stop = len(text) if end is None else end
    opening = _opening(name).search(text, start, stop)
    if opening is None:
        return ""
    closing = _closing(name).search(text, opening.end(), stop)
    if closing is None:
        return ""
    return field_text(text[opening.end() : closing.start()])


def field_list(text: str, name: str) -> list[str]:
    """Every ``<name>…</name>`` field text, scanning left to right as SPEC §1 prescribes.

    >>> field_list("<answer>1</answer> <answer> 2 </ANSWER> <answer>3", "answer")
    ['1', '2']
    """
    fields: list[str] = []
    opening_re, closing_re = _opening(name), _closing(name)
    pos = 0
    while (opening := opening_re.search(text, pos)) is not None:
        closing = closing_re.search(text, opening.end())
        if closing is None:
            break
        fields.append(field_text(text[opening.end() : closing.start()]))
        pos = closing.end()
    return fields


def strategy_blocks(text: str, max_strategies: int) -> tuple[Strategy, ...]:
    """``S(a)``: valid, non-duplicate strategy blocks in order, at most ``max_strategies``.

    >>> blocks = strategy_blocks(
    ...     '<strategy id="1"><reasoning>add</reasoning><strategy_outcome>5</strategy_outcome>'
    ...     '</strategy><strategy><reasoning>x</reasoning></strategy>', 32)
    >>> [(s.reasoning, s.outcome) for s in blocks]
    [('add', '5')]
    """
    kept: list[Strategy] = []
    seen: set[Strategy] = set()
    pending: int | None = None  # end offset of the opening tag of the block being read
    for tag in _opening_or_closing("strategy").finditer(text):
        if tag.group(1) is None:
            pending = tag.end()  # a newer opening drops an unclosed pending one
            continue
        if pending is None:
            continue  # a closing without an opening is ignored
        start, end, pending = pending, tag.start(), None
        block = Strategy(
            first_field(text, "reasoning", start, end),
            first_field(text, "strategy_outcome", start, end),
        )
        if block.reasoning and block.outcome and block not in seen:
            seen.add(block)
            kept.append(block)
            if len(kept) == max_strategies:
                break
    return tuple(kept)


def final_answer(text: str, strategies: tuple[Strategy, ...]) -> str | None:
    """``f_ans(a)``: last non-empty ``final_answer``, else last non-empty ``answer``, else the
    outcome of the last kept strategy, else ``None``.

    >>> final_answer("<answer>3</answer><final_answer>4</final_answer>", ())
    '4'
    """
    for name in ("final_answer", "answer"):
        non_empty = [f for f in field_list(text, name) if f]
        if non_empty:
            return non_empty[-1]
    return strategies[-1].outcome if strategies else None


def parse_completion(text: str, max_strategies: int) -> ParsedCompletion:
    """Parse an already preprocessed completion (see :func:`reward_server.core.text.preprocess`)."""
    strategies = strategy_blocks(text, max_strategies)
    return ParsedCompletion(strategies, final_answer(text, strategies))
