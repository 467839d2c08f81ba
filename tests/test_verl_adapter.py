"""verl 0.9.1's own code, configured from the README, gets exact rewards or stops.

verl's pins (transformers<5.11, tensordict<=0.10.0) do not fit the dev environment, so its code
runs in the venv ``make setup-verl`` builds (``.venv-verl``; ``make test`` builds it first), via
``tests/verl_checks.py`` in a subprocess; this test only starts the server, computes the
in-process reference and compares. It is skipped only when that venv does not exist.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from reward_server.core import ScoreItem, score_batch
from reward_server.encoders.loading import load_encoder
from tests.client_fixtures import running_server
from tests.test_openrlhf import COMPLETIONS

REPO = Path(__file__).resolve().parents[1]
VERL_PYTHON = Path(os.environ.get("SDE2_VERL_PYTHON", REPO / ".venv-verl" / "bin" / "python"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VERL_PYTHON.exists(), reason=f"{VERL_PYTHON} missing: run `make setup-verl`"
    ),
]

#: (case as verl's dataset row would give it, recipe, answer_type, num_tokens) for the reference.
CASES: list[tuple[dict[str, Any], str, str, int | None]] = [
    *[
        (
            {"data_source": "openai/gsm8k", "response": c, "ground_truth": "72"},
            "sde2",
            "numeric",
            None,
        )
        for c in COMPLETIONS
    ],
    # An integer ground truth (a parquet int column), and verl's dataset index in extra_info.
    (
        {
            "data_source": "openai/gsm8k",
            "response": COMPLETIONS[1],
            "ground_truth": 70,
            "extra_info": {"index": 7, "split": "train"},
        },
        "sde2",
        "numeric",
        None,
    ),
    # MedMCQA selects the choice matcher.
    (
        {
            "data_source": "medmcqa",
            "response": "<final_answer>(B)</final_answer>",
            "ground_truth": "B",
        },
        "sde2",
        "choice",
        None,
    ),
    # Per-row overrides from extra_info: recipe and the response length for cfl's length term.
    (
        {
            "data_source": "openai/gsm8k",
            "response": COMPLETIONS[0],
            "ground_truth": "72",
            "extra_info": {"recipe": "cfl", "num_tokens": 1500},
        },
        "cfl",
        "numeric",
        1500,
    ),
]


def reference() -> list[tuple[float, float]]:
    """(R_final, correct) per case from the in-process scorer, one unnormalized sample each."""
    encoder = load_encoder("onnx")
    out = []
    for case, recipe, answer_type, num_tokens in CASES:
        item = ScoreItem(case["response"], str(case["ground_truth"]), None, None, num_tokens)
        res = score_batch([item], encoder, recipe=recipe, answer_type=answer_type, normalize=False)
        out.append((res.rewards[0], float(res.items[0].correct)))
    return out


def test_verl_reads_the_readme_config_scores_exactly_and_stops_when_the_server_dies(
    tmp_path: Path,
) -> None:
    want = reference()
    assert len({r for r, _ in want}) >= 5  # the cases differ, so a mix-up would show
    pause = tmp_path / "server-killed"
    spec = {
        "cases": [case for case, *_ in CASES],
        "reward_kwargs": {"max_attempts": 2},
        "pause_file": str(pause),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SDE2_URL", None)  # the URL must come from the README's reward_kwargs
    with running_server() as server:
        spec["url"] = server.url
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.Popen(
            [str(VERL_PYTHON), "-m", "tests.verl_checks", str(tmp_path / "spec.json")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            lines = []
            for _ in range(1000):  # bounded: the report, then PAUSED (libraries may print too)
                line = proc.stdout.readline()
                lines.append(line)
                if not line or line.strip() == "PAUSED":
                    break
            if lines[-1].strip() != "PAUSED":
                _, err = proc.communicate(timeout=60)
                pytest.fail(f"verl checks failed:\n{''.join(lines)}{err[-4000:]}")
            report_line = next(x for x in lines if x.startswith("{"))
            server.kill()  # mid-run: verl is about to score the next sample
            pause.touch()
            rest, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    report = json.loads(report_line)
    # verl ignores a top-level custom_reward_function (the old documentation): path stays null.
    assert report["top_level_path"] is None
    runs = [
        f"{src}/{name}"
        for src in ("yaml", "overrides")
        for name in ("compute_score", "compute_score_async")
    ]
    assert set(report) == {"top_level_path", *runs}
    for run in runs:
        assert report[run]["async"] == run.endswith("_async"), run
        for way in ("direct", "manager"):
            got = report[run][way]
            assert [g["score"] for g in got] == pytest.approx([r for r, _ in want], abs=1e-6), (
                run,
                way,
            )
            assert [g["acc"] for g in got] == [c for _, c in want], (run, way)

    # Killed server: the next sample raises out of verl's reward loop, naming the failure.
    assert proc.returncode != 0 and "SCORED AFTER THE PAUSE" not in rest
    assert "RewardServiceError" in err and "reward service failed" in err, err[-2000:]
