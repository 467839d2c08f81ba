"""The completion schema parser of SPEC §1: strategy blocks and the final answer.

It never raises and runs in time linear in the input: every regular expression below is
anchored on a literal ``<`` and its variable part (``[^<>]*`` or whitespace) cannot run past
the next ``<``, so scans from different start positions never overlap.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Literal, NamedTuple

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


def field_tags(
    text: str, name: str, start: int = 0, end: int | None = None
) -> tuple[re.Match[str] | None, re.Match[str] | None]:
    """The first ``<name…>`` in ``text[start:end]`` and the first closing after it (either may
    be ``None``): where :func:`first_field` reads its field, kept for explanations."""
    stop = len(text) if end is None else end
    opening = _opening(name).search(text, start, stop)
    if opening is None:
        return None, None
    return opening, _closing(name).search(text, opening.end(), stop)


def first_field(text: str, name: str, start: int = 0, end: int | None = None) -> str:
    """Field text between the first ``<name…>`` in ``text[start:end]`` and the first closing
    after it; ``""`` when either tag is missing."""
    return _field(text, _opening(name), _closing(name), start, len(text) if end is None else end)


def _field(
    text: str, opening_re: re.Pattern[str], closing_re: re.Pattern[str], start: int, end: int
) -> str:
    """:func:`first_field` with its patterns given (the scan below looks them up once)."""
    opening = opening_re.search(text, start, end)
    if opening is None:
        return ""
    closing = closing_re.search(text, opening.end(), end)
    if closing is None:
        return ""
    return field_text(text[opening.end() : closing.start()])


@dataclass(frozen=True)
class FieldSpan:
    """One recorded ``<name>…</name>`` field: tag and content offsets, and its field text."""

    start: int  # the opening tag's first character
    content_start: int
    content_end: int
    end: int  # just after the closing tag
    text: str


def field_spans(text: str, name: str) -> tuple[list[FieldSpan], tuple[int, int] | None]:
    """Every recorded ``<name>…</name>`` field (SPEC §1's left-to-right scan), and the span of
    the opening tag that stopped the scan for want of a closing (``None`` if none did)."""
    fields: list[FieldSpan] = []
    opening_re, closing_re = _opening(name), _closing(name)
    pos = 0
    while (opening := opening_re.search(text, pos)) is not None:
        closing = closing_re.search(text, opening.end())
        if closing is None:
            return fields, opening.span()
        content = text[opening.end() : closing.start()]
        fields.append(
            FieldSpan(
                opening.start(), opening.end(), closing.start(), closing.end(), field_text(content)
            )
        )
        pos = closing.end()
    return fields, None


def field_list(text: str, name: str) -> list[str]:
    """Every ``<name>…</name>`` field text, scanning left to right as SPEC §1 prescribes.

    >>> field_list("<answer>1</answer> <answer> 2 </ANSWER> <answer>3", "answer")
    ['1', '2']
    """
    return [f.text for f in field_spans(text, name)[0]]


#: What became of a completed strategy block: kept in ``S(a)``, invalid (an empty field),
#: a duplicate of an earlier kept block, or beyond ``max_strategies`` (never looked at).
BlockStatus = Literal["kept", "invalid", "duplicate", "beyond_max"]


class Block(NamedTuple):
    """A completed ``<strategy…>…</strategy>`` block, as :func:`scan_strategies` saw it (a
    named tuple: the reward's hot path makes one per block, and tuples are cheap to build)."""

    start: int  # the opening tag's first character
    end: int  # just after the closing tag
    content_start: int
    content_end: int
    strategy: Strategy
    status: BlockStatus


class StrayTag(NamedTuple):
    """A ``<strategy>`` tag that made no block: an opening dropped because another opening came
    before its closing (or none came), or a closing with no pending opening."""

    start: int
    end: int
    kind: Literal["unclosed_opening", "stray_closing"]


def scan_strategies(
    text: str, max_strategies: int, *, exhaustive: bool = False
) -> Iterator[Block | StrayTag]:
    """SPEC §1's scan of strategy blocks, event by event, left to right.

    The reward (:func:`strategy_blocks`) keeps the ``kept`` blocks and stops once
    ``max_strategies`` are kept; ``exhaustive`` goes on to the end, reporting later blocks as
    ``beyond_max`` and every stray tag (what an explanation lists as ignored).
    """
    seen: set[Strategy] = set()
    kept = 0
    reasoning = _opening("reasoning"), _closing("reasoning")
    outcome = _opening("strategy_outcome"), _closing("strategy_outcome")
    pending: re.Match[str] | None = None  # the opening of the block being read
    for tag in _opening_or_closing("strategy").finditer(text):
        if tag.group(1) is None:
            if pending is not None and exhaustive:
                yield StrayTag(pending.start(), pending.end(), "unclosed_opening")
            pending = tag  # a newer opening drops an unclosed pending one
            continue
        if pending is None:
            if exhaustive:
                yield StrayTag(tag.start(), tag.end(), "stray_closing")
            continue  # a closing without an opening is ignored
        opening, pending = pending, None
        start, end = opening.end(), tag.start()
        block = Strategy(_field(text, *reasoning, start, end), _field(text, *outcome, start, end))
        status: BlockStatus
        if kept >= max_strategies:
            status = "beyond_max"
        elif not (block.reasoning and block.outcome):
            status = "invalid"
        elif block in seen:
            status = "duplicate"
        else:
            status = "kept"
            seen.add(block)
            kept += 1
        yield Block(opening.start(), tag.end(), start, end, block, status)
        if kept == max_strategies and not exhaustive:
            return
    if pending is not None and exhaustive:
        yield StrayTag(pending.start(), pending.end(), "unclosed_opening")


def strategy_blocks(text: str, max_strategies: int) -> tuple[Strategy, ...]:
    """``S(a)``: valid, non-duplicate strategy blocks in order, at most ``max_strategies``.

    >>> blocks = strategy_blocks(
    ...     '<strategy id="1"><reasoning>add</reasoning><strategy_outcome>5</strategy_outcome>'
    ...     '</strategy><strategy><reasoning>x</reasoning></strategy>', 32)
    >>> [(s.reasoning, s.outcome) for s in blocks]
    [('add', '5')]
    """
    return tuple(
        event.strategy
        for event in scan_strategies(text, max_strategies)
        if isinstance(event, Block) and event.status == "kept"
    )


#: Where ``f_ans(a)`` came from (SPEC §1's priority order).
AnswerSource = Literal["final_answer", "answer", "strategy"]


def locate_final_answer(
    text: str, strategies: tuple[Strategy, ...]
) -> tuple[str | None, AnswerSource | None, FieldSpan | None]:
    """``f_ans(a)`` with its source and, for a tag field, the field it was read from."""
    for name in ("final_answer", "answer"):
        non_empty = [f for f in field_spans(text, name)[0] if f.text]
        if non_empty:
            source: AnswerSource = "final_answer" if name == "final_answer" else "answer"
            return non_empty[-1].text, source, non_empty[-1]
    if strategies:
        return strategies[-1].outcome, "strategy", None
    return None, None, None


def final_answer(text: str, strategies: tuple[Strategy, ...]) -> str | None:
    """``f_ans(a)``: last non-empty ``final_answer``, else last non-empty ``answer``, else the
    outcome of the last kept strategy, else ``None``.

    >>> final_answer("<answer>3</answer><final_answer>4</final_answer>", ())
    '4'
    """
    return locate_final_answer(text, strategies)[0]


def parse_completion(text: str, max_strategies: int) -> ParsedCompletion:
    """Parse an already preprocessed completion (see :func:`reward_server.core.text.preprocess`)."""
    strategies = strategy_blocks(text, max_strategies)
    return ParsedCompletion(strategies, final_answer(text, strategies))
