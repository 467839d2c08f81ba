"""verl 0.9.1's own code, configured from the README, gets exact rewards or stops.

verl's pins (transformers<5.11, tensordict<=0.10.0) do not fit the dev environment, so its code
runs in the venv ``make setup-verl`` builds (``.venv-verl``; ``make test`` builds it first), via
``tests/verl_checks.py`` in a subprocess; this test only starts the server, computes the
in-process reference and compares. It is skipped only when that venv does not exist and
SDE2_VERL_PYTHON is unset (``make test`` sets it); the checks that fail before any request need
neither verl nor a server and always run.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from reward_server.core import RewardParams, ScoreItem, score_batch
from reward_server.core.params import AnswerType
from reward_server.encoders.base import Encoder
from reward_server.encoders.loading import load_encoder
from tests.client_fixtures import running_server
from tests.server_process import ServerProcess, requests_served
from tests.test_openrlhf import COMPLETIONS

REPO = Path(__file__).resolve().parents[1]
VERL_PYTHON = Path(os.environ.get("SDE2_VERL_PYTHON", REPO / ".venv-verl" / "bin" / "python"))

#: Skipped only where nobody named verl's interpreter: ``make test`` sets SDE2_VERL_PYTHON (and
#: builds that venv first), so there a missing interpreter fails instead of skipping.
needs_verl = pytest.mark.skipif(
    not VERL_PYTHON.exists() and "SDE2_VERL_PYTHON" not in os.environ,
    reason=f"{VERL_PYTHON} missing: run `make setup-verl`",
)

#: (case as verl's dataset row would give it, recipe, answer_type, num_tokens) for the reference.
CASES: list[tuple[dict[str, Any], str, AnswerType, int | None]] = [
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
]


@functools.cache
def encoder() -> Encoder:
    """One encoder for every reference: loading it costs more than the scoring."""
    return load_encoder("onnx")


def gsm8k(response: str, **extra_info: Any) -> dict[str, Any]:
    """A GSM8K row as verl's dataset gives it, gold 72."""
    return {
        "data_source": "openai/gsm8k",
        "response": response,
        "ground_truth": "72",
        "extra_info": extra_info,
    }


def expected(
    case: dict[str, Any],
    recipe: str = "sde2",
    answer_type: AnswerType = "numeric",
    params: RewardParams | None = None,
) -> float:
    """R_final of one verl case from the in-process scorer, one unnormalized sample."""
    num_tokens = (case.get("extra_info") or {}).get("num_tokens")
    item = ScoreItem(case["response"], str(case["ground_truth"]), None, None, num_tokens)
    res = score_batch(
        [item],
        encoder(),
        recipe=recipe,
        answer_type=answer_type,
        params=params,
        normalize=False,
    )
    return res.rewards[0]


def reference() -> list[tuple[float, float]]:
    """(R_final, correct) per case from the in-process scorer, one unnormalized sample each."""
    out = []
    for case, recipe, answer_type, num_tokens in CASES:
        item = ScoreItem(case["response"], str(case["ground_truth"]), None, None, num_tokens)
        res = score_batch(
            [item], encoder(), recipe=recipe, answer_type=answer_type, normalize=False
        )
        out.append((res.rewards[0], float(res.items[0].correct)))
    return out


def run_verl_checks(spec: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``tests/verl_checks.py`` on ``spec`` in the verl venv, against a fresh server; its report."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SDE2_URL", None)  # the URL must come from the README's reward_kwargs
    with running_server() as server:
        (tmp_path / "spec.json").write_text(json.dumps({**spec, "url": server.url}))
        proc = subprocess.run(
            [str(VERL_PYTHON), "-m", "tests.verl_checks", str(tmp_path / "spec.json")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        pytest.fail(f"verl checks failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


@pytest.mark.slow
@needs_verl
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


KWARGS = "reward.custom_reward_function.reward_kwargs"
MEDMCQA = {
    "data_source": "medmcqa",
    "response": "<final_answer>(B)</final_answer>",
    "ground_truth": "B",
}


@pytest.mark.slow
@needs_verl
def test_verl_remote_manager_nested_params_and_the_recipe_per_run(tmp_path: Path) -> None:
    """verl's own managers and batch assembly on what the README documents beyond the basics."""
    one = gsm8k(COMPLETIONS[0])
    cfl_rows = [gsm8k(COMPLETIONS[0]), gsm8k(COMPLETIONS[2])]
    spec = {
        "runs": [
            # Ray ships the function to an actor: it must pickle (by reference, not its globals).
            {"name": "remote", "manager": "remote", "cases": [one, MEDMCQA]},
            # verl's dict(reward_kwargs) is shallow: a nested params.weights stays a DictConfig.
            {
                "name": "params",
                "manager": "naive",
                "overrides": [
                    f"+{KWARGS}.params.weights.sd=0",
                    f"+{KWARGS}.params.similarity_threshold=0.75",
                ],
                "cases": [one, gsm8k(COMPLETIONS[1])],
            },
            {
                "name": "params_typo",
                "manager": "naive",
                "overrides": [f"+{KWARGS}.params.weights.sdd=0"],
                "cases": [one],
            },
            # The recipe set per run: one batch, assembled by verl, lengths in words.
            {
                "name": "cfl_per_run",
                "manager": "batch",
                "overrides": [f"++{KWARGS}.recipe=cfl"],
                "cases": cfl_rows,
            },
            # Per row, the recipe would change the result's keys within a batch.
            {
                "name": "recipe_per_row",
                "manager": "batch",
                "cases": [
                    gsm8k(COMPLETIONS[0], recipe="sde2"),
                    gsm8k(COMPLETIONS[0], recipe="cfl"),
                ],
            },
            # One length per prompt (or per run) is every completion's in a group: refused.
            {
                "name": "num_tokens",
                "manager": "naive",
                "cases": [gsm8k(COMPLETIONS[0], num_tokens=1500)],
            },
            {
                "name": "num_tokens_per_run",
                "manager": "naive",
                "overrides": [f"+{KWARGS}.num_tokens=1500"],
                "cases": [one],
            },
        ]
    }
    got = run_verl_checks(spec, tmp_path)["runs"]

    remote = got["remote"]
    assert isinstance(remote, list), remote
    want = [expected(one), expected(MEDMCQA, answer_type="choice")]
    assert [r["score"] for r in remote] == pytest.approx(want, abs=1e-6)
    assert [r["acc"] for r in remote] == [1.0, 1.0]

    params = RewardParams.model_validate({"weights": {"sd": 0}, "similarity_threshold": 0.75})
    want = [expected(c, params=params) for c in (one, gsm8k(COMPLETIONS[1]))]
    assert [r["score"] for r in got["params"]] == pytest.approx(want, abs=1e-6)
    assert want[0] != pytest.approx(expected(one))  # the weight did change the reward
    (typo,) = got["params_typo"]
    assert typo["error"].startswith("ValueError: ") and "params.weights.sdd" in typo["error"]

    batch = got["cfl_per_run"]
    assert "error" not in batch, batch
    want = [expected(c, recipe="cfl") for c in cfl_rows]
    assert batch["scores"] == pytest.approx(want, abs=1e-6)
    assert {"oc", "fa", "len", "acc"} <= set(batch["extra_keys"])

    error = got["recipe_per_row"]["error"]
    assert error.startswith("ValueError: extra_info['recipe']"), error
    assert f"{KWARGS}.recipe" in error

    for run, where in (("num_tokens", "extra_info"), ("num_tokens_per_run", "reward_kwargs.")):
        (result,) = got[run]
        assert result["error"].startswith(f"ValueError: {where}"), result
        assert "num_tokens: verl passes compute_score no response length" in result["error"]


class _Config(Mapping[str, Any]):
    """Stands in for OmegaConf's ``DictConfig`` (not installed here): a Mapping, not a dict."""

    def __init__(self, **values: Any) -> None:
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def test_verl_hook_pickles_by_reference_and_refuses_bad_inputs_before_any_request() -> None:
    """The in-process side of the checks above: fast, no verl, no server."""
    # verl's load_module: the file by path, under a name that is not in sys.modules.
    spec = importlib.util.spec_from_file_location(
        "custom_module_1", REPO / "trainer_client/verl.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("compute_score", "compute_score_async"):
        fn = getattr(module, name)
        assert pickle.loads(pickle.dumps(fn)) is fn  # by reference: Ray's actor imports it

    from trainer_client.verl import compute_score

    dead: dict[str, Any] = {"url": "http://127.0.0.1:1", "max_attempts": 1}  # nothing listens there
    # verl gives no response length: one per prompt or per run made cfl's length term constant
    # within each group (it was sent as every completion's).
    no_length = "num_tokens: verl passes compute_score no response length"
    with pytest.raises(ValueError, match=rf"^extra_info {no_length}"):
        compute_score("gsm8k", COMPLETIONS[0], "72", {"num_tokens": 1500}, **dead)
    with pytest.raises(ValueError, match=rf"^reward_kwargs\.{no_length}"):
        compute_score("gsm8k", COMPLETIONS[0], "72", num_tokens=1500, **dead)
    # Retries: bounded by a deadline (six fixed tries gave up within a busy server's backlog).
    for bad in ({"max_attempts": 0}, {"max_attempts": 1.5}, {"deadline": 0}, {"deadline": "9"}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=rf"reward_kwargs\.{name} must be"):
            compute_score("gsm8k", COMPLETIONS[0], "72", url=dead["url"], **bad)
    with pytest.raises(ValueError, match=r"reward_kwargs\.api_key must be a string"):
        compute_score("gsm8k", COMPLETIONS[0], "72", api_key=123, **dead)
    with pytest.raises(
        ValueError, match=r"extra_info\['recipe'\] = 'cfl': set the recipe once per run"
    ):
        compute_score("gsm8k", COMPLETIONS[0], "72", {"recipe": "cfl"}, **dead)
    typo = _Config(weights=_Config(sdd=0))
    with pytest.raises(ValueError, match=r"params\.weights\.sdd: Extra inputs are not permitted"):
        compute_score("gsm8k", COMPLETIONS[0], "72", params=typo, **dead)
    with pytest.raises(ValueError, match=r"params\.similarity_threshold: .*less than 1"):
        compute_score("gsm8k", COMPLETIONS[0], "72", params={"similarity_threshold": 1.5}, **dead)
    # A misspelt reward_kwargs name was ignored: the run trained on the defaults' rewards.
    for typo_name, meant in (("answer-type", "answer_type"), ("recipie", "recipe")):
        with pytest.raises(ValueError, match=rf"reward_kwargs\.{typo_name}: .*'{meant}'"):
            compute_score("gsm8k", COMPLETIONS[0], "72", **{typo_name: "cfl"}, **dead)
    with pytest.raises(ValueError, match=r"reward_kwargs\.param: "):
        compute_score("gsm8k", COMPLETIONS[0], "72", param={"eps": 0.1}, **dead)
    # A weight of a component the recipe lacks changed nothing (sde2-train refused it).
    unused = r"reward_kwargs params\.weights\.sd: not a component of recipe 'cfl'"
    with pytest.raises(ValueError, match=unused):
        compute_score(
            "gsm8k", COMPLETIONS[0], "72", recipe="cfl", params={"weights": {"sd": 0}}, **dead
        )


def test_verl_hook_sends_the_key_it_is_given_and_retries_until_a_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reward_kwargs.api_key`` reaches the server (the README said so; the setting was
    refused), and the hook's client retries until a deadline, not six tries (spent in ~15 s
    against a server refusing a 2,048-sample step with 429 for a minute)."""
    from trainer_client import _verl_impl
    from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy, RewardRequestError
    from trainer_client.verl import compute_score

    monkeypatch.delenv("SDE2_API_KEY", raising=False)
    server = ServerProcess(None, env={"SDE2_API_KEY": "verl-key"}).start()
    try:
        with pytest.raises(RewardRequestError, match="401"):
            compute_score("openai/gsm8k", COMPLETIONS[0], "72", url=server.url, max_attempts=1)
        got = compute_score("openai/gsm8k", COMPLETIONS[0], 72, url=server.url, api_key="verl-key")
    finally:
        server.stop()
    assert got["score"] == pytest.approx(expected(gsm8k(COMPLETIONS[0])), abs=1e-6)
    (client,) = [
        c
        for (url, _, key), c in _verl_impl._sync_clients.items()
        if (url, key) == (server.url, "verl-key")
    ]
    assert client.retry == RetryPolicy(max_attempts=None, deadline=TRAINER_DEADLINE)


#: verl's scorer modules that judge an answer by mathematical equivalence (MATH's
#: ``math_reward``, DAPO's ``math_dapo``, Numina's ``prime_math``, Geometry3K's ``geo3k`` through
#: mathruler): the sources verl routes to them get the server's ``math`` matcher here.
VERL_MATH_SCORERS = frozenset({"math_reward", "math_dapo", "prime_math", "geo3k"})


def verl_routes() -> dict[str, set[str]]:
    """Scorer module -> the ``data_source`` names verl's installed ``default_compute_score``
    routes to it, read from its source (``data_source == "x"`` and ``data_source in [...]``
    branches; a prefix test such as ``startswith("aime")`` names no source and is left out)."""
    import ast

    venv = VERL_PYTHON.parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/verl/utils/reward_score/__init__.py"))
    assert found, f"no verl/utils/reward_score in {venv}"
    tree = ast.parse(found[0].read_text(encoding="utf-8"))
    function = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "default_compute_score"
    )
    routes: dict[str, set[str]] = {}
    for branch in (node for node in ast.walk(function) if isinstance(node, ast.If)):
        modules = [
            alias.name
            for node in branch.body
            if isinstance(node, ast.ImportFrom) and node.level == 1
            for alias in node.names
        ]
        sources = {
            const.value
            for compare in ast.walk(branch.test)
            if isinstance(compare, ast.Compare)
            for const in ast.walk(compare)
            if isinstance(const, ast.Constant) and isinstance(const.value, str)
        }
        for module in modules[:1]:
            routes.setdefault(module, set()).update(sources)
    return routes


@needs_verl
def test_the_sources_verl_judges_by_equivalence_get_the_math_matcher() -> None:
    """``hiyouga/geometry3k`` (verl: ``geo3k``, mathruler's equivalence) got the numeric
    matcher; every source verl's installed code routes to a math scorer gets ``math``."""
    from trainer_client._verl_impl import default_answer_type

    routes = verl_routes()
    assert "hiyouga/geometry3k" in routes.get("geo3k", set()), routes
    math_sources = set().union(*(routes.get(m, set()) for m in VERL_MATH_SCORERS))
    assert len(math_sources) >= 10, routes
    wrong = {s: default_answer_type(s) for s in math_sources if default_answer_type(s) != "math"}
    assert wrong == {}, wrong
    others = set().union(*(v for k, v in routes.items() if k not in VERL_MATH_SCORERS))
    assert {default_answer_type(s) for s in others} == {"numeric"}, others


@pytest.mark.slow
def test_a_geometry3k_sample_is_judged_by_equivalence_on_a_real_server() -> None:
    """The numeric matcher read ``5\\sqrt{3}`` and ``2\\sqrt{3}`` as the same digits: a wrong
    Geometry3K answer was rewarded as correct."""
    from trainer_client.verl import compute_score

    outcome = r"5\sqrt{3}"
    response = (
        '<strategy id="1"><reasoning>law of cosines on the triangle</reasoning>'
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
        f"<final_answer>{outcome}</final_answer>"
    )
    with running_server() as server:
        wrong = compute_score("hiyouga/geometry3k", response, r"2\sqrt{3}", url=server.url)
        right = compute_score("hiyouga/geometry3k", response, r"5\sqrt{3}", url=server.url)
    assert wrong["acc"] == 0.0
    assert right["acc"] == 1.0


@pytest.mark.slow
def test_compute_score_spreads_samples_over_the_replicas() -> None:
    """``url="A,B"``: each compute_score call is one sample, and every one went to A (B only
    on failover). Now they take turns, from verl's threads too, with the same scores."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from trainer_client.verl import compute_score, compute_score_async

    with running_server() as a, running_server() as b:
        both = f"{a.url},{b.url}"

        def one(text: str) -> float:
            return float(compute_score("openai/gsm8k", text, "72", url=both)["score"])

        with ThreadPoolExecutor(4) as pool:
            scores = list(pool.map(one, COMPLETIONS * 2))

        async def concurrently() -> list[dict[str, Any]]:
            calls = (compute_score_async("openai/gsm8k", t, "72", url=both) for t in COMPLETIONS)
            return list(await asyncio.gather(*calls))

        async_scores = [r["score"] for r in asyncio.run(concurrently())]
        served = [requests_served(s.url, "/v1/score") for s in (a, b)]
    assert scores == pytest.approx([expected(gsm8k(t)) for t in COMPLETIONS * 2], abs=1e-6)
    assert async_scores == pytest.approx(scores[: len(COMPLETIONS)], abs=1e-6)
    assert served == [6, 6], served
