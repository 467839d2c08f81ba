"""The isolated ``math`` matcher: same verdicts as math-verify in process, and a pathological
answer (an integer power that holds the GIL for hours) costs ``time_limit``, not the server."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reward_server.core import ScoreItem, prepare_batch
from reward_server.core.answers import math_equivalent
from reward_server.math_judge import IsolatedMathJudge, MathDeadlineExceeded
from tests.hostile import PATHOLOGICAL_MATH

PAIRS = [
    ("$0.5$", "$\\frac{1}{2}$"),
    ("$\\sqrt{4}$", "$2$"),
    ("$0.4$", "$\\frac{1}{2}$"),
    ("$x^2 + 2x + 1$", "$(x+1)^2$"),
    ("$\\{1, 2\\}$", "$\\{2, 1\\}$"),
    ("no answer", "$3$"),
    ("$\\frac{1}{0}$", "$3$"),
]


TIMEOUTS: list[str] = []  # what ``on_timeout`` reported, per test


@pytest.fixture()
def judge() -> Iterator[IsolatedMathJudge]:
    TIMEOUTS.clear()
    j = IsolatedMathJudge(time_limit=1.5, on_timeout=lambda: TIMEOUTS.append("timeout"))
    yield j
    j.close()


def test_same_verdicts_as_in_process_math_verify(judge: IsolatedMathJudge) -> None:
    got = [judge(p, g) for p, g in PAIRS]
    assert got == [math_equivalent(p, g) for p, g in PAIRS]
    assert got[:2] == [True, True] and got[2] is False  # the cases are not all one verdict


@pytest.mark.parametrize("evil", PATHOLOGICAL_MATH)
def test_pathological_answer_costs_the_time_limit_and_not_the_process(
    judge: IsolatedMathJudge, evil: str
) -> None:
    judge("$1$", "$1$")  # the child is up: what follows times the check, not the start
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:  # would stall if the check held this process's GIL
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.02)

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    try:
        verdict = judge(evil, "$5$")
    finally:
        stop.set()
        ticker.join()
    elapsed = time.monotonic() - t0
    assert verdict is False
    assert 1.4 < elapsed < 1.5 + 5.0
    assert max(b - a for a, b in itertools.pairwise(ticks)) < 1.0
    assert judge.timeouts == 1 and TIMEOUTS == ["timeout"]
    request = judge.bounded(None)
    assert request(evil, "$5$") is False
    t0 = time.monotonic()
    assert request(evil, "$5$") is False  # within one request, a repeat costs nothing...
    assert time.monotonic() - t0 < 1.0  # a check again would cost the 1.5 s time limit
    assert judge.timeouts == 2  # ...but a timeout is never cached across requests
    assert judge("$\\sqrt{9}$", "$3$") is True  # a fresh child took over


def test_the_callers_deadline_raises_instead_of_deciding(judge: IsolatedMathJudge) -> None:
    judge("$1$", "$1$")
    with pytest.raises(MathDeadlineExceeded):
        judge(PATHOLOGICAL_MATH[0], "$7$", deadline=time.monotonic() + 0.3)
    with pytest.raises(MathDeadlineExceeded):
        judge("$2$", "$2$", deadline=time.monotonic() - 1)
    assert judge.timeouts == 0  # a deadline is not a verdict: nothing counted, nothing cached
    t0 = time.monotonic()
    assert judge(PATHOLOGICAL_MATH[0], "$7$") is False
    assert time.monotonic() - t0 > 1.4


def test_a_crashed_child_is_replaced(judge: IsolatedMathJudge) -> None:
    assert judge("$2$", "$2$")
    child = judge._slots.get()
    assert child is not None
    child.process.kill()
    child.process.wait()
    judge._slots.put(child)
    assert judge("$\\frac{6}{3}$", "$2$") is True


def test_concurrent_callers_get_their_own_answers() -> None:
    judge = IsolatedMathJudge(time_limit=5.0, workers=2, cache_size=0)
    try:
        pairs = [(f"${i}/2$", f"${i / 2}$") for i in range(12)] + [("$3$", "$4$")] * 4
        results: dict[int, bool] = {}

        def check(i: int) -> None:
            results[i] = judge(*pairs[i])

        threads = [threading.Thread(target=check, args=(i,)) for i in range(len(pairs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(pairs))] == [True] * 12 + [False] * 4
    finally:
        judge.close()


def test_close_stops_the_children() -> None:
    judge = IsolatedMathJudge()
    judge("$1$", "$1$")
    child = judge._slots.get()
    judge._slots.put(child)
    assert child is not None and child.alive()
    judge.close()
    assert not child.alive()


def test_prepare_batch_decides_math_with_the_judge_it_is_given() -> None:
    seen: list[tuple[str, str]] = []

    def judge(prediction: str, gold: str) -> bool:
        seen.append((prediction, gold))
        return prediction == "forty-two"

    item = ScoreItem(
        completion="<strategy><reasoning>r</reasoning>"
        "<strategy_outcome>forty-two</strategy_outcome></strategy>"
        "<final_answer>forty-two</final_answer>",
        answer="42",
    )
    prepared = prepare_batch([item], answer_type="math", math_judge=judge)
    assert prepared.analyses[0].correct and prepared.analyses[0].strategy_correct
    assert ("forty-two", "42") in seen


def test_a_child_killed_mid_check_is_retried_once(
    judge: IsolatedMathJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A death that is not the check's doing (e.g. the thread that started the child ended) must
    not turn into a verdict: the check runs again in a fresh child."""
    from reward_server import math_judge

    judge("$1$", "$1$")
    real_send = math_judge._Child.send
    killed: list[int] = []

    def send_then_die(self: math_judge._Child, prediction: str, gold: str) -> None:
        if not killed:
            killed.append(self.process.pid)
            self.process.kill()
            self.process.wait()
        real_send(self, prediction, gold)

    monkeypatch.setattr(math_judge._Child, "send", send_then_die)
    assert judge("$\\frac{4}{2}$", "$2$") is True
    assert killed and judge.timeouts == 0


def test_a_busy_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A server killed mid-check leaves no child computing for hours (Linux PR_SET_PDEATHSIG)."""
    script = (
        "import sys, threading, time\n"
        "from reward_server.math_judge import IsolatedMathJudge\n"
        "judge = IsolatedMathJudge(time_limit=600)\n"
        "judge('$1$', '$1$')\n"
        "child = judge._slots.get(); judge._slots.put(child)\n"
        "print(child.process.pid, flush=True)\n"
        "threading.Thread(target=judge, args=(sys.argv[1], '$5$'), daemon=True).start()\n"
        "time.sleep(1.0)\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script, PATHOLOGICAL_MATH[0]],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    child_pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child_pid)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_what_the_child_prints_stays_out_of_the_protocol() -> None:
    script = (
        "from reward_server.math_judge import _reply_channel\n"
        "channel = _reply_channel()\n"
        "print('sympy says hello')\n"
        "channel.write('{\"ready\": true}\\n'); channel.flush()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout == '{"ready": true}\n'
    assert "sympy says hello" in proc.stderr


def test_a_child_that_dies_while_it_starts_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child killed before its hello (the OOM killer, while it imports sympy) was a
    RuntimeError, answered by the server as a bare uncounted 500; it is a death like one
    mid-check: the check runs again in a fresh child."""
    from reward_server import math_judge

    real_popen = subprocess.Popen
    spawned: list[list[str]] = []

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        spawned.append(args)
        if len(spawned) == 1:  # the first child exits before saying hello
            args = [sys.executable, "-c", "import sys; sys.exit(9)"]
        return real_popen(args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(math_judge.subprocess, "Popen", popen)
    j = IsolatedMathJudge(time_limit=20, workers=1)
    try:
        assert j("$\\frac{10}{2}$", "$5$") is True
        assert len(spawned) == 2
    finally:
        j.close()
