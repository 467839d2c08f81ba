"""Text normalization of SPEC §1: preprocessing of whole texts and cleaning of field texts.

Both are applied identically to completions and gold answers so that typographic variants
(curly quotes, Unicode dashes, full-width digits, Markdown emphasis) never decide a reward.
"""

from __future__ import annotations

import re
import unicodedata

#: SPEC §1's typographic map. No replacement is itself a key, so replacing one character at a
#: time gives what a simultaneous mapping would; ``str.replace`` scans at memchr speed, where
#: ``str.translate`` with a table looks every character of a non-ASCII string up in a dict.
_PUNCTUATION = (
    *((c, "'") for c in "\u2018\u2019\u201a\u201b\u2032"),
    *((c, '"') for c in "\u201c\u201d\u201e\u201f\u2033"),
    *((c, "-") for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"),
)

# A Markdown fence marker with an optional language word right after it.
_FENCE = re.compile(r"(?:```|~~~)(?:[A-Za-z][A-Za-z0-9_+\-]*)?")


def preprocess(text: str) -> str:
    """Map typographic quotes and dashes to ASCII, then apply Unicode NFKC.

    >>> preprocess("\u201c3\u20134\u201d")
    '"3-4"'
    >>> preprocess("\uff11\uff18")  # full-width digits
    '18'

    Most completions are pure ASCII, which neither step changes (the map's keys are all
    non-ASCII and NFKC leaves ASCII alone); ``str.isascii`` is O(1), and skipping both steps
    took a quarter off parsing a GRPO step.
    """
    if text.isascii():
        return text
    for char, ascii_char in _PUNCTUATION:
        if char in text:
            text = text.replace(char, ascii_char)
    return unicodedata.normalize("NFKC", text)


def field_text(raw: str) -> str:
    """Clean the content of a tag: drop fences and ``**``/``__``, fold whitespace, strip.

    >>> field_text("  ```python\\n x = 1 ```  **18** ")
    'x = 1 18'
    >>> field_text("<reasoning>**</reasoning>".split(">")[1].split("<")[0])
    ''
    """
    text = _FENCE.sub(" ", raw).replace("**", "").replace("__", "")
    # str.split() with no argument splits on runs of str.isspace characters and drops the ends.
    return " ".join(text.split())
