"""The TRL adapter under several processes: each gets the rewards of one request over the step.

Two real processes (``torch.multiprocessing`` spawn) join a real ``torch.distributed`` gloo group,
as ``accelerate launch`` would set up; each calls the reward function the way TRL 1.16 does, with
its own half of the step, where one prompt's group is split across the two processes. Every
completion's reward must equal the reward one ``/v1/score`` request over the whole step gives.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import logging
import math
import random
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.server_process import free_port
from tests.test_client import completion
from trainer_client import RewardClient
from trainer_client.trl_inputs import prompt_key

pytestmark = pytest.mark.slow

WORLD = 2
GENERATIONS = 4


def step_rows() -> list[dict[str, Any]]:
    """3 prompts × 4 generations of mixed quality; split in halves, prompt 1 spans both."""
    rng = random.Random(11)
    rows = []
    for p in range(3):
        gold = str(40 + p)
        prompt = [{"role": "user", "content": f"Question {p}: how many?"}]
        for g in range(GENERATIONS):
            m = rng.randint(0, 3)
            outs = [rng.choice([gold, "7", "13"]) for _ in range(m)]
            reasons = [f"prompt {p} try {g}: idea {j} with {rng.random():.4f}" for j in range(m)]
            text = completion(outs, rng.choice([gold, "7", None]), reasons)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if g == 3:  # a response-schema template: the strategies come back as reasoning
                message = {"role": "assistant", "reasoning_content": text, "content": ""}
            answer = "####" if (p, g) == (2, 1) else gold  # a gold no answer matches: warned
            rows.append(
                {"prompt": prompt, "completion": [message], "text": text, "answer": answer,
                 "ids": list(range(5 + 7 * g + p))}
            )  # fmt: skip
    return rows


@contextmanager
def _process_group(rank: int, store: str, out_dir: str) -> Iterator[None]:
    """Joins a gloo group as ``accelerate launch`` would; on leaving, destroys it and records in
    ``<rank>.held`` whether anything still holds the group without a garbage collection.

    A group the adapter kept (a frame of a failed call's traceback in a reference cycle) was
    freed by the collector at some later point, at exit too, where gloo's destructor aborted the
    process now and then (SIGABRT, "terminate called without an active exception", seen in CI).
    """
    import torch.distributed as dist

    # If the process dies in C++, the Python stack of every thread goes to stderr, which pytest
    # shows with the failure.
    faulthandler.enable(all_threads=True)
    gc.disable()  # only reference counts free the group: a cycle holding it shows
    # A file store: no rank hosts a TCP store that the other could outlive.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    group = weakref.ref(dist.group.WORLD)
    try:
        yield
    finally:
        dist.barrier()
        dist.destroy_process_group()
        Path(out_dir, f"{rank}.held").write_text(str(group() is not None))
        gc.enable()


def _assert_groups_freed(out_dir: Path) -> None:
    held = [(out_dir / f"{r}.held").read_text() for r in range(WORLD)]
    assert held == ["False"] * WORLD, "the process group outlived destroy_process_group"


def _score_half(
    rank: int, fn: Any
) -> tuple[list[float], dict[str, list[float]], dict[str, list[Any]]]:
    """This process's half of the step scored by ``fn`` as TRL calls it: what it returns, and
    what it logged (``log_metric``, ``log_extra``)."""
    rows = step_rows()
    half = len(rows) // WORLD
    mine = rows[rank * half : (rank + 1) * half]
    metrics: dict[str, list[float]] = defaultdict(list)
    extra: dict[str, list[Any]] = defaultdict(list)
    returned = asyncio.run(
        fn(
            prompts=[r["prompt"] for r in mine],
            completions=[r["completion"] for r in mine],
            completion_ids=[r["ids"] for r in mine],
            answer=[r["answer"] for r in mine],
            trainer_state=None,
            log_metric=lambda k, v: metrics[k].append(v),
            log_extra=lambda k, v: extra[k].extend(v),
        )
    )
    return returned, metrics, extra


@contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages of the warnings logged under logger ``name`` while the block runs."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _worker(rank: int, url: str, store: str, out_dir: str) -> None:
    """One training process: joins the gloo group, scores its half as TRL would, reports."""
    from trainer_client.trl import sde2_reward

    with _process_group(rank, store, out_dir), _logged("trainer_client") as logged:
        fn = sde2_reward(url)
        rewards, metrics, extra = _score_half(rank, fn)
        warnings = fn.__self__.last_result.warnings  # type: ignore[attr-defined]
        report = {
            "rewards": rewards, "metrics": metrics, "extra": extra, "warnings": warnings,
            "logged": logged,
        }  # fmt: skip
        Path(out_dir, f"{rank}.json").write_text(json.dumps(report))


def test_two_processes_get_the_whole_step_rewards(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    mp.spawn(
        _worker, args=(reward_server.url, str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD
    )
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    _assert_groups_freed(tmp_path)

    rows = step_rows()
    items = [
        {"completion": r["text"], "answer": r["answer"], "group": prompt_key(r["prompt"]),
         "num_tokens": len(r["ids"])}
        for r in rows
    ]  # fmt: skip
    half = len(rows) // WORLD
    with RewardClient(reward_server.url) as rc:
        whole = rc.score(items, diagnostics=True)  # one request over the whole step
        alone = rc.score(items[:half], diagnostics=True)  # what rank 0 alone would normalize to
    got = [r for report in reports for r in report["rewards"]]
    assert got == pytest.approx(whole.rewards, abs=1e-9)
    # The check has teeth: normalizing each process's half on its own gives other numbers.
    assert alone.rewards != pytest.approx(whole.rewards[:half], abs=1e-3)
    # Prompt 1's group (items 4..7) spans both processes.
    assert items[half - 1]["group"] == items[half]["group"]

    # Step metrics are the whole step's on every process (TRL averages them across processes).
    m0, m1 = reports[0]["metrics"], reports[1]["metrics"]
    assert m0 == m1
    assert m0["sde2/acc"] == [pytest.approx(whole.accuracy)]
    assert m0["sde2/oc"] == [pytest.approx(sum(whole.components["oc"]) / len(items))]
    assert not any(math.isnan(v) for vs in m0.values() for v in vs)
    # Columns are each process's own completions (TRL gathers them).
    columns = [c for report in reports for c in report["extra"]["sde2/correct"]]
    assert columns == [it.correct for it in whole.items]
    assert sum(it.n_strat for it in whole.items[3::4]) > 0  # reasoning_content was scored
    # The step's warnings name the item in the step on every process (rank 1's are shifted).
    assert [w.split(":")[0] for w in whole.warnings] == ["items.9.answer"]
    assert reports[0]["warnings"] == reports[1]["warnings"] == whole.warnings
    # Logged once, by rank 0, named in the step: rank 1 saw it as its own slice's item 1.
    assert reports[0]["logged"] == [f"the reward service warns: {whole.warnings[0]}"]
    assert reports[1]["logged"] == []


def _advantages_worker(rank: int, url: str, store: str, out_dir: str) -> None:
    """As :func:`_worker`, the reward returning the paper's group advantages (TRL's groups:
    ``GENERATIONS`` consecutive completions), as ``sde2-train`` configures it."""
    from trainer_client.trl import sde2_reward

    with _process_group(rank, store, out_dir):
        fn = sde2_reward(url, returns="advantages", num_generations=GENERATIONS)
        returned, metrics, extra = _score_half(rank, fn)
        report = {"returned": returned, "extra": extra, **metrics}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(report))


def test_two_processes_get_the_papers_group_advantages(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Each process returns its completions' advantages over the whole step (prompt 1's group
    spans both): SPEC §5's population std, which TRL's ``scale_rewards="none"`` (``A`` minus
    its group mean) leaves as they are, to 1e-6."""
    import torch
    import torch.multiprocessing as mp

    args = (reward_server.url, str(tmp_path / "store"), str(tmp_path))
    mp.spawn(_advantages_worker, args=args, nprocs=WORLD)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    _assert_groups_freed(tmp_path)

    rows = step_rows()
    items = [
        {"completion": r["text"], "answer": r["answer"], "num_tokens": len(r["ids"])} for r in rows
    ]
    with RewardClient(reward_server.url) as rc:
        whole = rc.score(items)  # R_final of the whole step
    r = torch.tensor(whole.rewards, dtype=torch.float64).view(-1, GENERATIONS)
    paper = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)
    got = torch.tensor([a for report in reports for a in report["returned"]], dtype=torch.float64)
    grouped = got.view(-1, GENERATIONS)
    trl_uses = (grouped - grouped.mean(1, keepdim=True)).view(-1)  # scale_rewards="none"
    assert torch.allclose(trl_uses, paper.view(-1), atol=1e-6)
    assert paper.abs().max() > 0.5  # the groups' rewards differ: not a check of zeros
    # The step's raw weighted mean (weights 1) is each process's metric: R_final's mean is 0 by
    # construction, and TRL's own reward is the advantages' (0 too).
    raw = sum(sum(v) for v in whole.components.values()) / len(items)
    assert abs(raw) > 0.1 and abs(sum(whole.rewards)) < 1e-9
    assert reports[0]["sde2/raw_reward"] == reports[1]["sde2/raw_reward"]
    assert reports[0]["sde2/raw_reward"] == [pytest.approx(raw)]
    # The per-completion R_final column is the step's R_final, each process its own slice (it
    # was the shard's raw weighted sum, scored without normalization).
    column = [v for report in reports for v in report["extra"]["sde2/reward"]]
    assert column == pytest.approx(whole.rewards, abs=1e-9)
    raw = [sum(whole.components[k][i] for k in whole.components) for i in range(len(items))]
    assert column != pytest.approx(raw, abs=1e-3)  # the raw sums differ: the check tells


def _failing_worker(rank: int, urls: list[str], store: str, out_dir: str, case: str) -> None:
    """A step that cannot be scored (``case``: rank 0's server is dead, the ranks' answer types
    differ, rank 1 has no gold for a row): both processes must stop with an error, neither may
    hang or return rewards."""
    from trainer_client.retry import RetryPolicy
    from trainer_client.trl import sde2_reward

    with _process_group(rank, store, out_dir):
        rows = step_rows()[rank::WORLD]
        fn = sde2_reward(urls[rank], retry=RetryPolicy(max_attempts=2, backoff_base=0.01))
        columns: dict[str, list[Any]] = {"answer": [r["answer"] for r in rows]}
        if case == "mixed answer types":
            columns["answer_type"] = [("numeric", "exact")[rank]] * len(rows)
        if case == "a missing gold" and rank == 1:
            columns["answer"][0] = None
        try:
            asyncio.run(
                fn(
                    prompts=[r["prompt"] for r in rows],
                    completions=[r["completion"] for r in rows],
                    **columns,
                )
            )
            outcome = "returned rewards"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        Path(out_dir, f"{rank}.txt").write_text(outcome)


@pytest.mark.parametrize("case", ["a dead server", "mixed answer types", "a missing gold"])
def test_a_failure_on_one_process_stops_every_process(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
    case: str,
) -> None:
    """Mixed answer types were refused in one process only (each rank checked its own slice:
    two ranks normalized a mixed step together), and a bad gold on one rank raised before the
    gather (the other rank got gloo's "Connection closed by peer")."""
    import torch.multiprocessing as mp

    dead = f"http://127.0.0.1:{free_port()}"
    urls = [dead if case == "a dead server" else reward_server.url, reward_server.url]
    args = (urls, str(tmp_path / "store"), str(tmp_path), case)
    mp.spawn(_failing_worker, args=args, nprocs=WORLD)
    outcomes = [(tmp_path / f"{r}.txt").read_text() for r in range(WORLD)]
    _assert_groups_freed(tmp_path)
    if case == "a dead server":
        assert outcomes[0].startswith("RewardServiceError") and dead in outcomes[0]
        assert outcomes[1].startswith(
            "RewardServiceError: reward scoring failed on process(es) rank 0"
        )
    elif case == "mixed answer types":
        for outcome in outcomes:  # the same refusal on every rank
            assert outcome.startswith(
                "ValueError: one reward call must use one answer_type across processes, got "
                "['exact', 'numeric']"
            ), outcome
    else:
        assert outcomes[1].startswith("ValueError: dataset column 'answer', row 0"), outcomes[1]
        assert outcomes[0].startswith(
            "RewardServiceError: reward scoring failed on process(es) rank 1: ValueError"
        ), outcomes[0]


def _two_functions_worker(rank: int, url: str, store: str, out_dir: str) -> None:
    """Two SD-E² reward functions (gold columns ``answer`` and ``other``) run concurrently as
    TRL runs them; each process's answer for the function of its own rank comes back late."""
    from trainer_client.trl import SDE2Reward

    with _process_group(rank, store, out_dir):
        rows = step_rows()[rank::WORLD]
        holders = [SDE2Reward(url), SDE2Reward(url, answer_column="other")]

        async def step() -> list[list[float | None]]:
            for k, holder in enumerate(holders):
                client = holder._get_client()
                scored, delay = client.score, 0.5 if k == rank else 0.0

                async def late(*args: Any, _s: Any = scored, _d: float = delay, **kw: Any) -> Any:
                    await asyncio.sleep(_d)
                    return await _s(*args, **kw)

                client.score = late  # type: ignore[method-assign]
            columns = {"answer": [r["answer"] for r in rows], "other": ["7"] * len(rows)}
            calls = [
                holder.sde2(prompts=[r["prompt"] for r in rows],
                            completions=[r["completion"] for r in rows], **columns)
                for holder in holders
            ]  # fmt: skip
            return await asyncio.gather(*calls)

        Path(out_dir, f"{rank}.json").write_text(json.dumps(asyncio.run(step())))


def test_two_reward_functions_gather_in_the_order_their_calls_began(
    reward_server: ServerProcess,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Each function gathered when its own answer came back: rank 0 gathered the second
    function first, rank 1 the first, and each merged its rewards with the other function's
    (wrong rewards, no error). Now both processes gather in the order the calls began."""
    import torch.multiprocessing as mp

    args = (reward_server.url, str(tmp_path / "store"), str(tmp_path))
    mp.spawn(_two_functions_worker, args=args, nprocs=WORLD)
    _assert_groups_freed(tmp_path)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    rows = step_rows()
    order = [i for r in range(WORLD) for i in range(r, len(rows), WORLD)]  # rank 0's, rank 1's
    with RewardClient(reward_server.url) as rc:
        for k, gold in enumerate(("answer", "other")):
            items = [
                {"completion": rows[i]["text"], "answer": rows[i]["answer"] if k == 0 else "7",
                 "group": prompt_key(rows[i]["prompt"])}
                for i in order
            ]  # fmt: skip
            whole = rc.score(items).rewards
            got = [r for report in reports for r in report[k]]
            assert got == pytest.approx(whole, abs=1e-9), gold
