"""What a scoring request must pass beyond its schema, each failure a wire issue naming the
field at fault: pydantic's own errors translated (:func:`issues_from_validation`), the server's
size limits (:func:`size_issues`), and the per-request work limits a prepared batch can exceed
(:func:`check_encoder_budget`, :func:`check_explanation_size`).

Functions of the request and the limits only: the scoring service calls them with its settings,
and a route whose request spells its fields otherwise (OpenRLHF's) passes a ``loc_map`` that
names them as its client sent them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from pydantic import ValidationError

from reward_server.core import PreparedBatch, ScoreItem
from reward_server.core.text import preprocess
from reward_server.encoders.base import MAX_SEQ_LENGTH
from reward_server.field_names import unknown_field_hint
from reward_server.service.batcher import estimate_tokens
from reward_server.service.config import Settings
from reward_server.service.errors import (
    MAX_ISSUES,
    Loc,
    RequestInvalid,
    issue,
    wire_kind,
)
from reward_server.service.schemas import REQUEST_MODELS

#: The most characters Unicode NFKC makes of one (U+FDFA, UAX #15's expansion factor for NFKC);
#: SPEC §1's typography map is one-to-one.
NFKC_MAX_EXPANSION = 18
#: Each item's text fields and the setting bounding its length in characters: the limit check
#: and the OpenAPI document's ``maxLength`` both read this one table.
ITEM_TEXT_LIMITS: dict[str, str] = {
    "completion": "max_completion_chars",
    "prompt": "max_completion_chars",
    "answer": "max_answer_chars",
    "group": "max_answer_chars",
}
#: The fields scored after NFKC (SPEC §1): their limit also holds after normalization.
NFKC_FIELDS = frozenset({"completion", "answer"})

#: A route's renaming of the request's field paths into its own request's (OpenRLHF's routes).
LocMap = Callable[[Loc], Loc]


def mapped_loc(loc_map: LocMap | None, loc: Loc) -> Loc:
    """``loc`` as the route's request names it (unchanged without a ``loc_map``)."""
    return loc_map(loc) if loc_map else loc


def issues_from_validation(
    exc: ValidationError, loc_map: LocMap | None = None
) -> list[dict[str, Any]]:
    """pydantic errors -> wire issues (without echoing the offending input back), each named
    by :func:`wire_kind`; an unknown field of a request says which field it likely meant."""
    model = REQUEST_MODELS.get(exc.title)
    out = []
    for err in exc.errors(include_url=False, include_input=False)[:MAX_ISSUES]:
        kind, msg = wire_kind(err["type"], err["msg"])
        msg += unknown_field_hint(model, kind, err["loc"])
        out.append(issue(mapped_loc(loc_map, tuple(err["loc"])), msg, kind))
    return out


def item_text_limits(settings: Settings) -> dict[str, int]:
    """:data:`ITEM_TEXT_LIMITS` with this server's values."""
    return {name: int(getattr(settings, setting)) for name, setting in ITEM_TEXT_LIMITS.items()}


def text_over_limit(value: str | None, limit: int, nfkc: bool) -> str | None:
    """Why ``value`` is over ``limit`` characters (raw, or after NFKC when ``nfkc``), or None.

    NFKC can expand a character 18x (U+FDFA): a non-ASCII text is normalized only when it is
    long enough to pass the limit after the largest expansion, so shorter ones are not
    normalized twice.

    >>> text_over_limit("abc", 2, nfkc=False)
    'at most 2 characters, got 3'
    >>> text_over_limit("\ufdfa", 10, nfkc=True)
    'at most 10 characters after Unicode NFKC normalization, got 18'
    >>> text_over_limit("\ufdfa", 18, nfkc=True) is None
    True
    """
    if value is None:
        return None
    if len(value) > limit:
        return f"at most {limit} characters, got {len(value)}"
    if nfkc and value and len(value) * NFKC_MAX_EXPANSION > limit and not value.isascii():
        n = len(preprocess(value))
        if n > limit:
            return f"at most {limit} characters after Unicode NFKC normalization, got {n}"
    return None


def could_be_over(items: Sequence[ScoreItem], name: str, limit: int) -> bool:
    """Whether some item's text field ``name`` may be over ``limit`` (:func:`text_over_limit`
    tells which): its longest value is, or would be after the largest NFKC expansion. One
    C-level pass a field; a standard step's items are all far below their limits.

    >>> items = [ScoreItem(completion="abc", answer="1"), ScoreItem(completion="", answer="1")]
    >>> could_be_over(items, "completion", 3 * NFKC_MAX_EXPANSION)
    False
    >>> could_be_over(items, "prompt", 1)  # no item has one
    False
    >>> could_be_over(items, "completion", 3 * NFKC_MAX_EXPANSION - 1)
    True
    """
    longest = max(map(len, filter(None, map(attrgetter(name), items))), default=0)
    return longest * (NFKC_MAX_EXPANSION if name in NFKC_FIELDS else 1) > limit


def too_many_items(count: int, limit: int) -> str | None:
    """Why ``count`` items are too many for one request (None: they are not).

    >>> too_many_items(3, 2), too_many_items(2, 2)
    ('at most 2 items per request, got 3', None)
    """
    return f"at most {limit} items per request, got {count}" if count > limit else None


def size_issues(
    items: Sequence[ScoreItem], settings: Settings, loc_map: LocMap | None = None
) -> list[dict[str, Any]]:
    """The server's size limits a request's ``items`` exceed (the schema's own constraints are
    already checked): their count, then each item's text fields in turn, as issues (no item
    is looked at once :data:`~reward_server.service.errors.MAX_ISSUES` are found: no answer
    lists more)."""
    issues: list[dict[str, Any]] = []
    too_many = too_many_items(len(items), settings.max_items)
    if too_many is not None:
        issues.append(issue(mapped_loc(loc_map, ("items",)), too_many, "too_long"))
    limits = {
        name: limit
        for name, limit in item_text_limits(settings).items()
        if could_be_over(items, name, limit)
    }
    for i, item in enumerate(items if limits else ()):
        if len(issues) >= MAX_ISSUES:
            break
        for name, limit in limits.items():
            problem = text_over_limit(getattr(item, name), limit, name in NFKC_FIELDS)
            if problem is not None:
                issues.append(issue(mapped_loc(loc_map, ("items", i, name)), problem, "too_long"))
    return issues


#: The 422 ``type`` of each per-request work limit a batch can exceed.
_LIMIT_KINDS = {
    "max_request_tokens": "too_many_tokens",
    "max_explain_cells": "explanation_too_large",
}


def work_over_limit(
    loc_map: LocMap | None, need: str, limit: int, setting: str, advice: str
) -> RequestInvalid:
    """The 422 at ``items`` of a batch needing more work than the per-request ``setting``
    (``limit``) allows: what it needs, the limit, and what to do."""
    msg = f"{need}, more than this server's limit of {limit} per request ({setting}): {advice}"
    return RequestInvalid.one(mapped_loc(loc_map, ("items",)), msg, _LIMIT_KINDS[setting])


def check_encoder_budget(texts: list[str], limit: int, loc_map: LocMap | None = None) -> None:
    """At most ``limit`` (``max_request_tokens``) estimated tokens of encoder work for one
    request's ``texts``, else :class:`RequestInvalid`: one request must not hold the shared
    encoder for minutes.

    >>> check_encoder_budget(["abcd"] * 3, 10)  # 3 texts of 3 tokens: 9 <= 10
    >>> check_encoder_budget(["abcd"] * 4, 10)
    Traceback (most recent call last):
    ...
    reward_server.service.errors.RequestInvalid: items: needs about 12 encoder tokens (4 ...
    """
    if len(texts) * MAX_SEQ_LENGTH <= limit:  # no text is estimated above the model's limit
        return
    needed = sum(map(estimate_tokens, texts))
    if needed > limit:
        need = f"needs about {needed} encoder tokens ({len(texts)} distinct strategy texts)"
        raise work_over_limit(loc_map, need, limit, "max_request_tokens", "split the batch")


def check_explanation_size(
    prepared: PreparedBatch, limit: int, loc_map: LocMap | None = None
) -> None:
    """At most ``limit`` (``max_explain_cells``) cosine-matrix entries for explaining
    ``prepared`` (``m²`` an item), else :class:`RequestInvalid`: the one part of an
    explanation that grows faster than the request (256 blocks of one short reasoning make a
    65,536-entry matrix from 20 KB)."""
    cells = sum(len(a.parsed.strategies) ** 2 for a in prepared.analyses)
    if cells > limit:
        need = (
            f"explaining this batch needs {cells} cosine-matrix entries "
            "(the sum of m² over its items)"
        )
        advice = "explain fewer items, or with a lower max_strategies"
        raise work_over_limit(loc_map, need, limit, "max_explain_cells", advice)
