"""The completion schema parser of SPEC §1: strategy blocks and the final answer.

It never raises and runs in time linear in the input: every regular expression below that
searches is anchored on a literal ``<`` and its variable part (``[^<>]*`` or whitespace)
cannot run past the next ``<``, so scans from different start positions never overlap; the
one that reads a block's body (:func:`_block_body`) is matched once per block, over that
block's text only: its fields' repetitions are possessive, and what can backtrack (a tag's
attributes, a closing's whitespace) stops at the next ``<`` or ``>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import accumulate, chain, islice, pairwise, repeat
from typing import Literal, NamedTuple

from reward_server.core.text import field_text, field_texts


class Strategy(NamedTuple):
    """One kept strategy block: its reasoning text ``r`` and outcome text ``o`` (field texts).

    A named tuple: a step makes hundreds, and the reward's scan builds them from ``(r, o)``
    pairs it already holds (a tuple is built in C; a frozen dataclass's ``__init__`` is not).
    """

    reasoning: str
    outcome: str


class ParsedCompletion(NamedTuple):
    """What the reward needs from one (preprocessed) completion (a named tuple: one per item
    of every step)."""

    strategies: tuple[Strategy, ...]
    final_answer: str | None

    @property
    def n_strat(self) -> int:
        """``n_strat(a) = |S(a)|``."""
        return len(self.strategies)


def _ascii_caseless(name: str) -> str:
    # Case-insensitive for ASCII only (the inline `a` flag): plain IGNORECASE folds Unicode, which
    # would let look-alikes such as the Kelvin sign match "k". Cheaper for `re` than [xX] classes.
    return f"(?ai:{re.escape(name)})"


#: What follows an opening tag's name: `>`, or one whitespace character, anything but `<`/`>`,
#: then `>` (``<NAME>``, ``<NAME id="1">``).
_ATTRS = r"(?:\s[^<>]*)?>"


@cache
def _opening(name: str) -> re.Pattern[str]:
    return re.compile(rf"<{_ascii_caseless(name)}{_ATTRS}")


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


def _raw_field(
    text: str, opening_re: re.Pattern[str], closing_re: re.Pattern[str], start: int, end: int
) -> str:
    """The uncleaned content that :func:`_field` reads (``""`` when a tag is missing)."""
    opening = opening_re.search(text, start, end)
    if opening is None:
        return ""
    closing = closing_re.search(text, opening.end(), end)
    return "" if closing is None else text[opening.end() : closing.start()]


def _field(
    text: str, opening_re: re.Pattern[str], closing_re: re.Pattern[str], start: int, end: int
) -> str:
    """:func:`first_field` with its patterns given (the scan below looks them up once)."""
    return field_text(_raw_field(text, opening_re, closing_re, start, end))


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
    return parse_completions([text], max_strategies)[0]


@cache
def _event() -> re.Pattern[str]:
    """Every tag the reward reads, in one left-to-right scan (:func:`_scan_fields`);
    ``lastindex`` tells them apart:

    1. a strategy closing; ``None``: a strategy opening, alone;
    3. a strategy opening followed by a whole well-formed block, read at once: its reasoning
       field (group 2), its outcome field (group 3) and its closing, with no ``<`` elsewhere;
    4. / 5. a ``final_answer`` opening / closing; 6. / 7. an ``answer`` opening / closing.

    A block read at once is what :func:`scan_strategies` reads there, field by field: its body
    holds no other tag the scan looks for (``<strategy_outcome`` is not a strategy tag: the name
    must end with ``>`` or a space), the first reasoning opening is the body's, the first
    closing after it is the next ``<``, and likewise for the outcome. No tag hides inside
    another match (none holds a ``<`` but its first character), so every tag is seen. Reading
    a body fails at the first ``<`` that does not fit, which never lies past the next strategy
    tag, so attempts from different openings scan disjoint stretches and the scan stays
    linear; the fields' ``[^<]*+`` never backtrack.
    """
    s, f, a = map(_ascii_caseless, ("strategy", "final_answer", "answer"))
    return re.compile(
        rf"<(?:(/{s}\s*>)|{s}{_ATTRS}(?:{_whole_block()})?"
        rf"|({f}{_ATTRS})|(/{f}\s*>)|({a}{_ATTRS})|(/{a}\s*>))"
    )


@cache
def _block_body() -> re.Pattern[str]:
    """A strategy block's body, between its opening and its closing, read as
    :func:`scan_strategies` reads it when a field holds a ``<`` that is text (as in
    "x < 5"): reasoning field (group 1), outcome field (group 2), nothing else but text
    between them, and in a field no ``<`` that could begin a tag the scan reads (any name
    starting with one of theirs, opening or closing). So the first reasoning opening is the
    body's, the first closing after it ends the field, and likewise for the outcome (an
    outcome tag inside the reasoning would begin with ``<strategy``). The answer names are
    left out of fields for safety only: a real answer tag in the block would have been a tag
    of the split, so a text such as ``<answers`` merely sends the completion tag by tag.
    The fields' repetitions are possessive.
    """
    r, o = map(_ascii_caseless, ("reasoning", "strategy_outcome"))
    names = "|".join(map(_ascii_caseless, ("strategy", "reasoning", "final_answer", "answer")))
    field = rf"([^<]*+(?:<(?!/?(?:{names}))[^<]*+)*+)"
    return re.compile(
        rf"[^<]*+<{r}{_ATTRS}{field}</{r}\s*>[^<]*+<{o}{_ATTRS}{field}</{o}\s*>[^<]*+"
    )


@cache
def _split_tags() -> re.Pattern[str]:
    """What :func:`raw_fields` splits a completion on: :func:`_event`'s tags, with whole
    fields read at once and fewer groups (each group is a list entry per tag in ``split``):

    1. / 2. a whole well-formed strategy block's reasoning and outcome (:func:`_event`'s
    groups 2 and 3); 3. / 4. a whole ``final_answer`` / ``answer`` field with no ``<`` in it;
    5. any other tag the scan reads, as its text after the ``<`` (``strategy>``,
    ``/final_answer >``...), told apart in Python where it occurs.

    A whole field is what the scan records there when no field of its name is open: its
    opening, then the first closing after it, the next ``<``. An open field began at an
    opening that was not read whole (group 5), where :func:`raw_fields` reads tag by tag.
    """
    s, f, a = map(_ascii_caseless, ("strategy", "final_answer", "answer"))
    others = rf"/{s}\s*>|{s}{_ATTRS}|/{f}\s*>|{f}{_ATTRS}|/{a}\s*>|{a}{_ATTRS}"
    return re.compile(
        rf"<(?:{s}{_ATTRS}{_whole_block()}|{f}{_ATTRS}([^<]*+)</{f}\s*>"
        rf"|{a}{_ATTRS}([^<]*+)</{a}\s*>|({others}))"
    )


def _whole_block() -> str:
    """A well-formed block's body and closing, its fields as groups (no ``<`` elsewhere)."""
    r, o, s = map(_ascii_caseless, ("reasoning", "strategy_outcome", "strategy"))
    return (
        rf"[^<]*+<{r}{_ATTRS}([^<]*+)</{r}\s*>"
        rf"[^<]*+<{o}{_ATTRS}([^<]*+)</{o}\s*>[^<]*+</{s}\s*>"
    )


class RawFields(NamedTuple):
    """A completion's fields as SPEC §1 reads them, before field cleaning."""

    #: ``r`` and ``o`` of every completed strategy block, in order (one entry per block each).
    reasonings: list[str]
    outcomes: list[str]
    #: The recorded ``final_answer`` and ``answer`` fields (SPEC §1's field lists).
    final_answers: list[str]
    answers: list[str]


#: In ``_split_tags().split(text)``: each tag's 5 groups then the text after it, per tag.
_STRIDE = 6
#: Longer texts are scanned tag by tag (:func:`_scan_fields` streams its matches): ``split``
#: holds six list entries per tag at once, and a body of tag floods may hold millions of tags.
#: Completions are a few KB; the shortcut is for them.
SPLIT_MAX_CHARS = 65536


def raw_fields(text: str) -> RawFields:
    """The strategy blocks' fields and the answer field lists of ``text``, in one scan.

    ``_split_tags().split`` hands back every tag's groups in one C call. In the usual
    completion every strategy block is well formed and read whole, and whatever follows the
    last one is whole answer fields: then the fields are slices of that list, with no Python
    work per tag. Past the first tag that is not a whole block, the list is read tag by tag:
    whole blocks and fields, a field whose content holds a ``<`` that is text (its opening,
    then its closing), and a block whose fields do (an opening alone, then its closing, the
    body between them read by :func:`_block_body`). Any other completion, or one over
    :data:`SPLIT_MAX_CHARS`, is read from the text tag by tag (:func:`_scan_fields`, the
    reference: this function returns what it returns for every text).
    """
    if len(text) > SPLIT_MAX_CHARS:
        return _scan_fields(text)
    parts = _split_tags().split(text)
    reasonings = parts[1::_STRIDE]
    try:
        whole = reasonings.index(None)  # the first tag that is not a whole block
    except ValueError:
        whole = len(reasonings)
    # Built by tuple.__new__: a named tuple's own __new__ is a Python function (one per text).
    fields = tuple.__new__(
        RawFields, (reasonings[:whole], parts[2 : _STRIDE * whole : _STRIDE], [], [])
    )
    tags = len(reasonings)
    tag = whole
    # A tag's groups are parts[at + 1] to parts[at + 5]; parts[following] is the text up to
    # the next tag, whose groups follow.
    while tag < tags:
        at = _STRIDE * tag
        if parts[at + 1] is not None:  # a whole block
            fields.reasonings.append(parts[at + 1])
            fields.outcomes.append(parts[at + 2])
        elif parts[at + 3] is not None:
            fields.final_answers.append(parts[at + 3])
        elif parts[at + 4] is not None:
            fields.answers.append(parts[at + 4])
        else:  # a tag alone: an opening whose content holds a "<", closed by the next tag
            following = at + _STRIDE
            if tag + 1 == tags or not _closes(parts[at + 5], parts[following + 5]):
                return _scan_fields(text)
            name = parts[at + 5][0].lower()
            if name == "f":
                fields.final_answers.append(parts[following])
            elif name == "a":
                fields.answers.append(parts[following])
            elif (body := _block_body().fullmatch(parts[following])) is not None:
                fields.reasonings.append(body[1])
                fields.outcomes.append(body[2])
            else:
                return _scan_fields(text)
            tag += 1  # past the closing too
        tag += 1
    return fields


def _closes(opening: str, closing: str | None) -> bool:
    """Whether ``closing`` (a tag's text after ``<``, or ``None`` for a tag read whole) is the
    closing of ``opening``'s name: their first letters tell the names apart (and an
    ``opening`` that is itself a closing starts with ``/``, no name's first letter)."""
    return closing is not None and closing[0] == "/" and closing[1].lower() == opening[0].lower()


def _scan_fields(text: str) -> RawFields:
    """:func:`raw_fields` tag by tag, for any completion.

    Most blocks are read whole by one match of :func:`_event`; any other block (a ``<``
    inside a field, tags out of order, a missing field) is read tag by tag between its
    opening and closing, as :func:`scan_strategies` does. A field list records an opening's
    content up to the first closing after it, other openings included, and stops at an
    opening never closed (what :func:`field_spans` does with two searches a field).
    """
    fields = RawFields([], [], [], [])
    lists = fields.final_answers, fields.answers
    reasoning = _opening("reasoning"), _closing("reasoning")
    outcome = _opening("strategy_outcome"), _closing("strategy_outcome")
    pending = -1  # end of the pending strategy opening, if any
    open_at = [-1, -1]  # end of the open final_answer / answer opening, if any
    for tag in _event().finditer(text):
        kind = tag.lastindex
        if kind == 3:  # a whole well-formed block (it drops a pending opening)
            fields.reasonings.append(tag.group(2))
            fields.outcomes.append(tag.group(3))
            pending = -1
        elif kind is None:
            pending = tag.end()  # a newer opening drops an unclosed pending one
        elif kind == 1:
            if pending >= 0:
                end = tag.start()
                fields.reasonings.append(_raw_field(text, *reasoning, pending, end))
                fields.outcomes.append(_raw_field(text, *outcome, pending, end))
                pending = -1
        else:
            which = (kind - 4) // 2  # 0: final_answer, 1: answer
            if kind % 2 == 0:  # an opening: starts a field unless one is open
                if open_at[which] < 0:
                    open_at[which] = tag.end()
            elif open_at[which] >= 0:  # the first closing after the open opening
                lists[which].append(text[open_at[which] : tag.start()])
                open_at[which] = -1
    return fields


def parse_completions(texts: Sequence[str], max_strategies: int) -> list[ParsedCompletion]:
    """:func:`parse_completion` of each text, with the fields of all of them cleaned at once.

    The kept blocks are the first occurrences of the distinct ``(r, o)`` pairs with both
    fields non-empty, in order, cut to ``max_strategies``: what the scan's walk keeps (a
    duplicate is a valid block equal to an earlier kept one, and every earlier valid block
    short of the cap was kept). In the usual batch no field is empty and no two blocks of the
    whole batch are equal, so each completion keeps all its blocks (cut to the cap): told and
    built by C-level list operations over the batch. Otherwise ``dict.fromkeys`` finds each
    completion's kept blocks.

    >>> block = "<strategy><reasoning>{}</reasoning><strategy_outcome>1</strategy_outcome>"
    >>> parsed = parse_completions([block.format("a") + "</strategy>" + block.format(" a ")
    ...                             + "</strategy>", "<strategy>"], 32)
    >>> [(p.strategies, p.final_answer) for p in parsed]
    [((Strategy(reasoning='a', outcome='1'),), '1'), ((), None)]
    """
    if not texts:
        return []
    # Per kind of field (reasonings, outcomes, final answers, answers), every text's list.
    kinds = list(zip(*map(raw_fields, texts), strict=True))
    cleaned = field_texts(list(chain.from_iterable(chain.from_iterable(kinds))))
    regions = list(accumulate((sum(map(len, lists)) for lists in kinds), initial=0))
    reasonings, outcomes, finals, answers = (cleaned[regions[k] : regions[k + 1]] for k in range(4))
    blocks = list(map(tuple.__new__, repeat(Strategy), zip(reasonings, outcomes, strict=True)))
    bounds = list(accumulate(map(len, kinds[0]), initial=0))
    if "" in reasonings or "" in outcomes or len(set(blocks)) < len(blocks):
        per_text = [
            tuple(islice(filter(all, dict.fromkeys(blocks[a:b])), max_strategies))
            for a, b in pairwise(bounds)
        ]
    else:  # every block is kept, up to the cap
        per_text = [tuple(blocks[a : min(b, a + max_strategies)]) for a, b in pairwise(bounds)]
    if "" not in finals and len(finals) == len(texts) and max(map(len, kinds[2])) == 1:
        # One non-empty final_answer field per text (the usual case): each is f_ans.
        return list(
            map(tuple.__new__, repeat(ParsedCompletion), zip(per_text, finals, strict=True))
        )
    final_bounds = list(accumulate(map(len, kinds[2]), initial=0))
    answer_bounds = list(accumulate(map(len, kinds[3]), initial=0))
    parsed = []
    for i, strategies in enumerate(per_text):
        # The last non-empty final_answer, else answer, else the last kept outcome, else None.
        answer = next(filter(None, reversed(finals[final_bounds[i] : final_bounds[i + 1]])), None)
        if answer is None:
            answer = next(
                filter(None, reversed(answers[answer_bounds[i] : answer_bounds[i + 1]])), None
            )
        if answer is None and strategies:
            answer = strategies[-1].outcome
        parsed.append(tuple.__new__(ParsedCompletion, (strategies, answer)))
    return parsed
