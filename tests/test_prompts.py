"""``--prompt {multi,single}``: the paper's single-trace rows (AIME "Single-strategy prompt";
GRPO-CFL's S-ACC and #STR "–") need a single-trace prompt, which did not exist: only the
multi-strategy one. Both commands take the flag (one definition), the single prompt asks for what
the parser reads (``<answer>`` is second in the answer priority), and runs record it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from reward_server.core.parsing import parse_completion
from reward_server.core.text import preprocess
from reward_server.data import GSM8K_DIR
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.test_eval_inputs import URL, FakeClient, fake_client  # noqa: F401 - fixture
from tests.tiny_models import tiny_qwen2
from trainer_client import evaluate, modeling, train
from trainer_client.prompts import SINGLE_SCHEMA, system_prompt

pytestmark = pytest.mark.train


def test_the_single_prompt_asks_for_what_the_parser_reads() -> None:
    single = system_prompt("math", "single")
    assert SINGLE_SCHEMA in single and "<strategy" not in single
    assert "letter" in system_prompt("choice", "single")
    filled = SINGLE_SCHEMA.replace(" ... </reasoning>", " 6 * 7 </reasoning>").replace(
        " ... </answer>", " 42 </answer>"
    )
    parsed = parse_completion(preprocess(filled), 32)
    assert parsed.final_answer == "42" and parsed.n_strat == 0  # a single trace: no strategies
    assert system_prompt() == system_prompt("math", "multi")  # the default is unchanged


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny"), chat=True)


def test_sde2_train_trains_on_the_chosen_prompt_and_records_it(
    reward_server: ServerProcess,  # noqa: F811
    tiny_chat_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--model", str(tiny_chat_model), "--reward-url", reward_server.url]
    argv += ["--data", str(GSM8K_DIR), "--limit", "2", "--output-dir", str(tmp_path / "run")]
    argv += ["--num-generations", "2", "--max-new-tokens", "4", "--prompt", "single"]
    args = train.build_parser().parse_args(argv)
    trainer, _ = train.build_trainer(args)
    system = trainer.train_dataset[0]["prompt"][0]
    assert system == {"role": "system", "content": system_prompt("math", "single")}
    record = train.training_record(args, trainer.args, False, {})
    assert record["prompt"] == "single"
    # A local model named from its folder is recorded whole: sde2-eval and a resume read the
    # record from other folders (a relative path told them of another base).
    monkeypatch.chdir(tiny_chat_model.parent)
    args.model = tiny_chat_model.name
    record = train.training_record(args, trainer.args, False, {})
    assert record["model"] == str(tiny_chat_model.resolve())


def test_sde2_eval_generates_with_the_chosen_prompt_and_records_it(
    tiny_chat_model: Path,
    fake_client: type[FakeClient],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    systems: list[str] = []
    load = modeling.load_tokenizer

    def observed(ref: Any) -> Any:  # the real tokenizer; its chat template's input is read
        tokenizer = load(ref)
        template = tokenizer.apply_chat_template

        def apply(messages: list[dict[str, str]], *args: Any, **kwargs: Any) -> Any:
            systems.append(messages[0]["content"])
            return template(messages, *args, **kwargs)

        tokenizer.apply_chat_template = apply
        return tokenizer

    monkeypatch.setattr(modeling, "load_tokenizer", observed)
    adapter = tmp_path / "final"  # trained multi (its record), evaluated single: warned
    adapter.mkdir()
    record = {"prompt": "multi", "model": "other-org/other-base"}  # and on another base
    (adapter / train.TRAINING_RECORD).write_text(json.dumps(record))
    out = tmp_path / "eval.json"
    argv = ["--reward-url", URL, "--model", str(tiny_chat_model), "--data", str(GSM8K_DIR)]
    argv += ["--limit", "2", "--max-new-tokens", "2", "--json", str(out), "--prompt", "single"]
    args = evaluate.build_parser().parse_args([*argv, "--adapter", str(adapter)])
    with caplog.at_level(logging.WARNING, logger="sde2.eval"):
        evaluate.warn_training_mismatch(args, evaluate.adapter_record(args))
    assert "says the adapter was trained with --prompt multi" in caplog.text
    assert "says the adapter was trained on other-org/other-base" in caplog.text
    caplog.clear()
    record["model"] = str(tiny_chat_model)  # the same base, named as --model names it
    (adapter / train.TRAINING_RECORD).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="sde2.eval"):
        evaluate.warn_training_mismatch(args, evaluate.adapter_record(args))
    assert "trained on" not in caplog.text
    assert evaluate.main(argv) == 0
    assert systems == [system_prompt("math", "single")] * 2
    assert json.loads(out.read_text())["meta"]["prompt"] == "single"
