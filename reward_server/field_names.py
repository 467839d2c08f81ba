"""Naming the field an error is about, for the server's 422s and the client's own checks:
which field a misspelt name meant (the closest field of the model at the name's path), and
which string of a body holds what UTF-8 cannot carry."""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
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


#: A path into a JSON value: object keys and array indexes, from the root.
JSONPath = tuple[str | int, ...]


def unencodable(value: Any) -> tuple[JSONPath, int] | None:
    r"""Where the first string of ``value`` (dicts, lists, tuples and scalars) that UTF-8
    cannot encode is: its path and the index of its first such character, else None. Such a
    string holds a lone surrogate (``\ud800``, a broken tokenizer's decoding), or, read with
    ``surrogateescape``, a byte UTF-8 does not allow. A mapping's keys are looked at before
    its values (:func:`first_found`'s walk).

    >>> unencodable({"items": [{"completion": "ok"}, {"completion": "x\ud800"}]})
    (('items', 1, 'completion'), 1)
    >>> unencodable({"a\udcff": 1}), unencodable(["fine", 3, None])
    ((('a\udcff',), 1), None)
    """
    return first_found(value, _json_children, unencodable_at)


def _json_children(value: Any) -> list[tuple[JSONPath, Any]]:
    """A JSON value's keys (as values, at their own path) then values, or its elements."""
    if isinstance(value, Mapping):
        keys = (((key,), key) for key in value)
        return [*keys, *(((key,), item) for key, item in value.items())]
    if isinstance(value, list | tuple):
        return [((i,), item) for i, item in enumerate(value)]
    return []


def unencodable_at(value: Any) -> int | None:
    r"""The first character of a string that UTF-8 cannot encode (a lone surrogate), or
    None: none, or ``value`` is no string.

    >>> unencodable_at("ab\ud800"), unencodable_at("ok"), unencodable_at(3)
    (2, None, None)
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return exc.start
    return None


def first_found(
    root: Any,
    children: Callable[[Any], Sequence[tuple[JSONPath, Any]]],
    found_at: Callable[[Any], int | None],
) -> tuple[JSONPath, int] | None:
    """The path of the first value under ``root`` (itself included, depth first, in order)
    for which ``found_at`` gives an index, with that index; None when none does.
    ``children(value)``: a value's children, each with the keys from the value to it (none
    for a leaf). The walk is a loop, not recursion (a body may nest deeper than Python's
    stack), and a value's path is a link to its parent's, built into a tuple for the value
    found only: a path copied for each value costs depth times values (measurements:
    benchmarks/README.md, the thirty-second pass).

    >>> first_found([[1, 2], [3, [4]]], _json_children, lambda v: v if v == 4 else None)
    ((1, 1, 0), 4)
    """
    # Each value with its path as a chain of (keys, the parent's chain) pairs, None the root.
    stack: list[tuple[Any, _Chain]] = [(root, None)]
    while stack:
        value, chain = stack.pop()
        at = found_at(value)
        if at is not None:
            return _path(chain), at
        stack.extend(reversed([(child, (keys, chain)) for keys, child in children(value)]))
    return None


#: A path as :func:`first_found` walks it: the last keys and the parent's chain, None the root.
_Chain = tuple[JSONPath, "_Chain"] | None


def _path(chain: _Chain) -> JSONPath:
    """The path ``chain`` links, from the root.

    >>> _path(((2,), (("items",), None)))
    ('items', 2)
    """
    parts: list[JSONPath] = []
    while chain is not None:
        keys, chain = chain
        parts.append(keys)
    return tuple(key for keys in reversed(parts) for key in keys)


def not_utf8(at: int) -> str:
    r"""Why a string that UTF-8 cannot carry from its character ``at`` on is refused: the
    words of the server's 422 (both transports), of the clients, which send nothing, and of
    the offline commands, written once so that they say it alike.

    >>> print(not_utf8(3))
    not valid UTF-8 at character 3: a lone surrogate (\ud800-\udfff) or a byte UTF-8 does not allow
    """
    return (
        f"not valid UTF-8 at character {at}: a lone surrogate (\\ud800-\\udfff) or a byte "
        "UTF-8 does not allow"
    )


def unencodable_in_json(document: bytes | str) -> tuple[JSONPath, int] | None:
    r""":func:`unencodable` of a JSON ``document`` that a strict parser (pydantic's: the
    server's, the offline commands') refused as invalid JSON: the string that made it refuse,
    when one holds a lone surrogate escape (``"\ud800"``) or a byte UTF-8 does not allow (the
    strict parser's error gives a line and column only), else None. Read again by the
    standard library's parser, which lets both through (the bytes decoded with
    ``surrogateescape``); a document it refuses too, or nests too deep, gives None.

    >>> unencodable_in_json(b'{"items": [{"completion": "ab\xff"}]}')
    (('items', 0, 'completion'), 2)
    >>> unencodable_in_json('{"a": "\\udc00"}'), unencodable_in_json(b'{"a": ')
    ((('a',), 0), None)
    """
    text = document.decode("utf-8", "surrogateescape") if isinstance(document, bytes) else document
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return unencodable(value)


def printable_path(path: Sequence[object]) -> JSONPath:
    r"""``path`` with each key made text UTF-8 can carry (a lone surrogate written as its
    escape), for an error that names it. A client's dict may hold a key that is not a string
    (``None``, a float: JSON writes it as one), shown as ``str`` shows it.

    >>> printable_path(("x\ud800", 3, None, 2.5))
    ('x\\ud800', 3, 'None', '2.5')
    """
    return tuple(p if isinstance(p, int) else str(p).encode("utf-8", "backslashreplace").decode()
                 for p in path)  # fmt: skip


def shown_path(path: Sequence[object]) -> str:
    r"""``path`` dotted as the 422s name fields, its keys printable whatever they hold
    (``"body"`` for the root).

    >>> shown_path(("items", 1, "completion")), shown_path(("x\ud800",)), shown_path(())
    ('items.1.completion', 'x\\ud800', 'body')
    """
    return ".".join(map(str, printable_path(path))) or "body"
