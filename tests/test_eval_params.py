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


def test_an_adapter_is_scored_as_its_training_run(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An adapter trained at δ = 0.75 with cfl was scored with sde2 at the server's 0.80,
    silently: without --recipe and --param the record's are used, and said so (log, meta); a
    user's other ones are used with a warning."""
    import logging

    from peft import LoraConfig, get_peft_model

    from reward_server.data import GSM8K_DIR
    from tests.tiny_models import tiny_qwen2
    from trainer_client.modeling import ModelRef, load_model

    model = tiny_qwen2(tmp_path / "tiny", chat=True)
    adapter = tmp_path / "run" / "final"
    lora = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM")
    get_peft_model(load_model(ModelRef.parse(str(model))), lora).save_pretrained(adapter)
    trained = {"similarity_threshold": 0.75, "weights": {"len": 0.5}}
    record = {"recipe": "cfl", "params": trained, "prompt": "multi", "load_in_4bit": False}
    (adapter / train.TRAINING_RECORD).write_text(json.dumps(record))
    out = tmp_path / "eval.json"
    argv = [
        "--reward-url", reward_server.url, "--model", str(model), "--adapter", str(adapter),
        "--data", str(GSM8K_DIR), "--limit", "1", "--max-new-tokens", "4", "--json", str(out),
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sde2.eval"):
        assert evaluate.main(argv) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["recipe"] == "cfl" and meta["params"] == trained
    where = str(adapter / train.TRAINING_RECORD)
    assert meta["scoring_from"] == {"recipe": where, "params": where}
    assert f"--recipe cfl: as the adapter's training run ({where})" in caplog.text
    assert "reward parameters" in caplog.text and "as the adapter's training run" in caplog.text

    caplog.clear()
    mine = ["--recipe", "sde2", "--param", "similarity_threshold=0.8"]
    with caplog.at_level(logging.INFO, logger="sde2.eval"):
        assert evaluate.main([*argv, *mine]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["recipe"] == "sde2" and meta["params"] == {"similarity_threshold": 0.8}
    assert meta["scoring_from"] == {"recipe": "--recipe", "params": "--param"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("trained with --recipe cfl" in w for w in warned)
    assert any("--param {'similarity_threshold': 0.8}" in w and "0.75" in w for w in warned)
