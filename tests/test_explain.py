"""The explanation of a reward (:mod:`reward_server.core.explain`) tells the truth.

* its numbers are the scorer's, item by item, over the GRPO workload, the AIME and MedMCQA
  fixtures and generated hostile completions;
* its offsets point into the completion *as sent*, also where preprocessing (typography map +
  NFKC) changed lengths;
* hand-built cases show each reason the parser ignores something and the ``Uniq`` walk's
  duplicates with their cosine against ``δ``;
* a megabyte completion gets an explanation of bounded size.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_server.core import RewardParams, ScoreItem, score_batch
from reward_server.core.answers import unmatchable_gold
from reward_server.core.explain import ExplainLimits, score_and_explain
from reward_server.core.text import (
    field_text,
    preprocess,
    preprocess_with_offsets,
)
from tests.doubles import HashEncoder, TableEncoder
from tests.hostile import PIECES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: Characters preprocessing changes, several of them in length (ligatures, circled and
#: full-width digits, combining marks that compose, Hangul jamo, typographic quotes and dashes).
NFKC_CHANGING = [
    "\ufb01",  # ﬁ -> fi
    "\u2460",  # ① -> 1
    "\uff11\uff18",  # full-width 18
    "e\u0301",  # e + combining acute -> é
    "\u0301",
    ">\u0338",  # -> ≯: swallows the end of a tag
    "\u1100\u1161",  # Hangul L + V -> one syllable
    "\u3392",  # ㎒ -> MHz
    "\u2018x\u2019",
    "\u2014",
    "\u00bd",  # ½ -> 1⁄2
    "\u2026",  # … -> ...
]
text_piece = st.one_of(
    st.sampled_from(NFKC_CHANGING), st.sampled_from(PIECES[:40]), st.text(max_size=8)
)
noisy = st.lists(text_piece, max_size=8).map("".join)


def strat(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
    )


def assert_explains(
    items: list[ScoreItem],
    encoder: Any,
    *,
    recipe: str = "sde2",
    answer_type: str = "numeric",
    params: RewardParams | None = None,
    normalize: bool = True,
) -> dict[str, Any]:
    """The explanation's numbers equal ``score_batch``'s (both diagnostics settings)."""
    kw: dict[str, Any] = {"recipe": recipe, "answer_type": answer_type, "params": params}
    score, explanation = score_and_explain(items, encoder, normalize=normalize, **kw)
    plain = score_batch(items, encoder, normalize=normalize, diagnostics=False, **kw).as_dict()
    full = score_batch(items, encoder, normalize=normalize, diagnostics=True, **kw).as_dict()
    assert score.as_dict() == full
    for key in ("rewards", "components", "normalized", "advantages", "batch"):
        assert full[key] == plain[key]
    explanation = json.loads(json.dumps(explanation))  # what the wire carries
    assert len(explanation["items"]) == len(items)
    for i, ex in enumerate(explanation["items"]):
        want = full["items"][i]
        assert ex["reward"] == full["rewards"][i]
        assert ex["advantage"] == (full["advantages"] or [None] * len(items))[i]
        assert ex["n_strat"] == want["n_strat"]
        assert ex["chi"] == want["strategy_correct"]
        assert ex["correct"] == want["correct"]
        fa = ex["final_answer"]
        if want["final_answer"] is None:
            assert fa["text"] is None and fa["source"] is None
        else:
            assert fa["text"] == want["final_answer"][: fa["chars"]] and fa["chars"] == len(
                want["final_answer"]
            )
        assert sum(b["status"] == "kept" for b in ex["strategies"]) == want["n_strat"]
        geometry = ex["geometry"]
        if want["n_strat"] >= 1:
            assert (geometry["uniq"], geometry["div"]) == (want["uniq"], want["div"])
            assert sum(geometry["kept"]) == want["uniq"]
            assert len(geometry["cosines"]) == want["n_strat"]
        for key, values in full["components"].items():
            assert ex["components"][key]["value"] == values[i]
            norm = ex["normalization"][key]
            assert norm["normalized"] == full["normalized"][key][i]
            assert (norm["mean"], norm["std"]) == (
                full["batch"]["mean"][key],
                full["batch"]["std"][key],
            )
        total = 0.0
        for key in full["components"]:
            total += ex["normalization"][key]["contribution"]
        assert total == ex["reward"]
    return explanation


def test_hand_computed_geometry_and_duplicates() -> None:
    # Angles 0°, 30°, 90°, 150°: "northeast" is within δ = 0.8 of "east" (cos 30° = 0.866).
    table = {
        "east": [1.0, 0.0],
        "northeast": [math.cos(math.pi / 6), math.sin(math.pi / 6)],
        "north": [0.0, 1.0],
        "northwest": [-math.sqrt(3) / 2, 0.5],
    }
    completion = "".join(strat(r, str(k)) for k, r in enumerate(table)) + "<final_answer>9"
    items = [ScoreItem(completion=completion, answer="7"), ScoreItem(completion="x", answer="7")]
    ex = assert_explains(items, TableEncoder(table))["items"][0]
    geometry = ex["geometry"]
    assert geometry["kept"] == [True, False, True, True]
    assert geometry["uniq"] == 3
    (dropped,) = geometry["dropped"]
    assert dropped["strategy"] == 1 and dropped["duplicate_of"] == 0
    assert dropped["cosine"] == pytest.approx(math.sqrt(3) / 2)
    assert dropped["cosine"] > geometry["threshold"] == 0.8
    assert geometry["cosines"][0][3] == pytest.approx(-math.sqrt(3) / 2)
    # The 6 cosines: 0.866, 0, −0.866, 0.5, −0.5, 0.5; Div = 1 − their mean.
    assert geometry["div"] == pytest.approx(1 - 0.5 / 6)
    assert geometry["g"] == pytest.approx(3 * geometry["div"])
    sd = ex["components"]["sd"]
    assert sd["inputs"]["chi"] is False and sd["inputs"]["capped"] is False
    assert sd["value"] == pytest.approx(0.1 * geometry["g"])
    # "<final_answer>9" has no closing: f_ans is the last strategy's outcome.
    assert ex["final_answer"]["source"] == "strategy" and ex["final_answer"]["text"] == "3"
    assert ex["final_answer"]["span"] == ex["strategies"][-1]["outcome"]["span"]
    assert [i["kind"] for i in ex["ignored"]] == ["unclosed_final_answer", "outside_tags"]
    assert ex["ignored"][1]["excerpt"] == "9"


def test_every_reason_for_ignoring_text() -> None:
    completion = (
        "Let me think. "
        + strat("add", "5")
        + "<strategy><reasoning>x</reasoning></strategy>"  # no outcome: invalid
        + "<strategy><reasoning>**</reasoning><strategy_outcome>1</strategy_outcome></strategy>"
        + strat("add", "5")  # duplicate
        + "<strategy>"  # dropped by the nested opening after it
        + strat("mul", "6")
        + "</strategy>"  # stray closing
        + strat("sub", "7")  # beyond max_strategies = 2
        + "<answer>5</answer><final_answer></final_answer><final_answer>6</final_answer>"
    )
    items = [ScoreItem(completion=completion, answer="5")]
    ex = assert_explains(items, HashEncoder(), params=RewardParams(max_strategies=2))["items"][0]
    statuses = [(b["status"], b.get("reason")) for b in ex["strategies"]]
    assert statuses == [
        ("kept", None),
        ("invalid", "no <strategy_outcome> tag"),
        ("invalid", "reasoning is empty"),
        ("duplicate", "same reasoning and outcome as an earlier kept strategy"),
        ("kept", None),
        ("beyond_max", "max_strategies strategies were already kept: not read"),
    ]
    assert ex["strategies"][3]["duplicate_of"] == ex["strategies"][0]["block"]
    assert ex["ignored_counts"] == {
        "beyond_max_block": 1,
        "duplicate_block": 1,
        "invalid_block": 2,
        "outside_tags": 1,
        "stray_closing": 1,
        "unclosed_opening": 1,
        "unused_answer": 1,
        "unused_final_answer": 1,
    }
    kinds = {i["kind"]: i for i in ex["ignored"]}
    start, end = kinds["outside_tags"]["span"]
    assert completion[start:end] == "Let me think. "
    start, end = kinds["unclosed_opening"]["span"]
    assert completion[start:end] == "<strategy>"
    assert kinds["unused_answer"]["reason"] == "a <final_answer> takes priority"
    assert kinds["unused_final_answer"]["reason"] == "empty field"
    fa = ex["final_answer"]
    assert (fa["source"], fa["text"], fa["correct"]) == ("final_answer", "6", False)
    assert completion[fa["span"][0] : fa["span"][1]] == "6"
    assert [b["outcome"].get("matches") for b in ex["strategies"] if b["status"] == "kept"] == [
        True,
        False,
    ]
    assert ex["chi"] is True and ex["gold"]["canonical"] == {"kind": "number", "value": "5"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=noisy,
    fields=st.lists(st.tuples(noisy, noisy, noisy), min_size=1, max_size=4),
    suffix=noisy,
)
def test_offsets_point_into_the_completion_as_sent(
    prefix: str, fields: list[tuple[str, str, str]], suffix: str
) -> None:
    completion = (
        prefix + "".join(f"{gap}{strat(r, o)}" for r, o, gap in fields) + f"{suffix}<answer>"
    )
    items = [ScoreItem(completion=completion, answer="18")]
    big = ExplainLimits(excerpt_chars=10_000)
    _, explanation = score_and_explain(items, HashEncoder(), limits=big)
    ex = explanation["items"][0]
    for block in ex["strategies"]:
        for name in ("reasoning", "outcome"):
            field = block[name]
            if field["span"] is not None:
                start, end = field["span"]
                assert 0 <= start <= end <= len(completion)
                assert field_text(preprocess(completion[start:end])) == field["text"]
        start, end = block["span"]
        assert preprocess(completion[start:end]).lower().startswith("<strategy")
    for ignored in ex["ignored"]:
        start, end = ignored["span"]
        assert 0 <= start <= end <= len(completion)


@pytest.mark.parametrize("recipe", ["sde2", "cfee", "cfl"])
def test_equal_to_the_scorer_on_a_grpo_step(recipe: str) -> None:
    from benchmarks.workload import grpo_step

    items = [ScoreItem(**it) for it in grpo_step(seed=5, prompts=3, generations=4)]
    assert_explains(items, HashEncoder(), recipe=recipe)
    assert_explains(items, HashEncoder(), recipe=recipe, normalize=False)


def test_equal_to_the_scorer_on_the_aime_and_medmcqa_fixtures() -> None:
    aime = [json.loads(line) for line in (FIXTURES / "aime_sample.jsonl").open()]
    items = [
        ScoreItem(
            completion=strat(f"try {k}", str(int(r["Answer"]) + k % 2))
            + strat(f"check {r['Question'][:40]}", r["Answer"])
            + f"<final_answer>\\boxed{{{r['Answer']}}}</final_answer>" * (k % 3 != 0),
            answer=r["Answer"],
            num_tokens=k * 200,
            group=str(k % 2),
        )
        for k, r in enumerate(aime)
    ]
    assert_explains(items, HashEncoder())
    assert_explains(items, HashEncoder(), recipe="cfl", params=RewardParams(length_target=300))
    med = [json.loads(line) for line in (FIXTURES / "medmcqa_sample.jsonl").open()]
    letters = "ABCD"
    items = [
        ScoreItem(
            completion=strat(r["exp"], f"({letters[(r['cop'] + k) % 4]})")
            + strat(r["question"], f"option {letters[r['cop']].lower()}")
            + f"<answer>{letters[(r['cop'] + k) % 4]}.</answer>",
            answer=letters[r["cop"]],
        )
        for k, r in enumerate(med)
    ]
    explanation = assert_explains(items, HashEncoder(), answer_type="choice")
    outcome = explanation["items"][0]["strategies"][1]["outcome"]
    assert outcome["canonical"]["kind"] == "letter" and outcome["matches"] is True


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    completions=st.lists(st.lists(text_piece, max_size=40).map("".join), min_size=1, max_size=5),
    answer=noisy,
    answer_type=st.sampled_from(["numeric", "choice", "exact"]),
    max_strategies=st.integers(1, 5),
    recipe=st.sampled_from(["sde2", "cfee", "cfl"]),
)
def test_equal_to_the_scorer_on_hostile_completions(
    completions: list[str], answer: str, answer_type: str, max_strategies: int, recipe: str
) -> None:
    items = [ScoreItem(completion=c, answer=answer) for c in completions]
    unmatchable = unmatchable_gold(answer_type, preprocess(answer)) is not None
    scored = score_batch(items, HashEncoder(), answer_type=answer_type)  # type: ignore[arg-type]
    assert [str(w).split(":")[0] for w in scored.warnings] == ["items.0.answer"] * unmatchable
    params = RewardParams(max_strategies=max_strategies)
    assert_explains(items, HashEncoder(), recipe=recipe, answer_type=answer_type, params=params)


@pytest.mark.parametrize(
    "completion",
    [
        "<strategy>" * 100_000,
        "<strategy></strategy>" * 50_000,
        strat("r" * 500_000, "o" * 500_000),
        "".join(strat(f"step {k}", str(k)) for k in range(20_000)),
        "x " * 500_000 + "<final_answer>1</final_answer>",
        "\ufb01<answer>" * 100_000,
    ],
    ids=["open", "empty-blocks", "long-fields", "many-strategies", "prose", "ligatures"],
)
def test_megabyte_completion_explanation_is_bounded(completion: str) -> None:
    assert len(completion) >= 900_000
    items = [ScoreItem(completion=completion, answer="1")]
    _, explanation = score_and_explain(items, HashEncoder())
    size = len(json.dumps(explanation))
    # 32 kept strategies, 64 listed spans of 240-char excerpts and a 32×32 matrix at most.
    assert size < 200_000, size
    ex = explanation["items"][0]
    assert ex["blocks_listed"] <= 32 + 64
    assert len(ex["ignored"]) <= 64


def _explain_seconds(completion: str) -> float:
    start = time.perf_counter()
    score_and_explain([ScoreItem(completion=completion, answer="1")], HashEncoder())
    return time.perf_counter() - start


@pytest.mark.parametrize(
    "unit",
    [
        "\u0316\u0301" * 15 + "e",  # runs of 30 combining marks (the most accepted), unsorted
        "\u1100\u1161\u0301",  # jamo that compose, then a mark
        "\ufb01\u0301",  # a ligature NFKC expands, then a mark
        "\u0f73" * 30 + "x",  # a starter that decomposes into two marks, 30 in a row
    ],
    ids=["combining-runs", "jamo", "ligatures", "decomposing-to-marks"],
)
def test_explanation_is_linear_on_adversarial_unicode(unit: str) -> None:
    """Explanations map offsets through preprocessing (:func:`preprocess_with_offsets`): as
    linear as the parser (SPEC §1), also on a megabyte of combining marks in runs of 30."""
    head = "<final_answer>1</final_answer>e"
    small = head + unit * (100_000 // len(unit))
    big = head + unit * (1_000_000 // len(unit))
    t_small, t_big = _explain_seconds(small), _explain_seconds(big)
    assert t_big < 5.0, f"1 M characters of {unit!r} took {t_big:.2f}s"
    # 10x the input may cost ~10x the time, never ~100x (generous margin for a noisy machine).
    assert t_big < 40 * t_small + 0.05


@pytest.mark.parametrize("flood", ["\u0301" * 500_000 + "\u0316" * 500_000, "\u0f73" * 100_000])
def test_a_flood_of_combining_marks_is_explained_at_once(flood: str) -> None:
    """Past 30 marks in a row Python's NFKC takes quadratic time (and the offset map took cubic):
    the explanation orders the run itself, and its offsets still point into the text as sent."""
    completion = "<final_answer>1</final_answer>e" + flood
    start = time.perf_counter()
    score, _ = score_and_explain([ScoreItem(completion=completion, answer="1")], HashEncoder())
    assert time.perf_counter() - start < 5.0
    assert score.components["oc"] == [1.0]
    pre, offsets = preprocess_with_offsets(completion)
    assert pre == preprocess(completion)
    assert offsets.span(0, pre.index("</final_answer>")) == (0, completion.index("</final_answer>"))
    assert offsets.span(len(pre) - 1, len(pre))[1] == len(completion)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.one_of(st.text(max_size=6), st.sampled_from(NFKC_CHANGING))).map("".join))
def test_offset_tracking_preprocessing_is_preprocess(text: str) -> None:
    pre, offsets = preprocess_with_offsets(text)
    assert pre == preprocess(text)
    previous = 0
    for k in range(len(pre) + 1):  # monotone, within the text
        start = offsets.start(k) if k < len(pre) else len(text)
        assert previous <= start <= len(text)
        previous = start


def test_math_answer_type_is_explained_with_the_same_judge() -> None:
    items = [
        ScoreItem(
            completion=strat("halve it", "$\\frac{1}{2}$") + strat("guess", "3") + "<answer>0.5",
            answer="1/2",
        ),
        ScoreItem(completion=strat("guess", "3"), answer="1/2"),
    ]
    explanation = assert_explains(items, HashEncoder(), answer_type="math")
    outcomes = [b["outcome"] for b in explanation["items"][0]["strategies"]]
    assert [o["matches"] for o in outcomes] == [True, False]
    assert outcomes[0]["canonical"] == {"kind": "math", "value": None}
    assert "note" not in explanation["items"][0]


@pytest.mark.parametrize(("kept", "listed_others"), [(32, 64), (72, 64), (3, 5)])
def test_every_kept_block_and_up_to_64_others_are_listed(kept: int, listed_others: int) -> None:
    """The cap on other blocks counted the kept ones too: with 32 kept only 32 others were
    listed, with 64 or more none (the inspector showed "Ignored (5)" over an empty table)."""
    block = "<strategy><reasoning>r{}</reasoning><strategy_outcome>{}</strategy_outcome></strategy>"
    distinct = [block.format(k, k) for k in range(kept)]
    duplicates = [block.format(0, 0)] * min(listed_others + 20, 100)
    if kept == 3:
        duplicates = duplicates[:5]
    items = [ScoreItem(completion="".join(distinct + duplicates), answer="1")]
    params = RewardParams(max_strategies=max(kept, 32))
    _, explanation = score_and_explain(items, HashEncoder(), params=params)
    ex = explanation["items"][0]
    listed = [b["status"] for b in ex["strategies"]]
    assert listed.count("kept") == kept
    assert len(listed) - listed.count("kept") == listed_others  # duplicates, or beyond the cap
    assert ex["blocks_listed"] == kept + listed_others
