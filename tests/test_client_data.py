"""Fast checks of the trainer side's pure parts: datasets, prompt, metrics, CLI helpers."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reward_server.core.parsing import parse_completion
from reward_server.core.text import preprocess
from tests.client_fixtures import FIXTURES, GSM8K_DIR
from trainer_client.datasets import load_examples, medmcqa_letter
from trainer_client.evaluate import read_run
from trainer_client.metrics import markdown_table, normal_interval, summarize, wilson_interval
from trainer_client.modeling import ModelRef
from trainer_client.prompts import SCHEMA, build_messages, system_prompt
from trainer_client.results import ItemDiagnostics
from trainer_client.train import build_parser, parse_assignments, resume_target, reward_params


def test_gsm8k_gold_is_the_number_after_hashes() -> None:
    ex = load_examples("gsm8k", GSM8K_DIR, "test", limit=3)
    assert len(ex) == 3 and all(e.answer_type == "numeric" for e in ex)
    raw = json.loads((GSM8K_DIR / "test.jsonl").read_text().splitlines()[0])
    assert ex[0].answer == raw["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    assert ex[0].question == raw["question"]


def test_medmcqa_fixture_gives_letters_and_options() -> None:
    ex = load_examples("medmcqa", FIXTURES / "medmcqa_sample.jsonl")
    assert [e.answer for e in ex] == ["B", "C", "A", "B", "D"]
    assert all(e.answer_type == "choice" for e in ex)
    assert "\nA. Vitamin A\nB. Vitamin C\nC. Vitamin D\nD. Vitamin K" in ex[0].question
    assert medmcqa_letter(4, cop_base=1) == "D" and medmcqa_letter("b") == "B"
    with pytest.raises(ValueError, match="cop"):
        medmcqa_letter(4)
    assert "letter" in ex[0].record()["prompt"][0]["content"]


def test_aime_fixture_integer_answers(tmp_path: Path) -> None:
    ex = load_examples("aime", FIXTURES / "aime_sample.jsonl")
    assert [e.answer for e in ex] == ["60", "15", "20", "93"]
    assert ex[0].id == "1983-I-1" and "log" in ex[0].question
    bad = tmp_path / "aime.jsonl"
    bad.write_text(json.dumps({"Problem": "x", "Answer": "1/2"}) + "\n")
    with pytest.raises(ValueError, match="0-999"):
        load_examples("aime", bad)


def test_the_default_aime_source_is_split_80_20(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default AIME source has one split: every fifth problem is ``test``, the others
    ``train`` (the paper's 80:20), with no problem in both; a source of one's own keeps its
    splits."""
    import trainer_client.datasets as datasets

    rows = [{"ID": f"p{i}", "Problem": f"problem {i}", "Answer": i} for i in range(23)]
    asked: list[str] = []

    def hub_rows(source: str, split: str) -> Any:
        asked.append(split)
        return ((f"{source} row {i}", row) for i, row in enumerate(rows))

    monkeypatch.setattr(datasets, "read_located_rows", hub_rows)
    test = load_examples("aime", None, "test")
    train = load_examples("aime", None, "train")
    assert [e.id for e in test] == ["p4", "p9", "p14", "p19"]
    assert len(train) == 19 and not {e.id for e in train} & {e.id for e in test}
    assert asked == ["train", "train"]  # the source's only split, read for both
    assert len(load_examples("aime", "org/aime", "test")) == 23  # its own split, whole
    assert asked[-1] == "test"
    # The default source named by its id is split alike (its train held every test problem).
    named = datasets.DEFAULT_SOURCES["aime"]
    assert load_examples("aime", named, "test") == test
    assert load_examples("aime", named, "train") == train
    assert asked[-2:] == ["train", "train"]


def test_sample_draws_questions_at_random_by_seed() -> None:
    from trainer_client.train import training_examples

    def drawn(*argv: str) -> list[str]:
        args = build_parser().parse_args(
            ["--model", "m", "--reward-url", "http://h:1", "--data", str(GSM8K_DIR), *argv]
        )
        return [e.question for e in training_examples(args)]

    first = drawn("--limit", "5")
    sampled = drawn("--sample", "5", "--seed", "1")
    assert len(set(sampled)) == 5 and sampled != first
    assert drawn("--sample", "5", "--seed", "1") == sampled != drawn("--sample", "5", "--seed", "2")


def test_missing_local_source_is_not_sent_to_the_hub() -> None:
    with pytest.raises(FileNotFoundError):
        load_examples("gsm8k", "./no/such/file.jsonl")


def test_prompt_schema_is_what_the_parser_reads() -> None:
    filled = SCHEMA.replace("...\n", "").replace(" ... ", " x ")
    parsed = parse_completion(preprocess(filled), 32)
    assert parsed.n_strat == 1  # the two example blocks are identical: one duplicate dropped
    assert parsed.final_answer == "x"
    messages = build_messages("What is 2+2?")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<final_answer>" in system_prompt() and "different" in system_prompt()


def test_intervals_and_table() -> None:
    """ACC's interval by default is the paper's: its Table 1 reads [79.96, 84.10] for 1082 of
    1319 (SD-E² on Qwen) and [78.38, 82.65] for 1062 (GRPO-CFEE), normal intervals both; the
    Wilson interval is the option."""
    for correct, want in ((1082, (79.96, 84.10)), (1062, (78.38, 82.65))):
        low, high = normal_interval(correct, 1319)
        assert (round(100 * low, 2), round(100 * high, 2)) == want
    low, high = wilson_interval(1082, 1319)
    assert (round(100 * low, 2), round(100 * high, 2)) == (79.87, 84.01)
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    assert normal_interval(0, 5) == (0.0, 0.0) and normal_interval(5, 5) == (1.0, 1.0)
    diagnostics = [ItemDiagnostics(1, "1", i < 1082, i < 1082) for i in range(1319)]
    row = summarize("x", diagnostics, [""] * 1319, None)
    assert (round(row.ci_low, 2), round(row.ci_high, 2)) == (79.96, 84.10)
    row = summarize("x", diagnostics, [""] * 1319, None, interval="wilson")
    assert (round(row.ci_low, 2), round(row.ci_high, 2)) == (79.87, 84.01)
    items = [
        ItemDiagnostics(3, "18", True, True, 2, 0.4),
        ItemDiagnostics(0, None, False, False),
        ItemDiagnostics(1, "7", False, True, 1, 1.0),
    ]
    m = summarize("sde2", items, ["a b c", "d", ""], [10, 20, 30])
    assert (m.acc, m.s_acc, m.n_str, m.tokens, m.words, m.uniq) == pytest.approx(
        (100 / 3, 200 / 3, 4 / 3, 20.0, 4 / 3, 1.0)
    )
    table = markdown_table([m])
    assert "| sde2 | 3 | 33.33 |" in table and "| 1.33 | 20.00 | 1.33 | 1.00 |" in table
    with pytest.raises(ValueError, match="diagnostics"):
        summarize("x", [ItemDiagnostics(2, None, False, False)], ["a"], None)


def test_the_paper_defaults_reach_grpo_and_lora_configs(tmp_path: Path) -> None:
    """Sec. 4 of the paper, as TRL and PEFT receive it (not only as flag defaults)."""
    from trainer_client.train import grpo_config, lora_config

    argv = ["--model", "m", "--reward-url", "http://h:1", "--output-dir", str(tmp_path)]
    args = build_parser().parse_args(argv)
    config = grpo_config(args, quantize_4bit=False, cuda=False)
    assert config.learning_rate == 5e-6
    assert config.lr_scheduler_type.value == "cosine"
    assert config.warmup_steps == 0.1 and config.max_grad_norm == 0.1
    assert config.num_generations == 6 and config.per_device_train_batch_size == 6
    assert config.max_completion_length == 1024  # + prompts of <= 1024 tokens = max length 2048
    assert config.use_cpu and not config.bf16 and config.optim.value == "adamw_torch"
    assert config.gradient_checkpointing
    assert config.log_completions  # else TRL drops the reward's log_extra columns
    lora = lora_config(args)
    assert (lora.r, lora.lora_alpha, lora.target_modules) == (64, 32, "all-linear")
    quantized = grpo_config(args, quantize_4bit=True, cuda=False)
    assert quantized.optim.value == "adamw_8bit"  # 4-bit weights train with 8-bit Adam


def test_train_flags_and_reward_params(tmp_path: Path) -> None:
    assert parse_assignments(["sd=0", "x=abc"], "--weight") == {"sd": 0, "x": "abc"}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_assignments(["sd"], "--weight")
    argv = ["--model", "m", "--reward-url", "http://h:1", "--weight", "sd=0", "--weight", "re=0.5"]
    args = build_parser().parse_args([*argv, "--param", "similarity_threshold=0.75"])
    assert reward_params(args) == {"similarity_threshold": 0.75, "weights": {"sd": 0, "re": 0.5}}
    assert (args.lr, args.num_generations, args.lora_r, args.lora_alpha) == (5e-6, 6, 64, 32)
    assert (args.max_grad_norm, args.warmup_ratio, args.max_length) == (0.1, 0.1, 2048)
    bad = build_parser().parse_args([*argv, "--param", "similarity_threshold=2"])
    with pytest.raises(ValueError, match="similarity_threshold"):
        reward_params(bad)
    fresh = build_parser().parse_args([*argv, "--output-dir", str(tmp_path), "--resume"])
    assert resume_target(fresh) is None  # nothing to resume yet: start fresh
    for step in (3, 12):  # the newest by number, not by name
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step})
        )
    assert resume_target(fresh) == str(tmp_path / "checkpoint-12")


def test_model_ref_and_read_run(tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert ModelRef.parse(str(gguf)) == ModelRef(str(tmp_path), "m.Q4.gguf")
    assert ModelRef.parse("org/model").kwargs() == {}
    runfile = tmp_path / "r.jsonl"
    rows: list[dict[str, object]] = [
        {"completion": "a", "answer": "1"},
        {"completion": "b", "answer": "2"},
    ]
    runfile.write_text("\n".join(json.dumps(r) for r in rows))
    run = read_run(f"base={runfile}")
    assert run.method == "base" and run.num_tokens is None and run.answers == ["1", "2"]
    # A name holding "=" (the hint sde2-eval prints after a failure names its --method so):
    # split before the file, as the shell gives it back from the quoted hint.
    (hint,) = shlex.split(shlex.quote(f"lr=5e-6 run={runfile}"))
    assert read_run(hint).method == "lr=5e-6 run"
    rows[0]["num_tokens"] = 3  # on some lines only: no #TOK of the run, refused
    runfile.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"num_tokens is missing on line 2"):
        read_run(f"base={runfile}")


def test_read_run_takes_gold_numbers_as_written_and_refuses_missing_ones(tmp_path: Path) -> None:
    """A JSON number is the gold in plain decimal (``str(1e-05)`` would be the gold -5); a
    missing answer stops the command naming the file and the line."""
    runfile = tmp_path / "r.jsonl"
    rows = [{"completion": "a", "answer": 0.00001}, {"completion": "b", "answer": 2e16}]
    runfile.write_text("\n".join(json.dumps(r) for r in rows))
    assert read_run(f"x={runfile}").answers == ["0.00001", "20000000000000000"]
    runfile.write_text(json.dumps({"completion": "a", "answer": None}))
    with pytest.raises(ValueError, match=r"r\.jsonl: line 1: answer: the gold answer is"):
        read_run(f"x={runfile}")


def test_sde2_train_stops_in_seconds_on_a_wrong_reward_url() -> None:
    """The server is checked before the model loads with a few tries of its own, whatever
    --reward-deadline allows the training's requests."""
    from tests.server_process import free_port
    from trainer_client import train
    from trainer_client.retry import RewardServiceError

    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RewardServiceError, match=r"get info after 3 attempt"):
        train.build_trainer(train.build_parser().parse_args(["--model", "x", "--reward-url", dead]))
    assert time.monotonic() - start < 15


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


GSM = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
MED = {"question": "q", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": 0}


@pytest.mark.parametrize(
    ("dataset", "bad", "message"),
    [
        (
            "gsm8k",
            {**GSM, "question": None},
            "line 2: question: must be a non-empty string, got null",
        ),
        ("gsm8k", {**GSM, "question": "  "}, "line 2: question: must be a non-empty string"),
        (
            "gsm8k",
            {**GSM, "answer": "blah ####  "},
            "line 2: answer: GSM8K answer with nothing after",
        ),
        ("gsm8k", {**GSM, "answer": 5}, "line 2: answer: must be a non-empty string, got 5"),
        ("gsm8k", [1, 2], "line 2: expected a JSON object, got array"),
        ("medmcqa", {**MED, "cop": 1.7}, "line 2: cop: must be an integer option index from 0"),
        ("medmcqa", {**MED, "cop": True}, "line 2: cop: must be an integer option index"),
        ("medmcqa", {**MED, "cop": None}, "line 2: cop: must be an integer option index"),
        ("medmcqa", {**MED, "cop": "e"}, "line 2: cop: 'e' is not an option letter A-D"),
        ("medmcqa", {**MED, "cop": "AB"}, "line 2: cop: 'AB' is not an option letter A-D"),
        ("medmcqa", {**MED, "opa": None}, "line 2: opa: must be a string, got null"),
        ("medmcqa", {**MED, "question": None}, "line 2: question: must be a non-empty string"),
        ("aime", {"Problem": "p", "Answer": 12.9}, "line 2: answer: an AIME answer is an integer"),
        ("aime", {"Problem": "p", "Answer": True}, "line 2: answer: an AIME answer is an integer"),
        ("aime", {"Problem": "", "Answer": 12}, "line 2: problem: must be a non-empty string"),
    ],
)
def test_bad_rows_are_refused_naming_file_line_and_field(
    tmp_path: Path, dataset: str, bad: object, message: str
) -> None:
    good = {"gsm8k": GSM, "medmcqa": MED, "aime": {"Problem": "p", "Answer": "7"}}[dataset]
    data = write_rows(tmp_path / "d.jsonl", [good, bad])
    with pytest.raises(ValueError, match=re.escape(f"{data}: {message}")):
        load_examples(dataset, data)  # type: ignore[arg-type]


def test_data_lines_split_on_newlines_only_and_a_bom_is_accepted(tmp_path: Path) -> None:
    """U+2028 may stand in a JSON string: it ends no line, so the line numbers hold."""
    data = tmp_path / "d.jsonl"
    first = json.dumps({**GSM, "question": "a\u2028b"}, ensure_ascii=False)
    data.write_text("\ufeff" + first + "\r\n" + json.dumps(GSM) + "\n", encoding="utf-8")
    assert [e.question for e in load_examples("gsm8k", data)] == ["a\u2028b", GSM["question"]]
    data.write_text(first + "\n" + json.dumps({**GSM, "question": None}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{data}: line 2: question")):
        load_examples("gsm8k", data)


@pytest.mark.parametrize("source", ["no_such.jsonl", "data/none.parquet", "a/b/c", "x.csv"])
def test_a_missing_file_is_never_taken_for_a_hub_id(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # any hub access fails the test
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_examples("gsm8k", source)


def dead_url() -> str:
    from tests.server_process import free_port

    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-length", "64", "--max-new-tokens", "64"], "--max-length (64) must exceed"),
        (["--resume", "{tmp}/no-checkpoint"], "--resume: no checkpoint folder"),
        (["--weight", "sd"], "--weight must look like key=value"),
        (["--weight", "sd=abc"], "--param/--weight: weights.sd:"),
        (["--param", "similarity_threshold=2"], "--param/--weight: similarity_threshold:"),
        (["--param", "weights=5", "--weight", "sd=0"], "--param weights must be a JSON object"),
        (["--data", "{tmp}/none.jsonl"], "--data: no such file or folder"),
        (["--data", "{tmp}/bad.jsonl"], "--data: {tmp}/bad.jsonl: line 2: question"),
        (["--reward-url", "localhost:1"], "--reward-url: reward server URL must start with"),
        (["--output-dir", "{tmp}/bad.jsonl"], "--output-dir {tmp}/bad.jsonl: is a file"),
        (
            ["--output-dir", "{tmp}/bad.jsonl/run/out"],
            "--output-dir {tmp}/bad.jsonl/run/out: {tmp}/bad.jsonl is a file, not a folder",
        ),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--sample", "0"], "--sample must be >= 1"),
        (["--sample", "2", "--limit", "2"], "--limit and --sample: give one"),
        (["--sample", "999"], "--sample 999: the data holds 400 questions"),
        (["--model", "{tmp}/typo"], "--model: no such file or folder: {tmp}/typo"),
        (["--model", "./typo"], "--model: no such file or folder: ./typo"),
        (["--recipe", "cfee", "--weight", "sd=0"], "--weight sd: not a component of recipe 'cfee'"),
        (
            ["--batch-size", "6", "--num-generations", "4"],
            "--batch-size (6) x --grad-accum (1) x 1 process(es) = 6 completions a generation, "
            "not a multiple of --num-generations (4)",
        ),
        (
            ["--batch-size", "2", "--grad-accum", "3", "--num-generations", "4"],
            "--batch-size (2) x --grad-accum (3) x 1 process(es) = 6 completions",
        ),
        (["--num-generations", "1"], "TRL's GRPOConfig refuses these flags"),
        (["--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), got 1.0"),
        (["--grad-accum", "0"], "--grad-accum must be >= 1, got 0"),
        (["--lora-r", "0"], "--lora-r must be >= 1, got 0"),
        (["--report-to", "nonexistent"], "--report-to: nonexistent is not supported"),
        (["--lora-dropout", "2"], "--lora-dropout must be in [0, 1), got 2.0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--reward-timeout", "0"], "--reward-timeout must be a number of seconds > 0, got 0.0"),
        (["--reward-timeout", "nan"], "--reward-timeout must be a number of seconds > 0"),
        (["--reward-retries", "0"], "--reward-retries: max_attempts must be >= 1"),
        (["--reward-deadline", "-5"], "--reward-deadline: deadline must be a finite number"),
        (["--lora-alpha", "0"], "--lora-alpha must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
        (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["--lr=-1e-5"], "--lr must be a finite number > 0, got -1e-05"),
        (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number >= 0, got nan"),
        (["--beta", "-0.1"], "--beta must be a finite number >= 0, got -0.1"),
        (["--output-dir", "{tmp}/run"], "--output-dir {tmp}/run holds checkpoints of an earlier"),
        # Each of these passed, then trained nothing (exit 0), one step, or failed once loaded.
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
        (["--max-steps", "0"], "--max-steps must be >= 1, or -1 to run --epochs, got 0"),
        (["--max-steps", "-7"], "--max-steps must be >= 1, or -1 to run --epochs, got -7"),
        (
            ["--epochs", "nan"],
            "--epochs must be a finite number > 0 (with --max-steps -1), got nan",
        ),
        (["--epochs", "0"], "--epochs must be a finite number > 0 (with --max-steps -1), got 0.0"),
        (
            ["--limit", "1", "--num-generations", "2", "--batch-size", "4"],
            "the data holds 1 prompt(s) (after --limit/--sample), one step takes 2",
        ),
        # A finished run's adapter and record were replaced without a word.
        (["--output-dir", "{tmp}/done"], "--output-dir {tmp}/done holds an earlier run (final)"),
        (
            ["--resume", "{tmp}/run"],
            "--resume {tmp}/run: not a whole checkpoint (no trainer_state.json); its "
            "checkpoints: checkpoint-500",
        ),
        (
            ["--output-dir", "{tmp}/past", "--resume", "--max-steps", "2"],
            "--resume: {tmp}/past/checkpoint-5 is at step 5, --max-steps 2: nothing left",
        ),
    ],
)
def test_sde2_train_checks_arguments_and_data_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """An argparse error (usage, message, status 2) in moments: no server probe, no model
    load (the model does not exist), no output folder."""
    from trainer_client.train import main

    write_rows(tmp_path / "bad.jsonl", [GSM, {**GSM, "question": None}])
    (tmp_path / "run" / "checkpoint-500").mkdir(parents=True)  # an earlier run's
    (tmp_path / "done" / "final").mkdir(parents=True)  # a finished run's
    (tmp_path / "past" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "past" / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    out = tmp_path / "out"
    argv = ["--model", "no-such-org/no-model", "--reward-url", dead_url()]
    argv += ["--data", str(GSM8K_DIR), "--output-dir", str(out)]
    start = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main([*argv, *(a.format(tmp=tmp_path) for a in extra)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sde2-train") and message.format(tmp=tmp_path) in err
    assert not out.exists() and time.monotonic() - start < 20  # TRL's import included


def test_sde2_train_reports_a_wrong_reward_url_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer_client.train import main

    argv = ["--model", "no-such-org/no-model", "--reward-url", dead_url()]
    argv += ["--data", str(GSM8K_DIR), "--limit", "2", "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sde2-train: reward service failed to get info after 3 attempt")
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_every_flag_says_what_it_is_and_its_default_once(command: str) -> None:
    """``--lr``, ``--lora-r``, ``--epochs``... had no help, so ``--help`` showed neither what
    they are nor the paper's values they default to; ``--batch-size`` said its default twice,
    ``(default: G) (default: None)``."""
    import importlib

    parser = importlib.import_module(f"trainer_client.{command}").build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    text = " ".join(parser.format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--lr LR learning rate (default: 5e-06)" in text or command == "evaluate"
    help_of = {"train": "paper: 0.90-0.95", "evaluate": "nucleus sampling"}[command]
    assert f"--top-p TOP_P {help_of} (default: 0.95)" in text
