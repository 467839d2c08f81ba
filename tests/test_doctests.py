"""The examples in the docstrings run and give what they show (one test per module)."""

from __future__ import annotations

import doctest
import importlib
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts)
    for package in ("reward_server", "trainer_client", "benchmarks")
    for path in (REPO / package).rglob("*.py")
    if "_generated" not in path.parts and ">>> " in path.read_text(encoding="utf-8")
)


def test_the_examples_are_found() -> None:
    assert "reward_server.core.parsing" in MODULES and len(MODULES) >= 8


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        # An example written in a plain docstring loses a backslash: "\\frac" there runs as
        # "\frac", a form feed and "rac", and the example no longer shows what it says.
        warnings.filterwarnings("error", "invalid escape sequence", DeprecationWarning)
        warnings.filterwarnings("error", "invalid escape sequence", SyntaxWarning)
        result = doctest.testmod(
            module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
    assert result.attempted > 0, f"{name} has '>>> ' but no example ran"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
