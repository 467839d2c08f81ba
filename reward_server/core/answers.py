"""Answer canonicalization ``N(·)`` and the matchers of SPEC §2.

Predictions and gold answers go through the same ``N``; two answers match iff their canonical
forms are equal. A matcher is chosen per request by ``answer_type``.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from reward_server.core.params import AnswerType
from reward_server.core.text import field_text

#: A canonical numeric answer: an exact rational, or a string when there is no usable number.
Canonical = Fraction | str
#: ``(prediction, gold) -> equivalent?`` for ``answer_type = "math"``. The service and the
#: offline scorer pass one that runs each check in a killable process
#: (:mod:`reward_server.math_judge`); :func:`math_equivalent` is the in-process default.
MathJudge = Callable[[str, str], bool]

_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
# Longest first, so that `\textbf` is not read as `\text` + "bf".
_LATEX_WORDS = re.compile(r"\\(?:textbf|text|boxed|mathrm|left|right)")
_DROP_CHARS = re.compile("[{}$€£¥%]")
_DIGIT_COMMA = re.compile(r"(?<=[0-9]),(?=[0-9])")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?")
_MAX_DIGITS = 1000


def gold_text(value: object) -> str:
    """The gold answer text of a dataset's value: a string as it is, a number in plain decimal.

    A float keeps its shortest round-trip digits with no exponent: ``N`` reads the last number
    of a text, so ``str(1e-05)`` would be the gold -5 and ``str(2e16)`` the gold 16. A missing
    value (``None``), a non-finite number or any other type is a :class:`ValueError`, never a
    gold such as ``"None"`` that no answer matches.

    >>> [gold_text(x) for x in ("#### 18", 18, 18.0, -0.5, 1e20, 1e-07)]
    ['#### 18', '18', '18.0', '-0.5', '100000000000000000000', '0.0000001']
    >>> import numpy as np
    >>> gold_text(np.float32(0.1)), gold_text(np.float32(1e-05)), gold_text(np.int64(7))
    ('0.1', '0.00001', '7')
    >>> gold_text(None)
    Traceback (most recent call last):
    ...
    ValueError: the gold answer is missing (None)
    """
    if isinstance(value, str):
        return value
    if value is None:
        raise ValueError("the gold answer is missing (None)")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a gold answer is a string or a number, not {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the gold answer is not a finite number ({number})")
    try:  # the value's own shortest digits (a numpy float32 widened to a double has more)
        return format(Decimal(str(value)), "f")
    except InvalidOperation:  # a number whose text is no decimal (a Fraction's "1/3")
        return format(Decimal(repr(number)), "f")


def _strip_latex(text: str) -> str:
    """Step 2 of numeric ``N``: fractions to ``a/b``, LaTeX words and currency marks removed."""
    text = _FRAC.sub(r"\1/\2", text)
    text = _DROP_CHARS.sub("", _LATEX_WORDS.sub("", text))
    return _DIGIT_COMMA.sub("", text)


def _canonical_number(number: str) -> Canonical:
    """Step 4 of numeric ``N``: strip redundant zeros, then read the exact rational."""
    negative = number.startswith("-")
    numerator, _, denominator = number.lstrip("-").partition("/")
    integer, _, decimals = numerator.partition(".")
    integer, decimals = integer.lstrip("0") or "0", decimals.rstrip("0")
    text = integer + ("." + decimals if decimals else "")
    if denominator:
        denominator = denominator.lstrip("0") or "0"
        text += "/" + denominator
    text = ("-" if negative else "") + text
    if denominator == "0" or sum(c.isdigit() for c in text) > _MAX_DIGITS:
        return text
    # Built from the canonical digits, so it stays within Python's int-conversion limit.
    value = Fraction(int(integer + decimals), 10 ** len(decimals))
    if denominator:
        value /= int(denominator)
    return -value if negative else value


def canonical_numeric(text: str) -> Canonical:
    """``N`` for ``answer_type = "numeric"`` (GSM8K, AIME).

    >>> canonical_numeric("$1,000.00") == canonical_numeric("1000")
    True
    >>> canonical_numeric("3/4") == canonical_numeric("0.75")
    True
    >>> canonical_numeric("\\\\boxed{18}"), canonical_numeric("17 or 18")
    (Fraction(18, 1), Fraction(18, 1))
    >>> canonical_numeric("The answer is Paris.")
    'the answer is paris'
    """
    if text.isdigit() and text.isascii() and len(text) <= _MAX_DIGITS:
        # A plain integer (most outcomes): what the steps below give, without their scans.
        return Fraction(int(text))
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = _strip_latex(text)
    last = None
    for last in _NUMBER.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    if last is None:
        return field_text(text).lower().rstrip(". ")
    return _canonical_number(last.group(0))


def whole_number_digits(gold: str) -> str | None:
    """The digits a prediction's digits must equal for it to match ``gold`` numerically (those
    of ``N(gold)`` when it is a whole number, with its sign), else ``None``.

    With :func:`plain_whole_numbers`, a batch of predictions in plain digits is matched by
    string comparisons, with no matcher call per prediction.

    >>> whole_number_digits("#### 1,000.00"), whole_number_digits("-7"), whole_number_digits("0.5")
    ('1000', '-7', None)
    """
    whole = _whole_number(canonical_numeric(gold))
    return None if whole is None else str(whole)


def _whole_number(value: Canonical) -> int | None:
    """The integer a canonical numeric answer is, when it is a whole number."""
    return value.numerator if type(value) is Fraction and value.denominator == 1 else None


#: In :func:`plain_whole_numbers`'s joined text: a text starting with a redundant zero.
_LEADING_ZERO = re.compile("\n0[0-9]")


def plain_whole_numbers(texts: list[str]) -> list[str] | None:
    """Each text's digits when every text is a whole number written in plain digits (ASCII,
    no redundant leading zero), perhaps grouped by commas between digits (``850,000``), as
    most outcomes and final answers of numeric tasks are; else ``None``. ``texts`` itself
    when none holds a comma.

    Such a text canonicalizes to ``Fraction(int(d))`` of its digits ``d`` (``N`` drops a
    comma between digits), and ``int(d)`` is written ``d``, so it matches a gold iff
    ``d == whole_number_digits(gold)`` (a gold that is not a whole number, ``None``, matches
    none of them). One scan of the texts joined, not one call each.

    >>> plain_whole_numbers(["18", "0", "850,000"]), plain_whole_numbers(["18", "018"])
    (['18', '0', '850000'], None)
    >>> [plain_whole_numbers([t]) for t in ("1,,000", "1,", "-3", "1 2", "1.0", "\uff11")]
    [None, None, None, None, None, None]
    """
    joined = "\n".join(texts)
    if not (all(texts) and joined.count("\n") == len(texts) - 1 and joined.isascii()):
        return None  # an empty text, a line break inside one, or a character beyond ASCII
    commas = "," in joined
    if commas:
        ends = joined[0] + joined[-1]
        if ",," in joined or "\n," in joined or ",\n" in joined or "," in ends:
            return None  # a comma that is not between two digits of one text
        joined = joined.replace(",", "")
    if not joined.replace("\n", "").isdigit() or _LEADING_ZERO.search("\n" + joined):
        return None
    return joined.split("\n") if commas else texts


# Option-letter patterns of the `choice` matcher, in priority order.
_CHOICE_PATTERNS = (
    re.compile(r"\(([A-E])\)"),
    re.compile(r"\b([A-E])\)"),
    re.compile(r"\b([A-E])\."),
    re.compile(r"\b([A-E]):"),
    re.compile(r"[oO][pP][tT][iI][oO][nN] ([a-eA-E])\b"),
    re.compile(r"[aA][nN][sS][wW][eE][rR] [iI][sS] ([a-eA-E])\b"),
)


def canonical_choice(text: str) -> str | None:
    """``N`` for ``answer_type = "choice"`` (MedMCQA): an option letter A–E, or ``None``.

    >>> canonical_choice("I pick (C) because B) is wrong"), canonical_choice("the answer is b")
    ('C', 'B')
    >>> canonical_choice(" d "), canonical_choice("none")
    ('D', None)
    """
    text = field_text(text)
    for pattern in _CHOICE_PATTERNS:
        match = pattern.search(text)
        if match:
            return match.group(1).upper()
    if len(text) == 1 and text in "abcdeABCDE":
        return text.upper()
    return None


def unmatchable_gold(answer_type: AnswerType, gold: str) -> str | None:
    """Why ``gold`` (preprocessed) cannot serve as a gold answer, or ``None`` when it can.

    An empty gold (no field text, SPEC §1), or a numeric one with nothing left once
    canonicalized (``"$"``, ``"\\boxed{}"``, a bare ``"####"``), has no answer to match (it would
    equal only a final answer of ``"."``), and a ``choice`` gold without an option letter is
    never matched (SPEC §2). SPEC defines their rewards, so such golds are scored, but they turn
    their items' rewards into format rewards: the batch carries a warning that says why
    (:func:`~reward_server.core.scoring.gold_warnings`).

    >>> unmatchable_gold("numeric", " ** "), unmatchable_gold("choice", "(B)")
    ('the gold answer is empty', None)
    >>> unmatchable_gold("numeric", "$"), unmatchable_gold("numeric", "$5")
    ("the gold answer '$' is empty once canonicalized (SPEC §2)", None)
    >>> unmatchable_gold("choice", "1")
    "answer_type 'choice' needs a gold option letter A-E, got '1' (MedMCQA's cop is 0-3: 0 is A)"

    A numeric gold is judged by its ``N`` alone: its number is found in the text before field
    cleaning (SPEC §2 steps 1-3), so ``"```js2"``, whose field text is empty (a fence marker and
    its language word), is the number 2:

    >>> unmatchable_gold("numeric", "```js2"), unmatchable_gold("exact", "```js2")
    (None, 'the gold answer is empty')
    """
    if answer_type == "numeric" and canonical_numeric(gold) != "":
        return None  # a number, or a text with something left to compare
    if not field_text(gold):
        return "the gold answer is empty"
    shown = gold if len(gold) <= 40 else gold[:40] + "..."
    if answer_type == "numeric":
        return f"the gold answer {shown!r} is empty once canonicalized (SPEC §2)"
    if answer_type == "choice" and canonical_choice(gold) is None:
        return (
            f"answer_type 'choice' needs a gold option letter A-E, got {shown!r} "
            "(MedMCQA's cop is 0-3: 0 is A)"
        )
    return None


def canonical_exact(text: str) -> str:
    """``N`` for ``answer_type = "exact"``: the lower-cased field text."""
    return field_text(text).lower()


def math_equivalent(prediction: str, gold: str) -> bool:
    r"""``answer_type = "math"``: equivalence by ``math-verify`` (optional extra), gold first.

    In process and unbounded off the main thread: for untrusted model output use the isolated
    judge of :mod:`reward_server.math_judge`, which runs this in a process it can kill.

    Whatever its length (SPEC §2 sets no limit; the isolated judge bounds the time):

    >>> long = "After simplifying " + "carefully and checking every step, " * 7
    >>> math_equivalent(long + "the result is $\\frac{1}{2}$", "$\\frac{1}{2}$")
    True

    A LaTeX text in which ``math-verify`` finds nothing is read again as one formula: MATH's
    golds and most final answers are bare LaTeX (``\frac{\sqrt{3}}{2}``), which it only
    reads between delimiters (every such answer was judged wrong). Only a text holding LaTeX's
    marks (``\ ^ _ {``): read as a formula, letters are a product of symbols, and "CBA"
    would equal "ABC".

    >>> math_equivalent("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}")
    True
    >>> math_equivalent("32", "\\frac{\\sqrt{3}}{2}"), math_equivalent("CBA", "ABC")
    (False, False)
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "answer_type 'math' needs the optional extra: pip install sde2[math]"
        ) from exc
    # Its signal-based timeouts only work on the main thread; elsewhere they must be disabled.
    on_main = threading.current_thread() is threading.main_thread()
    timeout = {} if on_main else {"parsing_timeout": None}
    verify_timeout = {} if on_main else {"timeout_seconds": None}

    def read(text: str) -> list[Any]:
        found = parse(text, **timeout)
        if found or _LATEX_MARK.search(text) is None:
            return list(found)
        return list(parse(f"${text}$", **timeout))

    return bool(verify(read(gold), read(prediction), **verify_timeout))


#: What tells bare LaTeX from words: a command, a script, a group.
_LATEX_MARK = re.compile(r"[\\^_{]")


def math_available() -> bool:
    """Whether the ``math`` matcher can run (its optional extra is installed)."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def make_matcher(
    answer_type: AnswerType, gold: str, math_judge: MathJudge = math_equivalent
) -> Callable[[str], bool]:
    """A predicate telling whether a predicted answer text matches ``gold`` (both preprocessed).

    The gold side is canonicalized once, since one completion asks it for every strategy.
    ``math_judge`` decides ``answer_type = "math"``.

    >>> matches = make_matcher("numeric", "#### 72")
    >>> matches("72.0"), matches("73")
    (True, False)
    """
    if answer_type == "numeric":
        gold_numeric = canonical_numeric(gold)
        gold_int = _whole_number(gold_numeric)

        def numeric(prediction: str) -> bool:
            # A plain integer (most outcomes) canonicalizes to Fraction(int(prediction)), which
            # equals the gold iff the gold is that whole number: no Fraction is built.
            if prediction.isdigit() and prediction.isascii() and len(prediction) <= _MAX_DIGITS:
                return int(prediction) == gold_int
            return _same(canonical_numeric(prediction), gold_numeric)

        return numeric
    if answer_type == "choice":
        gold_letter = canonical_choice(gold)
        return lambda prediction: (
            gold_letter is not None and canonical_choice(prediction) == gold_letter
        )
    if answer_type == "exact":
        gold_exact = canonical_exact(gold)
        return lambda prediction: canonical_exact(prediction) == gold_exact
    if answer_type == "math":
        return lambda prediction: math_judge(prediction, gold)
    raise ValueError(f"unknown answer_type {answer_type!r}")


def _same(a: Canonical, b: Canonical) -> bool:
    # A rational never equals a string, even "3" vs Fraction(3).
    return type(a) is type(b) and a == b
