"""Text normalization of SPEC §1: preprocessing of whole texts and cleaning of field texts.

Both are applied identically to completions and gold answers so that typographic variants
(curly quotes, Unicode dashes, full-width digits, Markdown emphasis) never decide a reward.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise

import numpy as np

#: SPEC §1's typographic map. No replacement is itself a key, so replacing one character at a
#: time gives what a simultaneous mapping would; ``str.replace`` scans at memchr speed, where
#: ``str.translate`` with a table looks every character of a non-ASCII string up in a dict.
_PUNCTUATION = (
    *((c, "'") for c in "\u2018\u2019\u201a\u201b\u2032"),
    *((c, '"') for c in "\u201c\u201d\u201e\u201f\u2033"),
    *((c, "-") for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"),
)

# A Markdown fence marker with an optional language word right after it: one pattern a marker,
# each starting with a literal, which `re` finds far faster than an alternation (a step's 130k
# characters without a fence: 43 us against 390).
_FENCES = {m[0]: re.compile(rf"{m}(?:[A-Za-z][A-Za-z0-9_+\-]*)?") for m in ("```", "~~~")}


def _without_fences(text: str) -> str:
    """``text`` with each fence marker and its language word made a space. (One marker's
    replacement never makes or breaks the other's: they share no character.)

    >>> _without_fences("a```py x~~~1```")
    'a  x 1 '
    """
    # `in` of one character is a memchr scan; most texts hold neither "`" nor "~".
    for char, fence in _FENCES.items():
        if char in text:
            text = fence.sub(" ", text)
    return text


def preprocess(text: str) -> str:
    """Map typographic quotes and dashes to ASCII, then apply Unicode NFKC.

    >>> preprocess("\u201c3\u20134\u201d")
    '"3-4"'
    >>> preprocess("\uff11\uff18")  # full-width digits
    '18'

    Most completions are pure ASCII, which neither step changes (the map's keys are all
    non-ASCII and NFKC leaves ASCII alone); ``str.isascii`` is O(1), and skipping both steps
    took a quarter off parsing a GRPO step. NFKC is :func:`nfkc`, linear in any text.
    """
    if text.isascii():
        return text
    for char, ascii_char in _PUNCTUATION:
        if char in text:
            text = text.replace(char, ascii_char)
    return nfkc(text)


def nfkc(text: str) -> str:
    """Unicode NFKC of ``text``, in time linear in it whatever it holds (SPEC §1).

    Python's own NFKC puts each run of combining marks in canonical order by insertion, which
    is quadratic in a run's length (60,000 marks took 11 s, holding the GIL). A text holding a
    run longer than :data:`MAX_NON_STARTERS` (UAX #15's stream-safe bound, which no writing
    system needs) is first decomposed and ordered here, each run by a stable sort; Python's
    NFKC of that finds nothing to reorder and composes in one pass. Every other text, the
    usual ones, goes to Python's NFKC directly.

    >>> text = "a" + "\u0316\u0301" * 20_000  # marks of classes 220 and 230, interleaved
    >>> nfkc(text) == "\u00e1" + "\u0316" * 20_000 + "\u0301" * 19_999
    True
    """
    if unicodedata.is_normalized("NFKC", text):  # the usual non-ASCII text: nothing to do
        return text
    runs = _flood_runs(text)
    if runs is not None:  # (a text without a run comes back as it was)
        text = runs.sub(_canonical_decomposition, text)
    return unicodedata.normalize("NFKC", text)


def _canonical_decomposition(run: re.Match[str]) -> str:
    """NFKD of a run of non-starters in linear time: each character's own decomposition,
    then each run of combining marks in it stably sorted by combining class (the Canonical
    Ordering Algorithm). Python's NFKD of the text holding it is then the same as of the
    original text: the run's marks are ordered, and the few that the character before the run
    decomposes into (at most a handful) are moved past them one by one.
    """
    decomposed = "".join(map(_decomposition, run.group(0)))
    return _mark_runs().sub(_ordered_run, decomposed)


@cache
def _decomposition(char: str) -> str:
    return unicodedata.normalize("NFKD", char)


def _ordered_run(run: re.Match[str]) -> str:
    return "".join(sorted(run.group(0), key=unicodedata.combining))


#: UAX #15's Stream-Safe Text Format: at most this many non-starters (combining marks, and
#: characters whose decomposition starts with one) in a row. A longer run makes :func:`nfkc`
#: order the marks itself, since Python's NFKC would take quadratic time on it.
MAX_NON_STARTERS = 30
#: Past the last combining mark of Unicode 15 (U+1E94A); the scan below reads up to here.
_LAST_MARK = 0x1F000
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


@cache
def _non_starters() -> frozenset[str]:
    """Every character with a combining class, or whose decomposition starts with one (U+0F73,
    U+FF9E...): UAX #15's non-starters."""
    found = []
    for code in range(0x80, _LAST_MARK):
        char = chr(code)
        first = unicodedata.normalize("NFKD", char)[:1]
        if unicodedata.combining(char) or (first and unicodedata.combining(first)):
            found.append(char)
    return frozenset(found)


def _class_of(codes: list[int]) -> str:
    """A regular-expression character class of ``codes`` (sorted): listed characters in the
    Basic Multilingual Plane, which ``re`` turns into one table lookup a character (6 ns), and
    ranges past it, which it tests one by one (100 ns a character)."""
    bmp = "".join(re.escape(chr(code)) for code in codes if code < 0x10000)
    astral: list[list[int]] = []
    for code in (code for code in codes if code >= 0x10000):
        if astral and astral[-1][1] == code - 1:
            astral[-1][1] = code
        else:
            astral.append([code, code])
    return "[" + bmp + "".join(f"{chr(a)}-{chr(b)}" for a, b in astral) + "]"


@cache
def _non_starter_runs() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Runs of more than :data:`MAX_NON_STARTERS` non-starters: among characters of the Basic
    Multilingual Plane only, and among all (built once, ~40 ms). Only texts holding a
    character past the BMP (an emoji, say) are searched with the second, slower one."""
    marks = sorted(map(ord, _non_starters()))
    run = f"{{{MAX_NON_STARTERS + 1},}}"
    bmp = _class_of([code for code in marks if code < 0x10000])
    return re.compile(bmp + run), re.compile(_class_of(marks) + run)


def non_starter_flood(text: str) -> int | None:
    """Where ``text`` first holds more than :data:`MAX_NON_STARTERS` non-starters in a row
    (the offset of the run), or None: a text whose runs :func:`nfkc` orders itself.

    >>> non_starter_flood("e\u0301" + "a\u0301" * 40), non_starter_flood("x" + "\u0f73" * 31)
    (None, 1)
    >>> non_starter_flood("\U0001f600 a" + "\u0301\U0001d165" * 16)  # marks past the BMP too
    3
    """
    runs = _flood_runs(text)
    run = None if runs is None else runs.search(text)
    return None if run is None else run.start()


def _flood_runs(text: str) -> re.Pattern[str] | None:
    """The pattern of runs of more than :data:`MAX_NON_STARTERS` non-starters that suits
    ``text``, or None when ``text`` is too short in characters beyond ASCII to hold one (a C
    pass, under 1 ns a character)."""
    if text.isascii() or len(text) - len(text.encode("ascii", "ignore")) <= MAX_NON_STARTERS:
        return None
    bmp, every = _non_starter_runs()
    return every if _ASTRAL.search(text) else bmp


@cache
def _mark_runs() -> re.Pattern[str]:
    """Runs of two or more characters with a combining class (in decomposed text, the
    non-starters are exactly these)."""
    codes = sorted(ord(char) for char in _non_starters() if unicodedata.combining(char))
    return re.compile(_class_of(codes) + "{2,}")


def field_text(raw: str) -> str:
    """Clean the content of a tag: drop fences and ``**``/``__``, fold whitespace, strip.

    >>> field_text("  ```python\\n x = 1 ```  **18** ")
    'x = 1 18'
    >>> field_text("<reasoning>**</reasoning>".split(">")[1].split("<")[0])
    ''
    """
    text = _without_fences(raw).replace("**", "").replace("__", "")
    if _folded(text):
        return text
    # str.split() with no argument splits on runs of str.isspace characters and drops the ends.
    return " ".join(text.split())


#: Between fields in :func:`field_texts`: NUL, which model output does not hold (when a field
#: does, the batch is cleaned field by field) and which no cleaning step touches.
_SEP = "\x00"


def field_texts(raws: list[str]) -> list[str]:
    """:func:`field_text` of each of ``raws``, cleaned together in a few passes over one string.

    A step holds hundreds of fields; cleaning them one by one costs a Python call and half a
    dozen C scans each. Joined with NUL instead, each step of the cleaning runs once: no step
    matches across a NUL (a fence marker, ``**``, ``__`` and whitespace never contain one), so
    each field comes out as :func:`field_text` would make it, and the NULs stay where they
    were. The joined text is read a byte a character, as Latin-1 (``bytes.translate`` and
    whole-array numpy operations in place of work per character or per word: folding a
    step's 130k characters by ``" ".join(text.split())`` makes 25k words and takes 1.1 ms,
    against 0.1 ms), so a field holding a character beyond Latin-1 (a ``?`` in those bytes)
    is cleaned again alone, as is every field when one holds a NUL itself. ``<`` is an
    ordinary character here (a reasoning such as "x < 5" keeps the batch path).

    >>> field_texts([" a  b ", "**", "```py x```", "\\n", "x < 5", " \u2192\u3000 "])
    ['a b', '', 'x', '', 'x < 5', '\u2192']
    >>> field_texts(["a```python####"])  # clean once the fence is a space
    ['a ####']
    """
    if not raws:
        return []
    # A field holding a NUL: no batch. (`in` over a plain join is a memchr scan for a Latin-1
    # text; counting the joined text's separators is a character loop.)
    if _SEP in "".join(raws):
        return [field_text(raw) for raw in raws]
    joined = _SEP.join(raws)
    fenced = "`" in joined or "~" in joined
    if fenced:
        joined = _without_fences(joined)
    try:
        data, wide = joined.encode("latin-1"), []
    except UnicodeEncodeError:
        data = joined.encode("latin-1", "replace")
        wide = _fields_beyond_latin1(joined, data)
    untidy = _untidy(data)
    if not untidy:
        # Each field is its own field text: the fields as they came, unless a fence was
        # replaced (splitting the joined text again would copy them all).
        cleaned = joined.split(_SEP) if fenced else list(raws)
    else:
        if untidy & (_STAR | _UNDERSCORE):
            data = _without_emphasis(data, untidy)
            untidy = _untidy(data)  # what is left: folding only when whitespace needs it
        if untidy & _SPACED:
            # Each run of whitespace is one space now; the fields' ends lose theirs.
            cleaned = list(map(str.strip, _fold_runs(data).split(_SEP)))
        else:
            cleaned = data.decode("latin-1").split(_SEP)
    for i in wide:
        cleaned[i] = field_text(raws[i])
    return cleaned


def _without_emphasis(data: bytes, untidy: int) -> bytes:
    """``data`` without ``**`` then without ``__``, as :func:`field_text` removes them, each
    removal made only where it can change something (model output with bold text seldom has
    ``__``).

    >>> _without_emphasis(b"_**_ **a**", _STAR)
    b' a'
    """
    if untidy & _STAR:
        data = _DOUBLE_STAR.sub(b"", data)
    if untidy & _UNDERSCORE or (untidy & _STAR and b"_" in data):  # "_**_" makes a "__"
        data = _DOUBLE_UNDERSCORE.sub(b"", data)
    return data


# The same left-to-right, non-overlapping removal as `bytes.replace`, faster where model output
# has them (750 "**" in a step's 150 KB: 86 us against 236) and slower where a text is little
# else (1 MB of "_**_": 28 ms against 2.8; still linear).
_DOUBLE_STAR, _DOUBLE_UNDERSCORE = re.compile(rb"\*\*"), re.compile(rb"__")


def _fields_beyond_latin1(joined: str, data: bytes) -> list[int]:
    """Which NUL-separated fields of ``joined`` hold a character beyond Latin-1, from its
    Latin-1 encoding ``data`` with each such character replaced by ``?``."""
    codes = np.frombuffer(data, np.uint8)
    # The "replace" error handler writes one "?" for each character it cannot encode (a lone
    # surrogate included), so data's offsets are joined's. A "?" of data is one of joined's
    # own, or stands for a wider character: told one by one where there are few (model
    # output), and from the code points themselves where there are many (a text of "?").
    marks = np.flatnonzero(codes == ord("?"))
    if len(marks) <= _FEW_MARKS:
        at = [i for i in marks.tolist() if joined[i] != "?"]
    else:
        wide = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
        at = np.flatnonzero(wide > 0xFF).tolist()
    fields = np.searchsorted(np.flatnonzero(codes == 0), at)  # separators before each
    return sorted(set(fields.tolist()))


#: Up to this many "?" in a step's fields, each is looked up in the text (0.1 us each); past it,
#: the text is encoded four bytes a character (~0.2 ms for a step's 130k characters).
_FEW_MARKS = 256


#: Flags of a character for :func:`field_texts`: ``*``, ``_``, the space or the separator (two
#: side by side, or one at an end, need folding), other whitespace (always folded).
_STAR, _UNDERSCORE, _SPACED, _OTHER_SPACE = 1, 2, 4, 8

#: ``bytes.translate`` tables for a Latin-1 text: each character's flags, and whitespace (per
#: ``str.isspace``, where ``str.split()`` splits) made a space.
_LATIN1_FLAGS = bytes(
    {"*": _STAR, "_": _UNDERSCORE, " ": _SPACED, _SEP: _SPACED}.get(c, _OTHER_SPACE * c.isspace())
    for c in map(chr, range(256))
)
_LATIN1_TO_SPACE = bytes(ord(" ") if chr(c).isspace() else c for c in range(256))


def _untidy(text: bytes) -> int:
    """What cleaning the NUL-separated fields of a Latin-1 ``text`` has to do: ``_STAR`` or
    ``_UNDERSCORE`` when one holds a ``**`` or a ``__``, ``_SPACED`` when one holds whitespace
    other than single spaces inside it; 0 when each is its own field text. (A pair of adjacent
    separators, an empty field, also reads as ``_SPACED``: folding then runs, which is always
    right.)"""
    flags = text.translate(_LATIN1_FLAGS)
    if not flags:
        return 0
    codes = np.frombuffer(flags, np.uint8)
    pairs = codes[:-1] & codes[1:]
    untidy = int(np.bitwise_or.reduce(pairs)) if pairs.any() else 0
    if bytes((_OTHER_SPACE,)) in flags or (codes[0] | codes[-1]) & _SPACED:
        untidy |= _SPACED
    return untidy & (_STAR | _UNDERSCORE | _SPACED)


def _fold_runs(text: bytes) -> str:
    """A Latin-1 ``text`` with each run of whitespace made one space: what
    ``" ".join(field.split())`` makes of every field, but for a space left at either end.

    >>> _fold_runs("a \\t\\n b\\x85\\xa0c\\x00 d ".encode("latin-1"))
    'a b c\\x00 d '
    """
    if not text:
        return ""
    codes = np.frombuffer(text.translate(_LATIN1_TO_SPACE), np.uint8)
    space = codes == ord(" ")
    # Every whitespace character is a space now; a space goes when the one before it is a
    # space too, so each run keeps one (in place: a step's text is 130 KB, and each temporary
    # array that size is one more allocation to fault in).
    dropped = np.empty(len(codes), bool)
    dropped[0] = False
    np.logical_and(space[1:], space[:-1], out=dropped[1:])
    return str(codes[np.logical_not(dropped, out=dropped)].data, "latin-1")


def _folded(text: str) -> bool:
    """Whether ``" ".join(text.split()) == text`` already, told without building the words.

    Every ``str.isspace`` character but the ASCII space is non-printable (checked over all of
    Unicode in ``tests/test_text.py``), so a printable text's only whitespace is spaces, and it
    is folded when no two are adjacent and none is at an end. These are C scans; splitting and
    joining a reasoning text of 100 words costs ten times more.

    >>> _folded("a b"), _folded("a  b"), _folded(" a"), _folded("a\\tb"), _folded("")
    (True, False, False, False, True)
    """
    return text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " "


# A run of non-ASCII characters with the ASCII character before it, if any (it may compose with
# the run: "e" + U+0301 is "é", ">" + U+0338 is "≯"). NFKC never changes ASCII characters and
# no ASCII character composes with what precedes it, so text can be cut before every ASCII
# character: NFKC of the whole is the NFKC of the pieces, joined.
_NON_ASCII_RUN = re.compile(r"[\x00-\x7f]?[^\x00-\x7f]+")
_PUNCTUATION_TABLE = str.maketrans(dict(_PUNCTUATION))


@dataclass(frozen=True)
class OffsetMap:
    """Offsets in ``preprocess(text)`` mapped back to offsets in ``text`` (code points).

    Preprocessing keeps most characters in place; a piece NFKC changes in length (a ligature
    ``ﬁ`` → ``fi``, ``e`` + combining accent → ``é``) is a *segment*: any offset inside its
    output maps to the whole input piece. ``segments`` holds ``(pre_start, pre_end,
    orig_start, orig_end)`` in order; elsewhere offsets shift by the segments before them.
    """

    segments: tuple[tuple[int, int, int, int], ...] = ()
    _pre_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pre_starts", tuple(s[0] for s in self.segments))

    def start(self, pre: int) -> int:
        """Where the character at preprocessed offset ``pre`` comes from (its first char)."""
        i = bisect_right(self._pre_starts, pre) - 1
        if i < 0:
            return pre
        _, pre_end, orig_start, orig_end = self.segments[i]
        return orig_start if pre < pre_end else orig_end + (pre - pre_end)

    def end(self, pre: int) -> int:
        """The original offset just after the characters before preprocessed offset ``pre``."""
        i = bisect_left(self._pre_starts, pre) - 1
        if i < 0:
            return pre
        _, pre_end, _, orig_end = self.segments[i]
        return orig_end if pre <= pre_end else orig_end + (pre - pre_end)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the preprocessed span ``[start, end)``."""
        if end <= start:
            origin = self.start(start)
            return origin, origin
        return self.start(start), self.end(end)


def _pieces(text: str) -> list[str]:
    """``text`` cut where NFKC of the whole is NFKC of the pieces joined: before every
    character that neither is a non-starter (a combining mark, or one decomposing into marks
    first) nor composes with what precedes it (Hangul jamo do). Checked pairwise here;
    :func:`preprocess_with_offsets` checks the whole.

    Pieces are kept as start offsets (a piece grown a character at a time would be copied at
    each one: quadratic in a run of a million combining marks); only a character that is not
    a combining mark reads its piece so far, which then usually ends.

    >>> [len(piece) for piece in _pieces("e\\u0301x\\u1100\\u1161")]  # é, x, then 가 (jamo)
    [2, 1, 2]
    """
    starts: list[int] = []
    non_starters = _non_starters()
    for i, char in enumerate(text):
        if starts and (char in non_starters or _composes(text[starts[-1] : i], char)):
            continue
        starts.append(i)
    return [text[a:b] for a, b in pairwise([*starts, len(text)])]


def _composes(piece: str, char: str) -> bool:
    """Whether NFKC of ``piece + char`` differs from NFKC of each, joined."""
    return nfkc(piece + char) != nfkc(piece) + nfkc(char)


def preprocess_with_offsets(text: str) -> tuple[str, OffsetMap]:
    """:func:`preprocess` and the map from its offsets back to ``text``'s (for explanations).

    >>> pre, offsets = preprocess_with_offsets("\ufb01 <a>")  # the ligature "ﬁ" becomes "fi"
    >>> pre, pre.index("<"), offsets.start(pre.index("<")), offsets.span(0, 2)
    ('fi <a>', 3, 2, (0, 1))
    """
    if text.isascii():
        return text, OffsetMap()
    parts: list[str] = []
    segments: list[tuple[int, int, int, int]] = []
    pos = 0  # next unread offset of text
    shift = 0  # len(preprocessed so far) - pos
    for run in _NON_ASCII_RUN.finditer(text):
        parts.append(text[pos : run.start()])
        piece = run.group(0).translate(_PUNCTUATION_TABLE)
        out = nfkc(piece)
        pre_at = run.start() + shift
        if out != piece:
            clusters = _pieces(piece)
            outs = [nfkc(c) for c in clusters]
            if "".join(outs) == out:
                orig_at = run.start()
                for cluster, cluster_out in zip(clusters, outs, strict=True):
                    if cluster_out != cluster and (len(cluster) > 1 or len(cluster_out) != 1):
                        segments.append(
                            (pre_at, pre_at + len(cluster_out), orig_at, orig_at + len(cluster))
                        )
                    pre_at += len(cluster_out)
                    orig_at += len(cluster)
            else:  # never seen; should the pairwise check miss a case, the run is one segment
                segments.append((pre_at, pre_at + len(out), run.start(), run.end()))
        parts.append(out)
        shift += len(out) - len(piece)
        pos = run.end()
    parts.append(text[pos:])
    return "".join(parts), OffsetMap(tuple(segments))
