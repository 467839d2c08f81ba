"""``sde2-eval --param``: the table is measured under the reward parameters the model was
trained with (``sde2-train``'s own flag, one definition). Its Uniq column counts distinct
strategies at the similarity threshold δ: without the flag it was always the server's 0.80.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.test_client import completion
from trainer_client import evaluate, train

#: Two strategies that say one thing in other words (cosine between 0.80 and 0.90): one at the
#: server's δ = 0.80, two at δ = 0.90.
REWORDED = completion(
    ["42", "42"], "42", ["Multiply 6 by 7 to get 42.", "Six times seven equals 42."]
)


def uniq(server: ServerProcess, tmp_path: Path, *flags: str) -> float:
    runfile = tmp_path / "run.jsonl"
    runfile.write_text(json.dumps({"completion": REWORDED, "answer": "42"}) + "\n")
    out = tmp_path / "eval.json"
    argv = ["--reward-url", server.url, "--completions", f"x={runfile}", "--json", str(out)]
    assert evaluate.main([*argv, *flags]) == 0
    report = json.loads(out.read_text())
    return float(report["runs"][0]["uniq"])


def test_uniq_is_counted_at_the_given_threshold(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    assert uniq(reward_server, tmp_path) == 1.0  # the server's δ = 0.80
    assert uniq(reward_server, tmp_path, "--param", "similarity_threshold=0.9") == 2.0
    meta = json.loads((tmp_path / "eval.json").read_text())["meta"]
    assert meta["params"] == {"similarity_threshold": 0.9}


def test_a_bad_param_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--reward-url", "http://127.0.0.1:19603", "--completions", "x=unread.jsonl"]
    with pytest.raises(SystemExit) as stop:  # before any file is read or server asked
        evaluate.main([*argv, "--param", "similarity_treshold=0.75"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--param: similarity_treshold: Extra inputs are not permitted" in err


def test_one_definition_for_both_commands() -> None:
    def param_action(parser: argparse.ArgumentParser) -> argparse.Action:
        (action,) = [a for a in parser._actions if "--param" in a.option_strings]
        return action

    ours, theirs = param_action(evaluate.build_parser()), param_action(train.build_parser())
    assert (ours.help, ours.metavar, ours.default) == (theirs.help, theirs.metavar, theirs.default)
