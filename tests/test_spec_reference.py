"""The core against a second, independent reading of SPEC §1-5 (``tests/spec_reference.py``),
on random batches of well-formed and broken completions and on answer and tag probes.

Every number and flag of a scored batch is compared: the items' fields, the components, the
normalized components with their means and deviations, the rewards and the advantages. A
``Uniq`` whose walk met a cosine within 2e-4 of ``δ`` is the one place SPEC §3 lets two
implementations differ; such batches are compared but for ``Uniq`` and what follows from it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from reward_server.core import RECIPES, RewardParams, ScoreItem, score_batch
from reward_server.core import components as core_components
from tests import spec_reference as ref


def _close(a: float, b: float, absolute: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=absolute)


def differences(batch: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Where the core's score of ``batch`` (:func:`~tests.spec_reference.random_batch`'s
    fields) and the reference's differ, as ``(item or key, field, core's, reference's)``; a
    last entry ``("near δ",)`` when a ``Uniq`` walk met a cosine near ``δ`` (then only what
    does not follow from ``Uniq`` is compared)."""
    encoder = ref.ClusterEncoder(batch["params"].get("similarity_threshold", 0.8))
    core = score_batch(
        [ScoreItem(**item) for item in batch["items"]],
        encoder,
        recipe=batch["recipe"],
        answer_type=batch["answer_type"],
        params=RewardParams(**batch["params"]),
        normalize=batch["normalize"],
        diagnostics=batch["diagnostics"],
    )
    reading = ref.score(
        batch["items"],
        encoder,
        batch["recipe"],
        batch["answer_type"],
        batch["params"],
        batch["normalize"],
    )
    found: list[tuple[Any, ...]] = []
    for i, (ours, theirs) in enumerate(zip(core.items, reading.items, strict=True)):
        for name in ("n_strat", "final_answer", "correct", "strategy_correct"):
            if getattr(ours, name) != getattr(theirs, name):
                found.append((i, name, getattr(ours, name), getattr(theirs, name)))
        if batch["diagnostics"] and theirs.n_strat and (ours.uniq is None or ours.div is None):
            found.append((i, "uniq/div missing under diagnostics", ours.uniq, ours.div))
        if ours.uniq is not None and ours.uniq != theirs.uniq and not theirs.near:
            found.append((i, "uniq", ours.uniq, theirs.uniq))
        if ours.div is not None and not _close(ours.div, theirs.div):
            found.append((i, "div", ours.div, theirs.div))
    if list(core.components) != list(reading.components):
        return [*found, ("components", list(core.components), list(reading.components))]
    if any(theirs.near for theirs in reading.items):
        return [*found, ("near δ",)]  # Uniq may differ, and each number that follows from it
    for k in reading.components:
        for i, (a, b) in enumerate(zip(core.components[k], reading.components[k], strict=True)):
            if not _close(a, b, 1e-12):
                found.append((i, f"components.{k}", a, b))
        normalized = core.aggregate.normalized[k]
        for i, (a, b) in enumerate(zip(normalized, reading.normalized[k], strict=True)):
            if not _close(a, b):
                found.append((i, f"normalized.{k}", a, b))
        if not _close(core.aggregate.mean[k], reading.mean[k], 1e-12):
            found.append((k, "mean", core.aggregate.mean[k], reading.mean[k]))
        if not _close(core.aggregate.std[k], reading.std[k], 1e-12):
            found.append((k, "std", core.aggregate.std[k], reading.std[k]))
    for i, (a, b) in enumerate(zip(core.rewards, reading.rewards, strict=True)):
        if not _close(a, b):
            found.append((i, "reward", a, b))
    ours_adv, theirs_adv = core.aggregate.advantages, reading.advantages
    if (ours_adv is None) != (theirs_adv is None):
        found.append(("advantages", "present", ours_adv is not None, theirs_adv is not None))
    elif ours_adv is not None and theirs_adv is not None:
        for i, (a, b) in enumerate(zip(ours_adv, theirs_adv, strict=True)):
            if not _close(a, b, 1e-6):
                found.append((i, "advantage", a, b))
    return found


def test_the_reference_reads_every_recipe_as_the_core_does() -> None:
    assert set(ref.RECIPES) == set(RECIPES)
    for name, components in ref.RECIPES.items():
        assert set(RECIPES[name].components) == set(components)
    defaults = RewardParams()
    for key, value in ref.DEFAULTS.items():
        assert getattr(defaults, key) == value, key


@pytest.mark.parametrize("block", range(8))
def test_random_batches_score_as_the_spec_reads(block: int) -> None:
    """80 random batches a block: all recipes, matchers but ``math``, parameters, groups."""
    failures, near = {}, 0
    for seed in range(block * 80, (block + 1) * 80):
        found = differences(ref.random_batch(seed))
        if found[-1:] == [("near δ",)]:
            near += 1
            found.pop()
        if found:
            failures[seed] = found[:3]
    assert not failures, failures
    assert near < 16  # most batches are compared whole


def _probe(answer_type: str, gold: str, completions: list[str], **params: Any) -> dict[str, Any]:
    return {
        "items": [{"completion": c, "answer": gold} for c in completions],
        "recipe": "sde2",
        "answer_type": answer_type,
        "params": params,
        "normalize": False,
        "diagnostics": True,
    }


@pytest.mark.parametrize("answer_type", ["numeric", "choice", "exact"])
def test_every_answer_form_against_every_gold(answer_type: str) -> None:
    """Each form as a final answer and as a bare completion, against each form as gold."""
    forms = ref.ANSWERS[answer_type]
    completions = [f"<final_answer>{form}</final_answer>" for form in forms] + forms
    failures = {
        gold: found[:3]
        for gold in forms
        if (found := differences(_probe(answer_type, gold, completions)))
    }
    assert not failures, failures


def _block(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
    )


TAG_PROBES = [
    "<strategy><reasoning>r1<reasoning>r2</reasoning><strategy_outcome>5</strategy_outcome></strategy>",
    "<strategy><reasoning>r1</reasoning><reasoning>r2</reasoning><strategy_outcome>5</strategy_outcome></strategy>",
    "<strategy><reasoning>r1</strategy><strategy_outcome>5</strategy_outcome></strategy>",
    "<strategy x><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></strategy >",
    "<strategy\x1cx><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></strategy\x85>",
    "<strategy\u2028><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></strategy\u2029>",
    "<strategy\u200b><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></strategy>",
    "<\u017ftrategy><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></\u017ftrategy>",
    "<\uff33TRATEGY><reasoning>r1</reasoning><strategy_outcome>5</strategy_outcome></strategy>",
    _block("r1", "5") + "</strategy>" + _block("r2", "6")[:-11],
    "<strategy>" + _block("r1", "5"),
    "<strategy><reasoning>r1</reasoning><strategy_outcome><final_answer>7</final_answer>5"
    "</strategy_outcome></strategy>",
    "<final_answer>x<final_answer>y</final_answer>",
    "<final_answer>3</final_answer><final_answer>  </final_answer><answer>4</answer>",
    "<final_answer>**</final_answer><answer>4</answer><answer></answer>",
    "<final_answer>3</final_answer><final_answer>4",
    "<final_answer>3</final_answer></final_answer><final_answer>4</final_answer>",
    "<final_answer id=1>5</final_answer\t>",
    "<final_answer/>5</final_answer>",
    "<final_answer >5</ final_answer>",
    "<answer>1</answer>" + _block("r", "5"),
    _block("```python", "5") + _block("```3", "5") + _block("*_*", "5") + _block("_**_", "5"),
    _block("\u200b", "5") + _block("\x1c", "5") + _block("\u00a8", "5"),
    _block("\u2033\u2034", "\u201c5\u201d"),
    _block("a", "5") * 40,
    "".join(_block(f"r{i}", str(i)) for i in range(300)),
    "".join(_block(f"r{i % 3}", str(i % 3)) for i in range(300)) + "<final_answer>5</final_answer>",
    _block("r", "5").replace("<", "\ufe64"),
    *("a\u00a8b c", "a\u00a0b", "", " ", "<final_answer>5</final_answer>\r\n"),
    _block("r", "5") + _block("r", "4"),
    _block("base 0", "1") + _block("anti 0", "2"),
    _block("base 0", "1") + _block("base 0", "2") + _block("base 0", "3"),
    _block("base 0", "1") + _block("ndup 0 1 +", "2") + _block("ndup 0 2 -", "3"),
]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("max_strategies", [1, 2, 32, 256])
def test_tag_probes(recipe: str, max_strategies: int) -> None:
    """Tags spaced, cased, nested, unclosed or look-alike; fields cleaned to nothing; caps."""
    for tokens in (None, 0, 3, 5000):
        batch = _probe("numeric", "5", TAG_PROBES, max_strategies=max_strategies, length_target=2)
        batch["recipe"] = recipe
        for item in batch["items"]:
            item["num_tokens"] = tokens
        assert differences(batch) == []


def test_a_wrong_core_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a core whose ``sd`` counts strategies (``rd``'s formula)
    instead of ``g(H)`` differs on random batches."""
    sd = core_components.COMPONENTS["sd"]
    rd = core_components.COMPONENTS["rd"]
    monkeypatch.setitem(core_components.COMPONENTS, "sd", replace(sd, value=rd.value))
    wrong = [seed for seed in range(40) if differences(ref.random_batch(seed))]
    assert len(wrong) >= 5, wrong
