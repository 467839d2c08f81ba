"""``sde2-eval --completions``: a wrong value in a run file is refused naming the file, the line
and the field (ACC and #TOK are evaluation signal: nothing is coerced), bad arguments stop the
command before any scoring, and a refused request is one line carrying the server's reason."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from trainer_client import client as client_module
from trainer_client import evaluate
from trainer_client.evaluate import Run, generated_label, main, read_run
from trainer_client.results import ItemDiagnostics
from trainer_client.retry import Attempt, RewardRequestError, RewardServiceError

GOOD = {"completion": "<final_answer>4</final_answer>", "answer": "4"}
URL = "http://127.0.0.1:9"  # never contacted: the client is a double
GSM8K_DIR = Path(__file__).resolve().parents[1] / "reward_server" / "data" / "gsm8k"


def write_run(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"completion": None}, "line 2: completion: must be a string, got null"),
        ({"completion": 72}, "line 2: completion: must be a string, got number"),
        ({"completion": ["a"]}, "line 2: completion: must be a string, got array"),
        ({"completion": None, "answer": "4"}, "line 2: completion: must be a string"),
        ({"num_tokens": 9.9}, "line 2: num_tokens: must be an integer from 0 to 2^63-1, got 9.9"),
        ({"num_tokens": -5}, "line 2: num_tokens: must be an integer from 0 to 2^63-1, got -5"),
        (
            {"num_tokens": "ten"},
            'line 2: num_tokens: must be an integer from 0 to 2^63-1, got "ten"',
        ),
        ({"num_tokens": True}, "line 2: num_tokens: must be an integer from 0 to 2^63-1, got true"),
        ({"answer_type": None}, "line 2: answer_type: one of numeric, choice, exact, math"),
        (  # #TOK is a mean of them: one past a float's range ended the run after scoring
            {"num_tokens": 10**400},
            "line 2: num_tokens: must be an integer from 0 to 2^63-1, got 1000000000... (401 ",
        ),
    ],
)
def test_wrong_types_are_refused_naming_file_line_and_field(
    tmp_path: Path, bad: dict[str, object], message: str
) -> None:
    good = {**GOOD, "num_tokens": 3} if "num_tokens" in bad else GOOD
    runfile = write_run(tmp_path / "r.jsonl", [good, {**GOOD, **bad}])
    with pytest.raises(ValueError, match=re.escape(f"r.jsonl: {message}")):
        read_run(f"x={runfile}")


def test_an_unknown_field_is_refused_naming_file_line_and_field(tmp_path: Path) -> None:
    """A misspelt field was ignored: ``answer_typo`` left the line on --dataset's matcher.
    ``sde2-reward score``'s own item fields (``prompt``, ``group``) are accepted."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD, {**GOOD, "answer_typo": "choice"}])
    with pytest.raises(ValueError, match=r"r\.jsonl: line 2: answer_typo: not a field of a run"):
        read_run(f"x={runfile}")
    scored_as_is = write_run(runfile, [{**GOOD, "prompt": "2 + 2?", "group": "q1"}])
    assert read_run(f"x={scored_as_is}").answers == ["4"]


def test_num_tokens_on_some_lines_only_is_refused_naming_the_lines(tmp_path: Path) -> None:
    rows = [{**GOOD, "num_tokens": 3}, GOOD, {**GOOD, "num_tokens": 0}, GOOD]
    runfile = write_run(tmp_path / "r.jsonl", rows)
    with pytest.raises(ValueError, match=r"r\.jsonl: num_tokens is missing on lines 2, 4"):
        read_run(f"x={runfile}")
    assert read_run(f"x={write_run(runfile, [GOOD, GOOD])}").num_tokens is None
    counted = write_run(runfile, [{**GOOD, "num_tokens": 0}, {**GOOD, "num_tokens": 7}])
    assert read_run(f"x={counted}").num_tokens == [0, 7]


def test_lines_are_split_on_newlines_only_and_a_bom_is_accepted(tmp_path: Path) -> None:
    """U+2028 and U+0085 may stand in a JSON string: they end no line, so line numbers hold."""
    runfile = tmp_path / "r.jsonl"
    first = json.dumps({**GOOD, "completion": "a\u2028b\x85c"}, ensure_ascii=False)
    runfile.write_text("\ufeff" + first + "\n" + json.dumps(GOOD) + "\r\n", encoding="utf-8")
    run = read_run(f"x={runfile}")
    assert run.completions == ["a\u2028b\x85c", GOOD["completion"]]
    runfile.write_text(first + "\n" + json.dumps({"completion": None}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"r\.jsonl: line 2: completion"):
        read_run(f"x={runfile}")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"completion": "a", "answer": "1"}\n{"completion": "x", "answer": \n',
            "line 2: not JSON",
        ),
        (b'{"completion": "a", "answer": "1"}\n[1]\n', "line 2: expected a JSON object, got array"),
        (
            b'{"completion": "a", "answer": "1"}\n{"completion": "caf\xe9", "answer": "1"}\n',
            "line 2: not UTF-8",
        ),
        (
            b'{"completion": "a\\ud800", "answer": "1"}\n',
            "line 1: completion: not valid UTF-8 at character 1",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, content: bytes, message: str) -> None:
    runfile = tmp_path / "r.jsonl"
    runfile.write_bytes(content)
    with pytest.raises(ValueError, match=f"r\\.jsonl: {message}"):
        read_run(f"x={runfile}")


class FakeClient:
    """The reward client's double: records the items of each request, or refuses them."""

    requests: ClassVar[list[list[dict[str, Any]]]] = []
    #: Each request's options (recipe, params...), as sent.
    options: ClassVar[list[dict[str, Any]]] = []
    refuse: ClassVar[bool] = False
    fail: ClassVar[bool] = False  # the server stays down past the retries
    down: ClassVar[bool] = False
    interrupt: ClassVar[bool] = False  # Ctrl-C while the retries wait

    def __init__(self, urls: object, **options: object) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass

    def info(self, **kwargs: object) -> dict[str, Any]:
        if FakeClient.down:
            raise RewardServiceError("reward service failed to get info", [Attempt(URL, None, "")])
        return {"encoder": "fake"}

    def score(self, items: list[dict[str, Any]], **kwargs: object) -> SimpleNamespace:
        if FakeClient.interrupt:
            raise KeyboardInterrupt
        if FakeClient.refuse:
            body = '{"detail":[{"loc":["recipe"],"msg":"Input should be \'sde2\'"}]}'
            raise RewardRequestError(
                "reward service rejected the request to score", [Attempt(URL, 422, body)]
            )
        if FakeClient.fail:
            raise RewardServiceError(
                "reward service failed to score", [Attempt(URL, 503, "busy")] * 3
            )
        FakeClient.requests.append(items)
        FakeClient.options.append(kwargs)
        items_out = [ItemDiagnostics(0, None, False, False) for _ in items]
        params = {"similarity_threshold": 0.8, **(kwargs.get("params") or {})}  # type: ignore[dict-item]
        return SimpleNamespace(items=items_out, warnings=[], params=params, encoder="fake")


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeClient]:
    FakeClient.requests, FakeClient.refuse, FakeClient.down = [], False, False
    FakeClient.interrupt, FakeClient.fail, FakeClient.options = False, False, []
    monkeypatch.setattr(evaluate, "RewardClient", FakeClient)
    monkeypatch.setattr(client_module, "RewardClient", FakeClient)  # the start-up probe's
    return FakeClient


def test_runs_are_told_apart_and_scoring_failures_named(
    tmp_path: Path,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two runs of one name made two rows no one could tell apart; a server that stayed down
    failed the command without saying which run's lines; a file of option letters read with
    the numeric matcher scored quietly low; --json did not say which δ the Uniq was counted
    at, nor which encoder."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD] * 3)
    with pytest.raises(SystemExit):
        main(
            ["--reward-url", URL, "--completions", f"a={runfile}", "--completions", f"a={runfile}"]
        )
    assert "two runs named 'a'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reward-url", URL, "--completions", f"a={runfile}", "--reward-deadline", "0"])
    assert "--reward-deadline must be a number of seconds > 0" in capsys.readouterr().err
    fake_client.fail = True
    assert main(["--reward-url", URL, "--completions", f"a={runfile}"]) == 2
    assert f"sde2-eval: {runfile}: lines 1-3: reward service failed to score" in (
        capsys.readouterr().err
    )
    fake_client.fail = False
    letters = write_run(tmp_path / "m.jsonl", [{"completion": "(B) Paris", "answer": "B"}] * 2)
    out = tmp_path / "eval.json"
    argv = ["--reward-url", URL, "--completions", f"m={letters}", "--json", str(out)]
    with caplog.at_level(logging.WARNING, logger="sde2.eval"):
        assert main([*argv, "--param", "similarity_threshold=0.7"]) == 0
    assert "every gold answer is an option letter" in caplog.text
    assert "--dataset medmcqa" in caplog.text
    scored_with = json.loads(out.read_text())["meta"]["scored_with"]
    assert scored_with == {"params": {"similarity_threshold": 0.7}, "encoder": "fake"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sde2.eval"):
        assert main([*argv, "--dataset", "medmcqa"]) == 0
    assert "option letter" not in caplog.text


def test_limit_applies_to_read_runs(tmp_path: Path, fake_client: type[FakeClient]) -> None:
    runfile = write_run(tmp_path / "r.jsonl", [GOOD] * 5)
    assert main(["--reward-url", URL, "--completions", f"x={runfile}", "--limit", "2"]) == 0
    assert [len(r) for r in fake_client.requests] == [2]


def test_a_plot_without_token_counts_is_not_written(
    tmp_path: Path, fake_client: type[FakeClient], caplog: pytest.LogCaptureFixture
) -> None:
    """Runs without ``num_tokens`` (and no ``--tokenizer``) have no #TOK to place them by: an
    empty chart was written and reported as the plot."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD] * 2)
    plot = tmp_path / "p.png"
    argv = ["--reward-url", URL, "--completions", f"a={runfile}", "--completions", f"b={runfile}"]
    with caplog.at_level("WARNING", logger="sde2.eval"):
        assert main([*argv, "--plot", str(plot)]) == 0
    assert not plot.exists() and "none of the runs have token counts" in caplog.text


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("-", "a plot is an image file, not stdout"),
        ("{tmp}/chart", "name the image with one of the suffixes"),  # matplotlib wrote chart.png
        ("{tmp}/chart.txt", "name the image with one of the suffixes"),  # a traceback after all
    ],
)
def test_a_plot_path_that_cannot_take_the_image_stops_before_scoring(
    tmp_path: Path,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
    plot: str,
    message: str,
) -> None:
    runfile = write_run(tmp_path / "r.jsonl", [{**GOOD, "num_tokens": 3}] * 2)
    argv = ["--reward-url", URL, "--completions", f"a={runfile}", "--completions", f"b={runfile}"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--plot", plot.format(tmp=tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert fake_client.requests == [] and not list(tmp_path.glob("chart*"))
    svg = tmp_path / "chart.SVG"  # the suffix's format, whatever its case
    assert main([*argv, "--plot", str(svg)]) == 0
    assert svg.read_bytes().lstrip().startswith(b"<?xml")


def test_json_to_stdout_is_the_json_alone(
    tmp_path: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json -`` printed the Markdown table and then the JSON on stdout: no parser read it."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD] * 2)
    assert main(["--reward-url", URL, "--completions", f"x={runfile}", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["runs"][0]["method"] == "x" and out.endswith("\n")
    assert "| x |" in err


def test_a_refused_request_is_one_line_with_the_servers_reason(
    tmp_path: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_client.refuse = True
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    argv = ["--reward-url", URL, "--completions", f"x={runfile}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sde2-eval: reward service rejected the request") and "\n" not in err
    assert "HTTP 422" in err and "Input should be 'sde2'" in err


def test_unusable_paths_stop_the_command_before_scoring(
    tmp_path: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    assert main(["--reward-url", URL, "--completions", f"x={tmp_path}"]) == 2
    assert f"sde2-eval: {tmp_path}: is a folder" in capsys.readouterr().err
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit) as exc:
            main(["--reward-url", URL, "--completions", f"x={runfile}", flag, str(tmp_path)])
        assert exc.value.code == 2
        assert f"{flag} {tmp_path}: is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reward-url", URL, "--completions", f"x={runfile}", "--limit", "0"])
    assert "--limit must be >= 1" in capsys.readouterr().err
    assert fake_client.requests == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--recipe", "nope"], "argument --recipe: invalid choice: 'nope'"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--model", "./no-model"], "--model: no such file or folder: ./no-model"),
        (["--tokenizer", "/no/tokenizer"], "--tokenizer: no such file or folder: /no/tokenizer"),
        (["--ci", "exact"], "argument --ci: invalid choice: 'exact'"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0: greedy), got"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got"),
        (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    ],
)
def test_arguments_that_cannot_work_stop_before_anything_runs(
    tmp_path: Path,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    """A typo is a usage error at once, never after the generation (a recipe used to be
    refused by the server once every completion was generated)."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    with pytest.raises(SystemExit) as exc:
        main(["--reward-url", URL, "--completions", f"x={runfile}", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert fake_client.requests == []


def _no_generation(*args: object) -> None:
    raise AssertionError("generated before the server was known to answer")


@pytest.mark.parametrize("given", ["{tmp}/runs/no-adapter", "./no-adapter", "{tmp}/r.jsonl"])
def test_an_adapter_that_is_not_there_stops_before_anything_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
    given: str,
) -> None:
    """A misspelt ``--adapter`` was taken for a hub id: the base model loaded and generated
    (minutes), then PEFT failed in a traceback; with ``--completions`` alone its training
    record was silently not read, the runs scored with the defaults instead of its recipe."""
    monkeypatch.setattr(evaluate, "generate_run", _no_generation)
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    adapter = given.format(tmp=tmp_path)
    message = (
        f"--adapter {adapter}: is a file"
        if adapter == str(runfile)
        else f"--adapter: no such file or folder: {adapter}"
    )
    for source in (
        ["--model", "org/model", "--data", str(GSM8K_DIR)],
        ["--completions", f"x={runfile}"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--reward-url", URL, *source, "--adapter", adapter])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert fake_client.requests == []


def test_an_adapter_under_home_given_with_a_tilde_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--adapter=~/run/final`` (no shell expands that "~"): the folder is there, and was
    refused as "no such file or folder"; its training record is read."""
    monkeypatch.setenv("HOME", str(tmp_path))
    adapter = tmp_path / "run" / "final"
    adapter.mkdir(parents=True)
    (adapter / evaluate.TRAINING_RECORD).write_text(json.dumps({"recipe": "cfl"}))
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    parser = evaluate.build_parser()
    argv = ["--reward-url", URL, "--completions", f"x={runfile}", "--adapter=~/run/final"]
    args = parser.parse_args(argv)
    evaluate.check_arguments(parser, args)
    assert args.adapter == str(adapter) and args.recipe == "cfl"


def test_the_server_is_asked_before_generating(
    monkeypatch: pytest.MonkeyPatch,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_client.down = True
    monkeypatch.setattr(evaluate, "generate_run", _no_generation)
    assert main(["--reward-url", URL, "--model", "org/model", "--data", str(GSM8K_DIR)]) == 2
    assert "sde2-eval: reward service failed to get info" in capsys.readouterr().err


def _generated(args: Any, examples: list[Any]) -> tuple[Run, None]:
    completions = [GOOD["completion"]] * len(examples)
    run = Run(generated_label(args), completions, [e.answer for e in examples], "numeric", None)
    run.num_tokens = [3] * len(examples)
    return run, None


def test_a_generated_run_outlives_a_failed_scoring(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_client: type[FakeClient],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Scoring that fails after the generation leaves the completions in a file it names, to
    score again with --completions; a run scored leaves no file behind."""
    monkeypatch.setattr(evaluate, "generate_run", _generated)
    monkeypatch.setattr(evaluate.tempfile, "gettempdir", lambda: str(tmp_path))
    argv = ["--reward-url", URL, "--model", "org/model", "--data", str(GSM8K_DIR), "--limit", "3"]
    fake_client.refuse = True
    assert main(argv) == 2
    err = capsys.readouterr().err
    (kept,) = tmp_path.glob("sde2-eval-*.jsonl")
    assert f"--completions org/model={kept}" in err
    fake_client.refuse = False
    assert main(["--reward-url", URL, "--completions", f"again={kept}"]) == 0
    assert fake_client.requests[-1] == [
        {"completion": GOOD["completion"], "answer": a} for a in ("18", "3", "70000")
    ]
    kept.unlink()
    # Ctrl-C while scoring (a server gone: the retries wait up to 10 minutes) names it too.
    fake_client.interrupt = True
    assert main(argv) == 130
    err = capsys.readouterr().err
    (kept,) = tmp_path.glob("sde2-eval-*.jsonl")
    assert "stopped while scoring" in err and f"--completions org/model={kept}" in err
    fake_client.interrupt = False
    kept.unlink()
    # An output that cannot be written (a full disk) keeps them too.
    assert main([*argv, "--json", "/dev/full"]) == 1
    (kept,) = tmp_path.glob("sde2-eval-*.jsonl")
    assert f"--completions org/model={kept}" in capsys.readouterr().err
    kept.unlink()
    assert main([*argv, "--json", str(tmp_path / "t.json")]) == 0
    assert list(tmp_path.glob("sde2-eval-*.jsonl")) == []
    meta = json.loads((tmp_path / "t.json").read_text())["meta"]
    # The paper's evaluation split by default (GSM8K: test), and what the rows were run with.
    assert (meta["model"], meta["split"], meta["limit"], meta["temperature"]) == (
        "org/model",
        "test",
        3,
        0.2,
    )


def test_runs_are_labelled_by_whole_model_ids_and_their_adapter(tmp_path: Path) -> None:
    """``Path.stem`` cut hub ids at their first dot (``Qwen/Qwen2.5-3B-Instruct`` read
    ``Qwen2``) and gave a base model and its adapter one label."""

    def label(*argv: str) -> str:
        args = evaluate.build_parser().parse_args(["--reward-url", URL, *argv])
        return generated_label(args)

    assert label("--model", "Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"
    assert label("--model", "microsoft/Phi-3.5-mini-instruct") == "microsoft/Phi-3.5-mini-instruct"
    tuned = label("--model", "Qwen/Qwen2.5-3B-Instruct", "--adapter", "outputs/sde2/final")
    assert tuned == "Qwen/Qwen2.5-3B-Instruct+outputs/sde2/final"
    (tmp_path / "m.gguf").write_bytes(b"")
    assert label("--model", str(tmp_path / "m.gguf")) == "m"
    assert label("--model", str(tmp_path)) == tmp_path.name


def test_tokenizer_counts_read_runs_even_with_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_client: type[FakeClient]
) -> None:
    """--tokenizer names the tokenizer of read runs' #TOK; it was ignored next to --model."""
    import trainer_client.modeling as modeling

    def loaded(ref: Any) -> Any:
        width = {"org/tok": 1, "org/model": 100}[ref.name_or_path]
        return lambda text, add_special_tokens: {"input_ids": [0] * width}

    monkeypatch.setattr(evaluate, "generate_run", _generated)
    monkeypatch.setattr(modeling, "load_tokenizer", loaded)
    runfile = write_run(tmp_path / "r.jsonl", [GOOD, GOOD])
    argv = ["--reward-url", URL, "--model", "org/model", "--data", str(GSM8K_DIR), "--limit", "1"]
    argv += ["--completions", f"read={runfile}", "--json", str(tmp_path / "t.json")]
    assert main([*argv, "--tokenizer", "org/tok"]) == 0
    runs = {r["method"]: r for r in json.loads((tmp_path / "t.json").read_text())["runs"]}
    assert runs["read"]["tokens"] == 1.0


def test_an_output_that_is_a_run_file_or_another_output_is_refused(
    tmp_path: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json`` or ``--save-completions`` naming a ``--completions`` file replaced the run
    with the table; two outputs naming one file kept the last one written."""
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    argv = ["--reward-url", URL, "--completions", f"a={runfile}"]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--json", str(runfile)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--json {runfile}: is the --completions file; writing it would replace" in err
    both = tmp_path / "t.out"
    with pytest.raises(SystemExit):
        main([*argv, "--json", str(both), "--plot", str(both)])
    assert f"--plot {both}: is also --json's file" in capsys.readouterr().err
    assert read_run(f"a={runfile}").completions == [GOOD["completion"]]  # as it was


@pytest.mark.slow
def test_dataset_sets_the_matcher_of_read_lines_without_one(
    tmp_path: Path,
    reward_server: ServerProcess,  # noqa: F811
) -> None:
    """``--dataset medmcqa`` was ignored for ``--completions``: a file without ``answer_type``
    was scored by the numeric matcher (ACC 0 for "(B) Aspirin" against B). Now the dataset's
    matcher is the default; a line's own ``answer_type`` wins; without ``--dataset``, numeric."""
    said = ["<final_answer>(B) Aspirin</final_answer>", "<final_answer>Option B</final_answer>"]
    plain = write_run(tmp_path / "mc.jsonl", [{"completion": c, "answer": "B"} for c in said])
    numeric = [{"completion": "<final_answer>B 12</final_answer>", "answer": "12"}] * 2
    typed = write_run(tmp_path / "n.jsonl", [{**r, "answer_type": "numeric"} for r in numeric])

    def acc(*argv: str) -> list[float]:
        out = tmp_path / "table.json"
        assert main(["--reward-url", reward_server.url, "--json", str(out), *argv]) == 0
        return [run["acc"] for run in json.loads(out.read_text())["runs"]]

    runs = ["--completions", f"mc={plain}", "--completions", f"n={typed}"]
    assert acc("--dataset", "medmcqa", *runs) == [100.0, 100.0]
    assert acc(*runs) == [0.0, 100.0]  # numeric by default: "(B) Aspirin" holds no number


@pytest.mark.slow
def test_a_refused_completion_is_named_by_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sde2-eval scores a run in chunks of 256 (and the client may split them further): an
    error named the completion by its index in the piece sent (``items.33.completion`` for
    line 290). Now it names the file and the line (a lone surrogate, which could not be sent,
    is refused when the file is read, naming them too)."""
    from tests.client_fixtures import running_server

    rows: list[object] = [dict(GOOD) for _ in range(300)]
    rows[289] = {**GOOD, "completion": "x" * 200}  # line 290: over the server's limit
    long_run = write_run(tmp_path / "long.jsonl", rows)
    with running_server("--max-completion-chars", "100") as server:
        assert main(["--reward-url", server.url, "--completions", f"a={long_run}"]) == 2
        err = capsys.readouterr().err
        assert f"{long_run}: line 290: completion: at most 100 characters" in err, err


def test_a_gold_warning_is_named_by_its_file_and_line_for_every_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gold no answer matches ("####") is scored, with the server's warning: sde2-eval names
    it by the file and line (it was the index in the 256-completion chunk sent, through the
    client's log) and says it for each run (the client's log said a kind once)."""
    from tests.client_fixtures import running_server

    rows: list[object] = [dict(GOOD) for _ in range(300)]
    rows[299] = {**GOOD, "answer": "####"}  # line 300
    first = write_run(tmp_path / "first.jsonl", rows)
    second = write_run(tmp_path / "second.jsonl", rows)
    with running_server() as server, caplog.at_level(logging.WARNING):
        argv = ["--reward-url", server.url, "--completions", f"a={first}"]
        assert main([*argv, "--completions", f"b={second}"]) == 0
    said = [r.getMessage() for r in caplog.records if "####" in r.getMessage()]
    assert said == [
        f"a: {first}: line 300: answer: the gold answer '####' is empty once canonicalized"
        + said[0].split("canonicalized", 1)[1],
        f"b: {second}: line 300: answer: the gold answer '####' is empty once canonicalized"
        + said[1].split("canonicalized", 1)[1],
    ], said


@pytest.mark.slow
def test_a_warning_about_the_whole_batch_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas with different encoders (onnxruntime and OpenVINO, real servers) warn in every
    answer: sde2-eval said it for each 256-completion chunk of each run, four times here, after
    the start-up probe had said it. Now the probe and the scoring say it once each."""
    from tests.client_fixtures import running_server

    rows: list[object] = [dict(GOOD) for _ in range(300)]
    first = write_run(tmp_path / "first.jsonl", rows)
    second = write_run(tmp_path / "second.jsonl", rows)
    with (
        running_server() as onnx,
        running_server("--backend", "openvino") as openvino,
        caplog.at_level(logging.WARNING),
    ):
        argv = ["--reward-url", onnx.url, "--reward-url", openvino.url]
        assert main([*argv, "--completions", f"a={first}", "--completions", f"b={second}"]) == 0
    said = [r.getMessage() for r in caplog.records if "replicas embed with" in r.getMessage()]
    assert len(said) == 2 and said[0] == said[1], said
    assert said[0].startswith("the reward service warns: encoder: replicas embed with")
