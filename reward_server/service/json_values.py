"""How many JSON values a request body holds, counted in its bytes before any parser reads it.

pydantic's JSON validation builds the whole document, then validates every value and keeps an error
for each bad one, so a body of a few MiB of empty objects in ``items`` costs the server seconds and
gigabytes (two errors an item, then their dicts), and a body of valid tiny items or of unknown keys
grows the same way; the server's item limit only applies after that (measurements:
benchmarks/README.md, the service's design). A body is therefore first counted here, in time linear
in its bytes and memory a small multiple of them, and refused when it holds more values than any
request the server accepts can (:func:`values_over`).

Values are counted as JSON defines them: the root, each array element and each object
member's value (keys are not values). In a valid document that is one plus the commas between
elements or members plus the containers that hold at least one value, commas and brackets
inside strings not counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_QUOTE, _COMMA, _OPEN, _CLOSE = b'",{}'  # "[" | 0x20 is "{", "]" | 0x20 is "}"
_BLANKS = np.frombuffer(b" \t\r\n", np.uint8)


def count_values(body: bytes) -> int:
    r"""The number of JSON values in ``body``, when it is a JSON document (for other bytes, a
    number of no meaning, which the parser then refuses anyway).

    Whole-array passes over the bytes, never a Python step or object per token (a ``re.sub``
    over the strings would keep a list of every piece; measurements: benchmarks/README.md, the
    service's design). Escapes go first, as pairs: ``\\`` pairs, then ``\"``, so every quote
    left opens or closes a string; a byte is inside a string when an odd number of quotes
    precede it (an XOR scan).

    >>> count_values(b'{"items": [{"completion": "a, [b]", "answer": "1"}]}')
    5
    >>> count_values(b'{"items": [{}, {}, { }]}'), count_values(b'[]'), count_values(b'7')
    (5, 1, 1)
    >>> count_values(b'["a\\\\", "b\\\\\\"c", 0]')  # escaped backslash, escaped quote
    4
    """
    data = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = ~np.logical_xor.accumulate(data == _QUOTE)
    commas = int(np.count_nonzero((data == _COMMA) & outside))
    folded = data | 0x20
    containers = int(np.count_nonzero((folded == _OPEN) & outside))
    # Empty containers: an opening bracket whose next byte outside strings and blanks closes.
    marks = folded[outside & ~np.isin(data, _BLANKS)]
    empty = int(np.count_nonzero((marks[:-1] == _OPEN) & (marks[1:] == _CLOSE)))
    return 1 + commas + containers - empty


def values_over(body: bytes, limit: int) -> int | None:
    """:func:`count_values` of ``body`` when it is over ``limit``, else None.

    Most bodies are told apart by one cheaper pass: the commas and opening brackets of the
    whole body, strings included, bound the count from above. Only a body over the limit by
    that bound is counted exactly (measurements: benchmarks/README.md, the service's design).

    >>> values_over(b'[0, 0, 0]', 4) is None, values_over(b'[0, 0, 0]', 3)
    (True, 4)
    >>> values_over(b'["0, 0, 0, 0"]', 2) is None  # over by the bound, not by the count
    True
    """
    data = np.frombuffer(body, np.uint8)
    bound = (
        1 + int(np.count_nonzero(data == _COMMA)) + int(np.count_nonzero((data | 0x20) == _OPEN))
    )
    if bound <= limit:
        return None
    count = count_values(body)
    return count if count > limit else None


def values_of(value: Any) -> int:
    """The values JSON holds for ``value`` (dicts, lists and scalars as ``json.dumps`` writes
    them): the count :func:`count_values` gives for its document.

    >>> values_of({"items": [{"completion": "a", "answer": "1"}], "normalize": None})
    6
    """
    if isinstance(value, dict):
        return 1 + sum(map(values_of, value.values()))
    if isinstance(value, list | tuple):
        return 1 + sum(map(values_of, value))
    return 1
