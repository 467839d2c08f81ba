"""Whole-batch scoring (SPEC §1–5 together), hand-computed, plus the lazy-encoding contract."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reward_server.core import (
    InvalidBatch,
    RewardParams,
    ScoreItem,
    finish_batch,
    prepare_batch,
    score_batch,
)
from reward_server.encoders.base import EMBEDDING_DIM
from tests.doubles import HashEncoder, TableEncoder


def strat(r: str, o: str) -> str:
    return (
        f"<strategy><reasoning>{r}</reasoning><strategy_outcome>{o}</strategy_outcome></strategy>"
    )


def angle(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


TABLE = {"east": angle(0), "north": angle(90), "northeast": angle(30), "west": angle(180)}


def test_hand_computed_sde2_batch() -> None:
    items = [
        # A: chi = 0, three strategies; 'northeast' is within 30° of 'east' -> Uniq 2.
        ScoreItem(
            strat("east", "1")
            + strat("north", "2")
            + strat("northeast", "3")
            + "<final_answer>3</final_answer>",
            "#### 7",
        ),
        # B: chi = 1 (second outcome right), final answer wrong.
        ScoreItem(strat("east", "6") + strat("west", "7") + "<final_answer>6</final_answer>", "7"),
        # C: no strategies, right answer in <answer>.
        ScoreItem("<answer>7</answer>", "7"),
        # D: one strategy, no final tag: f_ans is its outcome.
        ScoreItem(strat("north", "5"), "7"),
    ]
    enc = TableEncoder(TABLE)
    out = score_batch(items, enc, normalize=False)
    # Only A needs the encoder (B has chi=1, C has m=0, D has m=1).
    assert enc.calls == [["east", "north", "northeast"]]
    cos30 = math.cos(math.radians(30))
    div_a = 1 - (0 + cos30 + 0.5) / 3
    assert out.components["oc"] == [0.0, 0.0, 1.0, 0.0]
    assert out.components["re"] == [0.0, 1.0, 0.0, 0.0]
    assert out.components["fa"] == pytest.approx(
        [0.6 + 0.3 + 0.1, 0.4 + 0.3 + 0.1, 0.3, 0.2 + 0.3 + 0.1]
    )
    assert out.components["sd"] == pytest.approx([min(0.5, 0.1 * 2 * div_a), 1.0, 0.0, 0.1])
    assert out.rewards == pytest.approx(
        [sum(v[i] for v in out.components.values()) for i in range(4)]
    )
    a, b, c, d = out.items
    assert (a.n_strat, a.final_answer, a.correct, a.strategy_correct, a.uniq) == (
        3,
        "3",
        False,
        False,
        2,
    )
    assert a.div == pytest.approx(div_a)
    assert (b.correct, b.strategy_correct, b.uniq, b.div) == (False, True, None, None)
    assert (c.n_strat, c.final_answer, c.correct, c.uniq) == (0, "7", True, None)
    assert (d.final_answer, d.uniq, d.div) == ("5", 1, 1.0)


def test_normalized_batch_matches_the_formula() -> None:
    items = [ScoreItem("<answer>7</answer>", "7"), ScoreItem("<answer>8</answer>", "7")]
    out = score_batch(items, TableEncoder({}))
    z = 0.5 / (0.5 + 1e-6)
    # oc differs (z = ±1), re and sd are 0 for both (sigma 0), fa equal (0.3 each).
    assert out.normalized["oc"] == pytest.approx([z, -z])
    assert out.normalized["fa"] == [0.0, 0.0]
    assert out.rewards == pytest.approx([z, -z])
    assert out.aggregate.mean["fa"] == pytest.approx(0.3)


def test_cfee_and_cfl_recipes() -> None:
    text = strat("a", "1") + strat("b", "2") + strat("c", "3") + "<final_answer>3</final_answer>"
    items = [ScoreItem(text, "9", num_tokens=768), ScoreItem(text + " extra words", "9")]
    enc = HashEncoder()
    cfee = score_batch(items, enc, recipe="cfee", normalize=False)
    assert list(cfee.components) == ["oc", "fa", "re", "rd"]
    assert cfee.components["rd"] == pytest.approx([0.3, 0.3])
    cfl = score_batch(
        items, enc, recipe="cfl", normalize=False, params=RewardParams(length_target=2)
    )
    assert list(cfl.components) == ["oc", "fa", "len"]
    assert cfl.components["len"] == [-1.0, -0.5]  # 768 tokens; 3 words as sent
    assert enc.calls == []  # neither recipe needs the encoder


def test_length_uses_num_tokens_including_zero_else_words_as_sent() -> None:
    p = RewardParams(length_target=2)
    items = [
        ScoreItem("a b c d", "1", num_tokens=0),
        ScoreItem("a b c d", "1", num_tokens=None),
        ScoreItem("a\u00a0b c", "1"),  # NBSP is whitespace for str.split: 3 words
    ]
    out = score_batch(items, HashEncoder(), recipe="cfl", params=p, normalize=False)
    assert out.components["len"] == [0.0, -1.0, -0.5]


def test_preprocessing_applies_to_completion_and_gold() -> None:
    item = ScoreItem("<final_answer>\uff17\uff12</final_answer>", "\u201c72\u201d")
    assert score_batch([item], HashEncoder(), normalize=False).items[0].correct


def test_max_strategies_cuts_the_list() -> None:
    text = "".join(strat(f"r{i}", str(i)) for i in range(10))
    out = score_batch(
        [ScoreItem(text, "99")],
        HashEncoder(),
        params=RewardParams(max_strategies=4),
        normalize=False,
        recipe="cfee",
    )
    assert out.items[0].n_strat == 4
    assert out.items[0].final_answer == "3"


def test_each_distinct_text_is_encoded_once_per_batch() -> None:
    text = strat("same", "1") + strat("other", "2")
    enc = HashEncoder()
    score_batch([ScoreItem(text, "9"), ScoreItem(text, "8")], enc)
    assert enc.calls == [["same", "other"]]


def test_lazy_and_eager_scoring_give_identical_rewards() -> None:
    items = [
        ScoreItem(
            "".join(strat(f"idea {i} {j}", str(i + j)) for j in range(k)), str(k), group=str(k % 3)
        )
        for i in range(6)
        for k in range(5)
    ]
    lazy_enc, eager_enc = HashEncoder(), HashEncoder()
    lazy = score_batch(items, lazy_enc)
    eager = score_batch(items, eager_enc, diagnostics=True)
    assert lazy.rewards == eager.rewards
    assert lazy.components == eager.components
    assert lazy.advantages == eager.advantages
    assert len(lazy_enc.calls[0]) < len(eager_enc.calls[0])
    # diagnostics fill uniq/div for every item with m >= 1
    assert all((it.uniq is not None) == (it.n_strat >= 1) for it in eager.items)


def test_groups_all_or_none() -> None:
    with pytest.raises(InvalidBatch) as err:
        prepare_batch([ScoreItem("a", "1", group="g"), ScoreItem("b", "1")])
    assert err.value.loc == ("items", 1, "group")
    out = score_batch(
        [ScoreItem("<answer>1</answer>", "1", group="g"), ScoreItem("x", "1", group="g")],
        HashEncoder(),
    )
    assert out.advantages is not None


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(InvalidBatch) as err:
        prepare_batch([])
    assert err.value.loc == ("items",)


@pytest.mark.parametrize("final", ["2", "2.", "$2$"])
def test_a_numeric_gold_is_judged_by_its_number_not_its_field_text(final: str) -> None:
    """SPEC §2 finds a numeric gold's number before field cleaning: "```js2" is 2, though its
    field text (a fence marker and its language word) is empty. It was refused as an empty
    gold unless every answer of the batch was plain digits: the batch decided."""
    items = [ScoreItem(f"<final_answer>{final}</final_answer>", "```js2")]
    out = score_batch(items, HashEncoder(), normalize=False)
    assert out.items[0].correct and out.warnings == ()
    for gold in ("```js", " ** ", "$"):  # N = "": a number never matches it, warned about
        prepared = prepare_batch([ScoreItem(f"<final_answer>{final}</final_answer>", gold)])
        assert not prepared.analyses[0].correct
        assert [w.loc for w in prepared.warnings] == [("items", 0, "answer")], gold


def test_choice_answer_type() -> None:
    items = [ScoreItem(strat("why", "(B)") + "<final_answer>B</final_answer>", "B")]
    out = score_batch(items, HashEncoder(), answer_type="choice", normalize=False)
    assert out.items[0].correct and out.items[0].strategy_correct


def test_as_dict_has_the_wire_shape() -> None:
    out = score_batch([ScoreItem("<answer>18</answer>", "18")], HashEncoder()).as_dict()
    assert set(out) == {
        "rewards",
        "components",
        "normalized",
        "advantages",
        "items",
        "batch",
        "recipe",
        "params",
    }
    assert out["rewards"] == [0.0]
    assert out["items"][0] == {
        "n_strat": 0,
        "final_answer": "18",
        "correct": True,
        "strategy_correct": False,
        "uniq": None,
        "div": None,
    }
    assert out["params"]["similarity_threshold"] == 0.8


def test_non_finite_embeddings_are_an_error_not_a_reward() -> None:
    from reward_server.core import finish_batch

    prepared = prepare_batch([ScoreItem(strat("a", "1") + strat("b", "2"), "9")])
    bad = np.full((len(prepared.texts), 384), np.nan, dtype=np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        finish_batch(prepared, bad)


def test_huge_num_tokens_and_parameters_stay_finite() -> None:
    items = [
        ScoreItem("<final_answer>18</final_answer>", "18", num_tokens=10**400),
        ScoreItem("<final_answer>17</final_answer>", "18"),
    ]
    out = score_batch(items, HashEncoder(), recipe="cfl", params=RewardParams(lambda_oc=1e308))
    assert out.components["len"] == [-1.0, -0.0]
    assert out.normalized["oc"] == pytest.approx([1.0, -1.0])
    assert out.aggregate.std["oc"] == 5e307


@pytest.mark.parametrize(
    ("answer_type", "gold", "final", "correct"),
    [
        # SPEC §2 numeric: "####" keeps what follows (nothing), no number, field text "": N = "".
        # A final answer "." has field text ".", lower-cased without the trailing ".": "" too.
        ("numeric", "####", ".", True),
        ("numeric", "####", "18", False),
        ("numeric", "$", "$", True),  # both "" once "$" is deleted
        ("numeric", " ** ", ".", True),  # an empty gold's N is "" as well
        ("choice", "1", "(B)", False),  # no letter -> no match (MedMCQA's raw cop index)
        ("exact", "**", "x", False),  # N = "": no non-empty final answer equals it
    ],
)
def test_a_gold_no_sensible_answer_matches_is_scored_as_spec_defines_it(
    answer_type: str, gold: str, final: str, correct: bool
) -> None:
    """Such a gold (empty, or empty once canonicalized, or a choice gold with no letter) is not
    refused: SPEC §2 defines its ``N``, so its items are scored by it, with a warning at its
    first item saying their rewards are format rewards (the caller's dataset is likely wrong)."""
    completion = strat("r", final) + f"<final_answer>{final}</final_answer>"
    usual = {"numeric": "7", "choice": "B", "exact": "x y"}[answer_type]
    items = [ScoreItem(f"<final_answer>{usual}</final_answer>", usual)]
    items = [items[0], ScoreItem(completion, gold)] * 2
    score = score_batch(items, HashEncoder(), answer_type=answer_type)  # type: ignore[arg-type]
    assert [it.correct for it in score.items] == [True, correct] * 2
    assert [it.strategy_correct for it in score.items] == [False, correct] * 2
    assert score.components["oc"] == [1.0, float(correct)] * 2
    [warning] = score.warnings
    assert warning.loc == ("items", 1, "answer")
    assert "rewards are format rewards" in warning.message
    plain = score_batch(items[:1], HashEncoder(), answer_type=answer_type)  # type: ignore[arg-type]
    assert plain.warnings == () and plain.items[0].correct


@pytest.mark.parametrize("extra", [-1, 1])
def test_embeddings_not_one_per_text_are_an_error(extra: int) -> None:
    """Phase 2 takes one embedding row per text of phase 1: a count off either way (an encoder
    or a coalescing server mixing up batches) is refused, not scored with misaligned rows."""
    from reward_server.core import finish_batch

    prepared = prepare_batch([ScoreItem(strat("a", "1") + strat("b", "2"), "9")])
    rows = np.eye(len(prepared.texts) + extra, 384, dtype=np.float32)
    with pytest.raises(ValueError, match="embeddings for"):
        finish_batch(prepared, rows)


def test_finish_batch_normalizes_unless_told_not_to() -> None:
    """``finish_batch`` defaults to SPEC §6's ``normalize = true``. Recipe ``cfl``, two
    one-word completions with a final answer and no strategy, one right: ``oc = [1, 0]``,
    ``fa = [0.3, 0.3]`` (σ = 0: centred to 0), ``len = [0, 0]``; so ``R_final`` is
    ``±0.5/(0.5 + eps)`` by default and ``[1.3, 0.3]`` with ``normalize = False``."""
    items = [
        ScoreItem("<final_answer>18</final_answer>", "18"),
        ScoreItem("<final_answer>7</final_answer>", "18"),
    ]
    prepared = prepare_batch(items, recipe="cfl")
    assert prepared.texts == []
    none = np.zeros((0, EMBEDDING_DIM), np.float32)
    z = 0.5 / (0.5 + 1e-6)
    assert finish_batch(prepared, none).rewards == pytest.approx([z, -z], rel=1e-12)
    raw = finish_batch(prepared, none, normalize=False).rewards
    assert raw == pytest.approx([1.3, 0.3], rel=1e-12)
