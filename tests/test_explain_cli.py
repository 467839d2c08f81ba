"""``sde2-reward explain``: the terminal report of ``/v1/explain``'s facts, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_server.cli import main
from reward_server.core import ScoreItem
from reward_server.core.explain import score_and_explain
from tests.doubles import HashEncoder


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def strat(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
    )


#: No item has two strategies, so no encoder is loaded (fast, exact).
NO_ENCODER_ROWS: list[dict[str, object]] = [
    {"completion": "Hmm. " + strat("add them", "5") + "<answer>5</answer>", "answer": "5"},
    {"completion": "<strategy>" + strat("guess", "4") + "</strategy>", "answer": "5"},
    {"completion": "no tags at all", "answer": "5", "num_tokens": 900},
]


def test_report_shows_the_explanation_facts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", NO_ENCODER_ROWS)
    assert main(["explain", "--in", str(src), "--quiet"]) == 0
    report = capsys.readouterr().out
    _, want = score_and_explain([ScoreItem(**r) for r in NO_ENCODER_ROWS], HashEncoder())  # type: ignore[arg-type]
    for item in want["items"]:
        assert f"item {item['index']}: reward {item['reward']:+.6f}" in report
    assert 's0 kept                5-95  reasoning "add them"  outcome "5" N=5 (match)' in report
    assert "unclosed_opening" in report and "stray_closing" in report
    assert '0-5  text outside strategy blocks and answer fields: not read  "Hmm."' in report
    assert 'final answer: "5" N=5 from <answer> at 103-104' in report
    assert 'final answer: "4" N=4 from the last kept strategy\'s outcome' in report
    assert "final answer: none" in report
    assert "fa     0.6000 = min(1, gamma_strategies · n_strat)" in report


def test_report_escapes_what_a_terminal_would_act_on_or_hide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A right-to-left override (``81`` read as ``18``), C1's CSI (a colour sequence) and a
    zero-width space were printed as they are; the JSON escapes only C0 controls."""
    hidden = "\u202e81 \u009b31m a\u200bb"
    row = {"completion": strat(hidden, "5") + "<answer>5</answer>", "answer": "5"}
    src = write_jsonl(tmp_path / "in.jsonl", [row])
    assert main(["explain", "--in", str(src), "--quiet"]) == 0
    report = capsys.readouterr().out
    assert 'reasoning "\\u202e81 \\u009b31m a\\u200bb"' in report
    assert not any(c in report for c in hidden if not c.isascii())


def test_json_equals_the_core_explanation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", NO_ENCODER_ROWS)
    assert main(["explain", "--in", str(src), "--json", "--recipe", "cfl", "--no-normalize"]) == 0
    got = json.loads(capsys.readouterr().out)
    items = [ScoreItem(**r) for r in NO_ENCODER_ROWS]  # type: ignore[arg-type]
    _, want = score_and_explain(items, HashEncoder(), recipe="cfl", normalize=False)
    assert got == json.loads(json.dumps(want))
    assert main(["explain", "--in", str(src), "--json", "--item", "2"]) == 0
    only = json.loads(capsys.readouterr().out)["items"]
    assert len(only) == 1 and only[0]["index"] == 2 and only[0]["length"]["value"] == 900


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", '{"eps": 0}'], "eps"),
        (["--item", "7"], "--item 7: the file has 3 items, numbered 0 to 2"),
        (["--item", "-1"], "--item -1: the file has 3 items, numbered 0 to 2"),
    ],
)
def test_bad_arguments_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", NO_ENCODER_ROWS)
    assert main(["explain", "--in", str(src), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "a", "answer": "1"}\n{"completion": 3, "answer": "1"}\n')
    assert main(["explain", "--in", str(src)]) == 2
    assert "line 2: completion" in capsys.readouterr().err


@pytest.mark.slow
def test_real_encoder_rewards_equal_sde2_reward_score(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {
            "completion": strat("add two and three to get five", "4")
            + strat("two plus three makes five", "6")
            + strat("count the apples on the table one by one", "7")
            + "<final_answer>7</final_answer>",
            "answer": "5",
        },
        *NO_ENCODER_ROWS,
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["explain", "--in", str(src), "--json", "--quiet"]) == 0
    explained = json.loads(capsys.readouterr().out)["items"]
    assert main(["score", "--in", str(src), "--out", "-", "--quiet", "--diagnostics"]) == 0
    scored = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for ex, sc in zip(explained, scored, strict=True):
        assert ex["reward"] == pytest.approx(sc["reward"], abs=1e-9)
        assert ex["geometry"]["uniq"] == (sc["uniq"] if sc["n_strat"] else 0)
    geometry = explained[0]["geometry"]
    assert geometry["kept"] == [True, False, True]  # the two additions are one strategy
    assert geometry["dropped"][0]["cosine"] > 0.8
