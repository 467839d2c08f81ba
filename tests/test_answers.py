"""SPEC §2: numeric canonicalization step by step, and the choice, exact and math matchers."""

from __future__ import annotations

from fractions import Fraction

import pytest

from reward_server.core.answers import (
    canonical_choice,
    canonical_exact,
    canonical_numeric,
    gold_text,
    make_matcher,
    math_available,
    unmatchable_gold,
)
from reward_server.core.text import preprocess


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,000.00", Fraction(1000)),
        ("1,234,567", Fraction(1234567)),
        ("3/4", Fraction(3, 4)),
        ("0.75", Fraction(3, 4)),
        ("\\boxed{18}", Fraction(18)),
        ("17 or 18", Fraction(18)),  # the LAST number
        ("Natalia sold 48/2 = 24 clips.\n#### 72", Fraction(72)),
        ("#### 5 #### 6", Fraction(6)),  # after the last ####
        ("18.00", Fraction(18)),
        ("018", Fraction(18)),
        ("-0", Fraction(0)),
        ("-0.50", Fraction(-1, 2)),
        ("007.50", Fraction(15, 2)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{1}{2}", Fraction(1, 2)),
        ("\\tfrac{10}{4}", Fraction(5, 2)),
        ("\\frac{\\text{a}}{2}", Fraction(2)),  # braces inside: not replaced; then 2 is last
        ("\\text{18 dollars}", Fraction(18)),
        ("\\textbf{5}", Fraction(5)),
        ("\\left(3\\right)", Fraction(3)),
        ("50%", Fraction(50)),
        ("€12", Fraction(12)),
        ("1, 2", Fraction(2)),  # comma not between digits stays, two numbers
        ("1e5", Fraction(5)),  # no exponent syntax: last match is 5
        ("3/04", Fraction(3, 4)),
        ("1.50/2", Fraction(3, 4)),
        ("x-3", Fraction(-3)),
        ("\u0663", "\u0663"),  # Arabic-Indic digit is not an ASCII digit -> string
    ],
)
def test_canonical_numeric(text: str, expected: Fraction | str) -> None:
    assert canonical_numeric(text) == expected
    assert type(canonical_numeric(text)) is type(expected)


def test_zero_denominator_and_huge_numbers_stay_text() -> None:
    assert canonical_numeric("1/0") == "1/0"
    assert canonical_numeric("5/000") == "5/0"
    assert canonical_numeric("-007/0") == "-7/0"
    huge = "9" * 1001
    assert canonical_numeric(huge) == huge
    assert canonical_numeric("0" * 5000 + "1") == Fraction(1)  # leading zeros are removed first
    assert canonical_numeric("9" * 1000) == Fraction(int("9" * 1000))


def test_no_number_is_a_lower_cased_string() -> None:
    assert canonical_numeric("  The Answer is **Paris**. ") == "the answer is paris"
    assert canonical_numeric("$ Yes. . ") == "yes"


def test_numeric_matching() -> None:
    matches = make_matcher("numeric", preprocess("#### 1000"))
    assert matches("$1,000.00")
    assert matches("It is 1000.")
    assert not matches("1000.5")
    rational_vs_text = make_matcher("numeric", "paris")
    assert rational_vs_text("Paris.")
    assert not rational_vs_text("3")
    assert make_matcher("numeric", "1/0")("1/0")
    assert not make_matcher("numeric", "1/0")("0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(C)", "C"),
        ("I pick (C) because B) is wrong", "C"),  # (X) has priority over X)
        ("B) then (x)", "B"),
        ("A. is wrong, D) right", "D"),  # X) before X.
        ("E: yes", "E"),
        ("AB) no", None),  # no word boundary before B
        ("The option c is best", "C"),
        ("OPTION b", "B"),
        ("the answer is d", "D"),
        ("the answer is dog", None),  # letter not followed by a word boundary
        ("b", "B"),
        (" e ", "E"),
        ("f", None),
        ("F)", None),
        ("**C**", "C"),  # field text: emphasis removed, single letter
    ],
)
def test_canonical_choice(text: str, expected: str | None) -> None:
    assert canonical_choice(text) == expected


def test_choice_matching_needs_a_letter_on_both_sides() -> None:
    assert make_matcher("choice", "C")("Answer: (C)")
    assert not make_matcher("choice", "C")("(B)")
    assert not make_matcher("choice", "none")("none")


def test_exact_matching() -> None:
    assert canonical_exact("  Mitral  **Valve** ") == "mitral valve"
    assert make_matcher("exact", "Mitral valve")("mitral   VALVE")
    assert not make_matcher("exact", "mitral valve")("mitral valve.")


@pytest.mark.skipif(not math_available(), reason="math extra not installed")
def test_math_matching() -> None:
    matches = make_matcher("math", "$\\frac{1}{2}$")
    assert matches("$0.5$")
    assert not matches("$0.4$")


def test_math_extra_is_installed_in_the_dev_environment() -> None:
    # `make test` installs the math extra; this guards against the test above silently skipping.
    assert math_available()


def test_math_matching_off_the_main_thread() -> None:
    import threading

    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(make_matcher("math", "$2$")("$\\sqrt{4}$")))
    t.start()
    t.join()
    assert results == [True]


@pytest.mark.parametrize("value", [True, False, [18], b"18"])
def test_gold_text_refuses_a_bool_or_a_non_number(value: object) -> None:
    """A dataset column of booleans or lists is a mistake, not a gold: ``True`` is no "1" (it
    would match every answer 1), and a list is no gold text at all."""
    with pytest.raises(ValueError, match="a string or a number"):
        gold_text(value)


def test_a_long_unmatchable_gold_is_named_shortened() -> None:
    """The warning for a long unmatchable gold quotes its first 40 characters, so a whole
    question pasted in the answer column makes a readable warning, not an error."""
    gold = "none of the options listed here is right at all"
    problem = unmatchable_gold("choice", gold)
    assert problem is not None and repr(gold[:40] + "...") in problem


def test_an_unknown_answer_type_is_refused() -> None:
    """``answer_type`` selects the matcher (SPEC §2): an unknown one is an error, never
    silently another matcher (such as ``math``)."""
    with pytest.raises(ValueError, match="unknown answer_type"):
        make_matcher("fuzzy", "1")  # type: ignore[arg-type]
