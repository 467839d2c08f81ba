"""Which field a misspelt name meant: the closest field of the model at the name's path, for
the errors that refuse an unknown field (the server's 422, the client's own checks)."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


def unknown_field_hint(model: type | None, kind: str, loc: Sequence[int | str]) -> str:
    """:func:`did_you_mean` for an issue of ``kind`` (its wire kind) at ``loc``: only an
    unknown field (``extra_forbidden``) of a known ``model`` gets a hint. The one rule of the
    server's 422s, the offline commands and the client's parameter check.

    >>> from reward_server.core import RewardParams
    >>> unknown_field_hint(RewardParams, "extra_forbidden", ("epss",))
    " (did you mean 'eps'?)"
    >>> unknown_field_hint(RewardParams, "float_parsing", ("epss",))
    ''
    """
    if kind != "extra_forbidden" or model is None:
        return ""
    return did_you_mean(model, loc)


def did_you_mean(model: type, loc: Sequence[int | str]) -> str:
    """`` (did you mean 'NAME'?)`` for the unknown field at ``loc`` inside ``model``, when
    one of the fields there is close to it, else ``""``. ``loc`` is pydantic's path: field
    names, and list indexes (an item of ``items``).

    >>> from reward_server.core import RewardParams
    >>> did_you_mean(RewardParams, ("similarity_treshold",))
    " (did you mean 'similarity_threshold'?)"
    >>> did_you_mean(RewardParams, ("weights", "sdd")), did_you_mean(RewardParams, ("zzz",))
    (" (did you mean 'sd'?)", '')
    """
    fields = _fields_at(model, loc[:-1]) if loc else []
    name = str(loc[-1]) if loc else ""
    # difflib's cutoff (a ratio of 0.6) needs the name within 7/3 of a field's length; a longer
    # name (a client's 780k-character key) is no misspelling, and indexing it cost 0.15 s.
    if not fields or len(name) > 3 * max(map(len, fields)):
        return ""
    close = difflib.get_close_matches(name, fields, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields_at(model: Any, path: Sequence[int | str]) -> list[str]:
    """The field names of what ``path`` leads to inside ``model`` (none where it leads to
    no model: a value, or a path the model does not have)."""
    kind = model
    for part in path:
        kind = _element(kind) if isinstance(part, int) else _field_type(kind, part)
        if kind is None:
            return []
    return list(_fields(kind))


def _fields(kind: Any) -> dict[str, Any]:
    """A model's fields (a pydantic model, or a pydantic dataclass), else none."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return dict(kind.model_fields)
    return dict(getattr(kind, "__pydantic_fields__", {}))


def _field_type(kind: Any, name: str) -> Any:
    """The type of field ``name`` of ``kind``, an optional one's non-None part."""
    field = _fields(kind).get(name)
    return None if field is None else _unwrapped(field.annotation)


def _element(kind: Any) -> Any:
    """What a list of ``kind`` holds (``list[ScoreItem]``: ``ScoreItem``)."""
    args = typing.get_args(kind)
    return _unwrapped(args[0]) if typing.get_origin(kind) in (list, tuple) and args else None


def _unwrapped(annotation: Any) -> Any:
    """``X`` of ``X | None`` (and of ``Optional[X]``); any other annotation as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return annotation
