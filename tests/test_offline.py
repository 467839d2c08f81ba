"""``sde2-reward score``: the offline scorer gives the in-process scorer's numbers, line by line,
and rejects bad input naming the line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.workload import grpo_step
from reward_server.cli import main
from reward_server.core import ScoreItem, score_batch
from reward_server.encoders.loading import load_encoder
from tests.hostile import PATHOLOGICAL_MATH


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_offline_scores_equal_in_process_scores(tmp_path: Path) -> None:
    items = grpo_step(seed=3, prompts=2, generations=4)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    assert main(["score", "--in", str(src), "--out", str(out), "--quiet", "--diagnostics"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    want = score_batch([ScoreItem(**i) for i in items], load_encoder("onnx"), diagnostics=True)
    assert len(lines) == len(items)
    for i, line in enumerate(lines):
        assert line["reward"] == pytest.approx(want.rewards[i], abs=1e-9)
        assert line["advantage"] == pytest.approx(want.advantages[i], abs=1e-9)  # type: ignore[index]
        assert line["components"] == pytest.approx({k: v[i] for k, v in want.components.items()})
        for key in ("n_strat", "final_answer", "correct", "strategy_correct", "uniq"):
            assert line[key] == getattr(want.items[i], key)


def test_offline_without_encoder_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"completion": "<answer>4</answer>", "answer": "4"}])
    assert main(["score", "--in", str(src), "--out", "-", "--recipe", "cfl", "--quiet"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["correct"] is True
    assert record["components"] == {"oc": 1.0, "fa": 0.3, "len": -0.0}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not JSON"),
        ("[1]", "line 2: expected a JSON object"),
        ('{"completion": 1, "answer": "2"}', "line 2: completion"),
        ('{"completion": "x"}', "line 2: answer"),
        ('{"completion": "x", "answer": "2", "extra": 1}', "line 2: extra"),
        ('{"completion": "x", "answer": "2", "num_tokens": -3}', "line 2: num_tokens"),
    ],
)
def test_bad_lines_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "a", "answer": "1"}\n' + line + "\n", encoding="utf-8")
    assert main(["score", "--in", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert message in capsys.readouterr().err


def test_bad_params_and_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"completion": "a", "answer": "1"}])
    out = str(tmp_path / "o.jsonl")
    assert main(["score", "--in", str(src), "--out", out, "--params", '{"eps": 0}']) == 2
    assert "eps" in capsys.readouterr().err
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert main(["score", "--in", str(empty), "--out", out]) == 2
    assert "empty" in capsys.readouterr().err


def test_overflowing_parameters_exit_2_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"completion": "<final_answer>1</final_answer>", "answer": "1"},
        {"completion": "x", "answer": "1"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    params = json.dumps({"lambda_oc": 1e308, "gamma_answer": 1e308})
    argv = ["score", "--in", str(src), "--out", str(out), "--quiet", "--no-normalize"]
    assert main([*argv, "--params", params]) == 2
    assert "params: these parameters make a reward overflow" in capsys.readouterr().err
    assert not out.exists()


def test_offline_math_survives_a_pathological_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = PATHOLOGICAL_MATH[0]
    rows = [
        {"completion": f"<answer>{evil}</answer>", "answer": "$5$"},
        {"completion": "<answer>$\\frac{10}{2}$</answer>", "answer": "$5$"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["score", "--in", str(src), "--out", "-", "--recipe", "cfl", "--answer-type", "math"]
    assert main([*args, "--quiet", "--math-timeout", "1"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["correct"] for line in captured.out.splitlines()] == [False, True]
    assert "1 math check ran past 1.0 s" in captured.err
    with pytest.raises(SystemExit) as exc:  # an argument error: usage and exit status 2
        main([*args, "--math-timeout", "0"])
    assert exc.value.code == 2
    assert "argument --math-timeout" in capsys.readouterr().err
