"""``sde2-eval --completions``: a wrong value in a run file is refused naming the file, the line
and the field (ACC and #TOK are evaluation signal: nothing is coerced), bad arguments stop the
command before any scoring, and a refused request is one line carrying the server's reason."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from trainer_client import evaluate
from trainer_client.evaluate import main, read_run
from trainer_client.results import ItemDiagnostics
from trainer_client.retry import Attempt, RewardRequestError

GOOD = {"completion": "<final_answer>4</final_answer>", "answer": "4"}
URL = "http://127.0.0.1:9"  # never contacted: the client is a double


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
        ({"num_tokens": 9.9}, "line 2: num_tokens: must be an integer >= 0, got 9.9"),
        ({"num_tokens": -5}, "line 2: num_tokens: must be an integer >= 0, got -5"),
        ({"num_tokens": "ten"}, 'line 2: num_tokens: must be an integer >= 0, got "ten"'),
        ({"num_tokens": True}, "line 2: num_tokens: must be an integer >= 0, got true"),
        ({"answer_type": None}, "line 2: answer_type: one of numeric, choice, exact, math"),
    ],
)
def test_wrong_types_are_refused_naming_file_line_and_field(
    tmp_path: Path, bad: dict[str, object], message: str
) -> None:
    good = {**GOOD, "num_tokens": 3} if "num_tokens" in bad else GOOD
    runfile = write_run(tmp_path / "r.jsonl", [good, {**GOOD, **bad}])
    with pytest.raises(ValueError, match=f"r\\.jsonl: {message}"):
        read_run(f"x={runfile}")


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
        (b'{"completion": "a\\ud800", "answer": "1"}\n', "line 1: not JSON"),
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
    refuse: ClassVar[bool] = False

    def __init__(self, urls: object, retry: object = None) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass

    def score(self, items: list[dict[str, Any]], **kwargs: object) -> SimpleNamespace:
        if FakeClient.refuse:
            body = '{"detail":[{"loc":["recipe"],"msg":"Input should be \'sde2\'"}]}'
            raise RewardRequestError(
                "reward service rejected the request to score", [Attempt(URL, 422, body)]
            )
        FakeClient.requests.append(items)
        return SimpleNamespace(items=[ItemDiagnostics(0, None, False, False) for _ in items])


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeClient]:
    FakeClient.requests, FakeClient.refuse = [], False
    monkeypatch.setattr(evaluate, "RewardClient", FakeClient)
    return FakeClient


def test_limit_applies_to_read_runs(tmp_path: Path, fake_client: type[FakeClient]) -> None:
    runfile = write_run(tmp_path / "r.jsonl", [GOOD] * 5)
    assert main(["--reward-url", URL, "--completions", f"x={runfile}", "--limit", "2"]) == 0
    assert [len(r) for r in fake_client.requests] == [2]


def test_a_refused_request_is_one_line_with_the_servers_reason(
    tmp_path: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_client.refuse = True
    runfile = write_run(tmp_path / "r.jsonl", [GOOD])
    argv = ["--reward-url", URL, "--completions", f"x={runfile}", "--recipe", "nope"]
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
