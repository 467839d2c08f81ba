"""``sde2-reward score`` and ``explain`` on hostile inputs and outputs: lines parsed as the server
parses them (a lone surrogate is refused, naming the file and line), arguments checked before any
work, and an output that is either written whole or left as it was."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reward_server.cli import main
from tests.hostile import PATHOLOGICAL_MATH

REPO = Path(__file__).resolve().parents[1]
GOOD = {"completion": "<answer>4</answer>", "answer": "4"}
#: A lone surrogate escape: valid for json.loads, a 422 for the server.
SURROGATE_LINE = '{"completion": "<answer>4\\ud800</answer>", "answer": "4"}'


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def score_argv(src: Path, out: str | Path, *extra: str) -> list[str]:
    """A score command that needs no encoder (the cfl recipe)."""
    return ["score", "--in", str(src), "--out", str(out), "--recipe", "cfl", "--quiet", *extra]


def run_cli(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """``sde2-reward`` in a child process (for pipes and resource limits)."""
    cmd = [sys.executable, "-m", "reward_server.cli", *argv]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run(cmd, cwd=REPO, timeout=120, check=False, **streams)


def test_a_lone_surrogate_is_refused_naming_file_and_line_and_the_old_output_stays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)] * 3 + [SURROGATE_LINE])
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    assert main(score_argv(src, out)) == 2
    err = capsys.readouterr().err
    assert f"{src}: line 4: completion: not valid UTF-8 at character 9: a lone surrogate" in err
    assert out.read_text() == "previous\n"
    assert main(["explain", "--in", str(src), "--quiet"]) == 2
    assert f"{src}: line 4: completion: not valid UTF-8" in capsys.readouterr().err


def test_reading_accepts_a_bom_and_names_lines_not_byte_offsets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode() * 2)
    assert main(score_argv(src, "-")) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    # Two such files joined (`cat a.jsonl b.jsonl`): the second BOM opens line 3.
    src.write_bytes(src.read_bytes() * 2)
    assert main(score_argv(src, "-")) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
    latin1 = json.dumps({"completion": "caf\u00e9", "answer": "4"}, ensure_ascii=False).encode(
        "latin-1"
    )
    src.write_bytes(b"\n".join([json.dumps(GOOD).encode(), b"", latin1]) + b"\n")
    assert main(score_argv(src, "-")) == 2
    assert f"{src}: line 3: not UTF-8 (byte 0xe9 at column 20)" in capsys.readouterr().err


def test_an_item_index_error_is_reported_as_the_files_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``items.1.group`` is the second item, on line 3 after a blank line."""
    src = write_lines(
        tmp_path / "in.jsonl", [json.dumps({**GOOD, "group": "g"}), "", json.dumps(GOOD)]
    )
    assert main(score_argv(src, "-")) == 2
    assert f"{src}: line 3: group: either every item carries a group id" in capsys.readouterr().err
    # The odd one out is named: one grouped line among ungrouped ones was told as line 1.
    src = write_lines(
        tmp_path / "in.jsonl", [json.dumps(GOOD)] * 2 + [json.dumps({**GOOD, "group": "g"})]
    )
    assert main(score_argv(src, "-")) == 2
    assert (
        f"{src}: line 3: group: either every item carries a group id or none does (1 of 3 do)"
        in (capsys.readouterr().err)
    )
    assert main(["explain", "--in", str(src), "--quiet"]) == 2
    assert f"{src}: line 3: group:" in capsys.readouterr().err


def test_an_unknown_field_is_named_in_the_servers_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt field is refused with the message the server sends for it ("Unexpected
    keyword argument" before: an item is a validating dataclass)."""
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "answr": 4})])
    assert main(score_argv(src, "-")) == 2
    assert f"{src}: line 2: answr: Extra inputs are not permitted" in capsys.readouterr().err
    assert main(["explain", "--in", str(src), "--quiet"]) == 2
    assert f"{src}: line 2: answr: Extra inputs are not permitted" in capsys.readouterr().err
    # In place of a required field, the misspelling is named (with the meant field), not the
    # field it left missing; as the server's 422 names both.
    typo = {"completion": GOOD["completion"], "answr": "4"}
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD), json.dumps(typo)])
    assert main(score_argv(src, "-")) == 2
    said = capsys.readouterr().err
    assert "line 2: answr: Extra inputs are not permitted (did you mean 'answer'?)" in said
    assert "(and 1 more)" in said
    # A misspelt parameter too.
    assert main([*score_argv(src, "-"), "--params", '{"explore_cp": 0.7}']) == 2
    assert "--params: explore_cp: Extra inputs are not permitted (did you mean 'explore_cap'?)" in (
        capsys.readouterr().err
    )


def test_a_gold_no_answer_can_match_is_scored_with_a_warning_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A "####" gold is scored as SPEC §2 defines it (a 422 on the server before), and both
    commands say so on stderr, naming the file and line (exit 0, the output written)."""
    bad = {"completion": "<final_answer>.</final_answer>", "answer": "####"}
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD), "", json.dumps(bad)])
    out = tmp_path / "out.jsonl"
    assert main(score_argv(src, out)) == 0
    err = capsys.readouterr().err
    assert f"warning: {src}: line 3: answer: the gold answer '####' is empty" in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["correct"] for r in records] == [True, True]  # N("####") = N(".") = ""
    assert main(["explain", "--in", str(src), "--quiet", "--recipe", "cfl"]) == 0
    assert f"warning: {src}: line 3: answer:" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "1e300"])
@pytest.mark.parametrize("command", ["score", "explain"])
def test_math_timeout_must_be_a_finite_positive_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, value: str
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)])
    argv = ["--in", str(src), "--quiet", "--math-timeout", value]
    with pytest.raises(SystemExit) as exc:
        main([command, *argv, *(["--out", "-"] if command == "score" else [])])
    assert exc.value.code == 2
    assert "argument --math-timeout: must be a finite number of seconds > 0" in (
        capsys.readouterr().err
    )


def test_explain_reports_timed_out_math_checks_as_score_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"completion": f"<answer>{PATHOLOGICAL_MATH[0]}</answer>", "answer": "$5$"}]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    argv = ["explain", "--in", str(src), "--quiet", "--answer-type", "math", "--recipe", "cfl"]
    assert main([*argv, "--math-timeout", "1"]) == 0
    assert "1 math check ran past 1.0 s, counted as not equivalent" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("adir", "--out {tmp}/adir: is a folder"),
        ("nope/x.jsonl", "--out {tmp}/nope/x.jsonl: no folder {tmp}/nope\n"),
        # A link to a missing folder: that folder is named, not the link's (which exists).
        ("dangling.jsonl", "--out {tmp}/dangling.jsonl: no folder {tmp}/gone\n"),
    ],
)
def test_an_unwritable_out_is_refused_before_the_input_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, message: str
) -> None:
    (tmp_path / "adir").mkdir()
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone" / "x.jsonl")
    src = write_lines(tmp_path / "in.jsonl", ["not json"])  # never read
    assert main(score_argv(src, tmp_path / out)) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "line 1" not in err


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("adir", "--in {tmp}/adir: is a folder; name a JSONL file"),
        ("none.jsonl", "--in {tmp}/none.jsonl: no such file"),
    ],
)
@pytest.mark.parametrize("command", ["score", "explain"])
def test_an_input_that_is_no_file_is_named_by_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, given: str, message: str
) -> None:
    """It was the OS's words, ``[Errno 21] Is a directory: '...'``, naming no flag."""
    (tmp_path / "adir").mkdir()
    argv = ["--in", str(tmp_path / given)] + (["--out", "-"] if command == "score" else [])
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"sde2-reward {command}: {message.format(tmp=tmp_path)}\n"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/nonexistent/model", "--model: model '/nonexistent/model': no such folder"),
        ("{tmp}", "--model: {tmp} is neither an ONNX export (no manifest.json) nor a model folder"),
    ],
)
def test_a_model_that_is_no_model_is_refused_before_the_input_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, message: str
) -> None:
    src = write_lines(tmp_path / "in.jsonl", ["not json"])  # never read
    model = model.format(tmp=tmp_path)
    assert main(score_argv(src, "-", "--model", model)) == 2
    assert main(["explain", "--in", str(src), "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.count(message.format(tmp=tmp_path)) == 2 and "line 1" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_is_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)])
    assert main(score_argv(src, "/dev/full")) == 1
    assert "sde2-reward score: cannot write /dev/full: No space left on device" in (
        capsys.readouterr().err
    )


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path: Path) -> None:
    """The file size limit stops the write after 64 kB: no partial file that looks complete."""
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)] * 2000)  # ~600 kB of output
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))

    proc = run_cli(*score_argv(src, out), preexec_fn=limit_file_size)
    assert proc.returncode == 1
    assert proc.stderr.decode().strip() == f"sde2-reward score: cannot write {out}: File too large"
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``sde2-reward score --out - | head`` once head has gone: no traceback, SIGPIPE's status."""
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)] * 50)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = run_cli(*score_argv(src, "-"), stdout=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == b""


@pytest.mark.parametrize("command", ["score", "explain"])
def test_a_damaged_model_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """An export whose graph no longer matches its manifest passes the early --model check
    (it is an export) and is refused when the encoder loads: one line naming the file, exit
    status 2, no traceback."""
    import shutil

    from tests.service_fixtures import real_model_dir

    damaged = tmp_path / "damaged"
    shutil.copytree(real_model_dir(), damaged)
    graph = damaged / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    graph.write_bytes(bytes(data))
    block = "<strategy><reasoning>{}</reasoning><strategy_outcome>1</strategy_outcome></strategy>"
    completion = block.format("add them") + block.format("count up")  # needs the encoder
    src = write_lines(
        tmp_path / "in.jsonl", [json.dumps({"completion": completion, "answer": "2"})]
    )
    argv = [command, "--in", str(src), "--model", str(damaged), "--quiet"]
    assert main([*argv, "--out", "-"] if command == "score" else argv) == 2
    err = capsys.readouterr().err
    assert f"{graph}: sha256" in err and "does not match manifest.json" in err
    assert "Traceback" not in err


def test_an_out_that_is_the_input_is_refused_and_the_input_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` naming the ``--in`` file (or a link to it) replaced the input with the scores,
    exit 0."""
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)])
    (tmp_path / "link.jsonl").symlink_to(src)
    for out in (src, tmp_path / "link.jsonl", tmp_path / "." / "in.jsonl"):
        assert main(score_argv(src, out)) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: is the --in file; writing it would replace what it reads" in err
        assert json.loads(src.read_text()) == GOOD
    assert main(score_argv(src, tmp_path / "out.jsonl")) == 0


def test_a_sigterm_while_writing_leaves_no_temporary_file(tmp_path: Path) -> None:
    """``timeout`` and batch schedulers stop a job with SIGTERM: the process ended at once
    and left a partial ``.NAME.*.tmp`` beside the output; it now exits 143 without it, the
    previous output as it was."""
    out = tmp_path / "o.jsonl"
    out.write_text("previous\n")
    script = f"""
import os, signal
from pathlib import Path
from reward_server.jsonl_files import write_atomically

def lines():
    yield "first\\n"
    os.kill(os.getpid(), signal.SIGTERM)
    yield "never\\n"

write_atomically(Path({str(out)!r}), lines())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60, check=False)
    assert done.returncode == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
    assert out.read_text() == "previous\n"


@pytest.mark.parametrize("command", ["score", "explain"])
def test_ctrl_c_is_one_line_and_exit_130(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C during a long file command printed some twenty lines of traceback through the
    encoder's worker threads; the output file is left as it was."""
    from reward_server import explain_report, offline

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    for module in (offline, explain_report):
        monkeypatch.setattr(module, "prepare_input", interrupted)
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(GOOD)])
    out = tmp_path / "o.jsonl"
    out.write_text("previous\n")
    argv = score_argv(src, out) if command == "score" else ["explain", "--in", str(src)]
    assert main(argv) == 130
    assert capsys.readouterr().err == (
        f"sde2-reward {command}: stopped (Ctrl-C); an output file is left as it was\n"
    )
    assert out.read_text() == "previous\n"


def test_each_record_names_the_input_line_it_answers(tmp_path: Path) -> None:
    """Blank lines are no items: the second record answered line 3, and nothing in the output
    said so (joining by line number paired results with the wrong inputs)."""
    src = tmp_path / "in.jsonl"
    src.write_text(f"{json.dumps(GOOD)}\n\n{json.dumps({**GOOD, 'answer': '5'})}\n")
    out = tmp_path / "out.jsonl"
    assert main(score_argv(src, out)) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["line"], r["correct"]) for r in records] == [(1, True), (3, False)]


@pytest.mark.parametrize("command", ["score", "explain"])
def test_stdin_as_input_is_refused_naming_what_works(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """``--in -`` read "no such file" (``--out -`` is stdout)."""
    assert main([command, "--in", "-", *(["--out", "-"] if command == "score" else [])]) == 2
    assert (
        "--in -: not read from stdin; name a JSONL file (or /dev/stdin)" in capsys.readouterr().err
    )


def test_math_checks_show_their_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A check takes ~10 ms in its worker: a file of 100k items was a quarter hour of silence
    before the encoder's bar."""
    rows = [
        {"completion": f"<answer>{k}/2</answer>", "answer": f"$\\frac{{{k}}}{{2}}$"}
        for k in range(3)
    ]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    argv = ["score", "--in", str(src), "--out", "-", "--recipe", "cfl", "--answer-type", "math"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["correct"] for line in out.splitlines()] == [True] * 3
    assert "math checks: " in err and "3check" in err
    assert main([*argv, "--quiet"]) == 0
    assert "math checks" not in capsys.readouterr().err
