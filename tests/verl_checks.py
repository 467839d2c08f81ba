"""verl 0.9.1's own reward path, run in the verl venv by ``tests/test_verl_adapter.py``.

``python -m tests.verl_checks SPEC.json`` (from the repository root, with ``.venv-verl``'s Python):
reads the verl section of ``trainer_client/README.md``, builds verl's config from its YAML block
and, separately, from its Hydra command-line overrides (composed with verl's own
``ppo_trainer`` config), loads the reward function through ``get_custom_reward_fn`` and scores
every case twice: called as verl's reward loop calls it, and through verl's ``naive``
reward-loop manager (``run_single`` on a ``DataProto``, tokenizer decoding included). Prints one
JSON object with what verl got. Only the README's path and URL values are replaced (by this
checkout's file and the test server).

SPEC.json: ``{"url": ..., "cases": [{"data_source", "response", "ground_truth", "extra_info"}],
"reward_kwargs": optional extra keys, "pause_file": optional, "runs": optional}``. With
``pause_file``, after the report it prints ``PAUSED``, waits for that file (the caller kills the
server meanwhile) and scores the first case once more through the manager with ``compute_score``:
the exception that stops verl then ends this process with a traceback and a non-zero status.

``runs`` (instead of, or besides, ``cases``): ``[{"name", "manager", "overrides", "cases"}]``, each
scored with ``compute_score`` under the README's Hydra overrides plus the run's own, and reported
under ``report["runs"][name]``: ``manager`` ``naive`` (verl's ``run_single``, one result or
``{"error"}`` per case), ``batch`` (the cases as one batch, assembled by verl's own
``RewardLoopManager.compute_rm_score``) or ``remote`` (verl's ``RemoteRewardManager`` built by its
``load_reward_manager``, on a one-CPU local Ray that is shut down after the run).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "trainer_client" / "README.md"
HOOK = REPO / "trainer_client" / "verl.py"


def readme_blocks() -> tuple[str, list[str]]:
    """The verl section's YAML block and the overrides of its bash block."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## verl") :]
    section = section[: section.index("\n## ", 1)]
    yaml_block = re.search(r"```yaml\n(.*?)```", section, re.S)
    bash_block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert yaml_block and bash_block, "README's verl section lost its yaml or bash block"
    overrides = [
        tok
        for tok in bash_block.group(1).replace("\\\n", " ").split()
        if "custom_reward_function" in tok
    ]
    return yaml_block.group(1), overrides


def localize(cfg: Any, url: str) -> Any:
    """The README's config with this checkout's hook and the test server's URL."""
    fn = cfg.reward.custom_reward_function
    assert str(fn.path).endswith("trainer_client/verl.py"), fn.path
    assert fn.reward_kwargs.url, "README sets no reward_kwargs.url"
    fn.path = str(HOOK)
    fn.reward_kwargs.url = url
    return cfg


def compose(overrides: list[str]) -> Any:
    """verl's own ``ppo_trainer`` config with these Hydra overrides, as ``main_ppo`` builds it."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def configs(url: str) -> dict[str, Any]:
    """verl configs built from the README: its YAML, and its overrides composed by Hydra."""
    from omegaconf import OmegaConf

    yaml_text, overrides = readme_blocks()
    out = {"yaml": localize(OmegaConf.create(yaml_text), url)}
    composed = compose(overrides)
    # The documentation bug this guards against: a top-level block is silently ignored.
    legacy = compose([f"custom_reward_function.path={HOOK}"])
    out["overrides"] = localize(composed, url)
    out["top_level_path_seen_by_verl"] = legacy.reward.custom_reward_function.path
    return out


def data_proto(tokenizer: Any, case: dict[str, Any], prompt_len: int = 8, pad_to: int = 400) -> Any:
    """One sample as verl's rollout hands it over: left-padded prompt, right-padded response."""
    import numpy as np
    import torch
    from verl import DataProto

    pad = tokenizer.pad_token_id
    prompt = tokenizer(text="Q?", add_special_tokens=False)["input_ids"][-prompt_len:]
    response = tokenizer(text=case["response"], add_special_tokens=False)["input_ids"]
    assert len(response) <= pad_to, "raise pad_to"
    prompts = [pad] * (prompt_len - len(prompt)) + prompt
    responses = response + [pad] * (pad_to - len(response))
    mask = [0] * (prompt_len - len(prompt)) + [1] * (len(prompt) + len(response))
    mask += [0] * (pad_to - len(response))

    def obj(value: Any) -> Any:
        arr = np.empty(1, dtype=object)
        arr[0] = value
        return arr

    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompts]),
            "responses": torch.tensor([responses]),
            "attention_mask": torch.tensor([mask]),
        },
        non_tensors={
            "data_source": obj(case["data_source"]),
            "reward_model": obj({"ground_truth": case["ground_truth"]}),
            "extra_info": obj(dict(case.get("extra_info") or {})),
        },
    )


def plain(value: Any) -> Any:
    """JSON-friendly scalars (verl may hand back numpy or torch numbers)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value.item() if hasattr(value, "item") else value


def failure(exc: BaseException) -> dict[str, str]:
    """What a run reports instead of a result: the exception verl would have stopped with."""
    return {"error": f"{type(exc).__name__}: {exc}"}


def run_naive(cfg: Any, tokenizer: Any, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case through verl's ``naive`` manager, its result or its error."""
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    manager = NaiveRewardManager(
        config=cfg, tokenizer=tokenizer, compute_score=get_custom_reward_fn(cfg)
    )
    out: list[dict[str, Any]] = []
    for case in cases:
        try:
            got = manager.loop.run_until_complete(manager.run_single(data_proto(tokenizer, case)))
        except Exception as exc:  # reported: the caller asserts on it
            out.append(failure(exc))
            continue
        out.append(plain({"score": got["reward_score"], **got["reward_extra_info"]}))
    return out


def run_batch(cfg: Any, tokenizer: Any, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The cases as one batch: scored per sample by the ``naive`` manager, as a reward-loop
    worker does, then assembled by verl's own ``RewardLoopManager.compute_rm_score``, which
    logs every sample under the keys of the first one's result."""
    from types import SimpleNamespace
    from unittest import mock

    from verl import DataProto
    from verl.experimental.reward_loop import reward_loop
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    manager = NaiveRewardManager(
        config=cfg, tokenizer=tokenizer, compute_score=get_custom_reward_fn(cfg)
    )

    class Worker:  # RewardLoopWorker.compute_score_batch, answered in process instead of by Ray
        class compute_score_batch:  # the attribute verl calls
            @staticmethod
            def remote(chunk: Any) -> list[dict[str, Any]]:
                run = manager.loop.run_until_complete
                return [run(manager.run_single(chunk[i : i + 1])) for i in range(len(chunk))]

    owner = SimpleNamespace(
        reward_model_manager=None,
        reward_loop_workers=[Worker()],
        reward_manager_cls=NaiveRewardManager,
    )
    data = DataProto.concat([data_proto(tokenizer, case) for case in cases])
    try:
        with mock.patch.object(reward_loop.ray, "get", lambda refs: refs):
            batch = reward_loop.RewardLoopManager.compute_rm_score(owner, data)
    except Exception as exc:  # reported: the caller asserts on it
        return failure(exc)
    keys = batch.meta_info["reward_extra_keys"]
    return {
        "scores": [float(x) for x in batch.batch["rm_scores"].sum(dim=-1)],
        "extra_keys": keys,
        "extras": {k: [plain(v) for v in batch.non_tensor_batch[k]] for k in keys},
    }


def run_remote(cfg: Any, tokenizer: Any, cases: list[dict[str, Any]]) -> Any:
    """Each case through verl's ``remote`` manager, which ships the function to a Ray actor."""
    import ray
    from omegaconf import open_dict
    from verl.trainer.ppo.reward import load_reward_manager

    with open_dict(cfg):
        cfg.reward.reward_manager.name = "remote"
        cfg.reward.num_workers = 1
    # The actor imports trainer_client: the README's advice, PYTHONPATH in the runtime_env.
    env = {"PYTHONPATH": str(REPO)}
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        try:
            manager = load_reward_manager(cfg, tokenizer)
        except Exception as exc:  # reported: the caller asserts on it
            return failure(exc)
        out = []
        for case in cases:
            got = manager.loop.run_until_complete(manager.run_single(data_proto(tokenizer, case)))
            out.append(plain({"score": got["reward_score"], **got["reward_extra_info"]}))
        return out
    finally:
        ray.shutdown()


def runs(spec: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``spec["runs"]``, each on the README's Hydra config plus its own overrides."""
    _, readme_overrides = readme_blocks()
    kinds = {"naive": run_naive, "batch": run_batch, "remote": run_remote}
    report = {}
    for run in spec["runs"]:
        cfg = localize(compose([*readme_overrides, *run.get("overrides", [])]), spec["url"])
        cfg.reward.custom_reward_function.name = "compute_score"
        report[run["name"]] = kinds[run["manager"]](cfg, tokenizer, run["cases"])
    return report


def main(spec_path: str) -> int:
    from omegaconf import open_dict
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from tests.trainer_doubles import byte_level_tokenizer

    spec = json.loads(Path(spec_path).read_text())
    cases = spec.get("cases", [])
    texts = [c["response"] for c in cases]
    texts += [c["response"] for run in spec.get("runs", []) for c in run["cases"]]
    tokenizer = byte_level_tokenizer(["Q?", *texts])
    if not cases:
        print(json.dumps({"runs": runs(spec, tokenizer)}), flush=True)
        return 0
    built = configs(spec["url"])
    report: dict[str, Any] = {"top_level_path": built.pop("top_level_path_seen_by_verl")}
    managers = {}
    for source, cfg in built.items():
        with open_dict(cfg):  # Hydra's config is in struct mode, like a `+key=` override
            cfg.reward.custom_reward_function.reward_kwargs.update(spec.get("reward_kwargs") or {})
        for name in ("compute_score", "compute_score_async"):
            cfg.reward.custom_reward_function.name = name
            fn = get_custom_reward_fn(cfg)
            assert fn is not None
            manager = NaiveRewardManager(config=cfg, tokenizer=tokenizer, compute_score=fn)
            managers[name] = manager
            direct, managed = [], []
            for case in cases:
                got = fn(
                    data_source=case["data_source"],
                    solution_str=case["response"],
                    ground_truth=case["ground_truth"],
                    extra_info=dict(case.get("extra_info") or {}),
                )
                if inspect.isawaitable(got):
                    got = manager.loop.run_until_complete(got)
                direct.append(plain(got))
                data = data_proto(tokenizer, case)
                out = manager.loop.run_until_complete(manager.run_single(data))
                managed.append(plain({"score": out["reward_score"], **out["reward_extra_info"]}))
            report[f"{source}/{name}"] = {
                "async": manager.is_async_reward_score,
                "direct": direct,
                "manager": managed,
            }
    print(json.dumps(report), flush=True)
    pause = spec.get("pause_file")
    if pause:
        print("PAUSED", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(pause) and time.monotonic() < deadline:
            time.sleep(0.05)
        manager = managers["compute_score"]
        manager.loop.run_until_complete(manager.run_single(data_proto(tokenizer, cases[0])))
        print("SCORED AFTER THE PAUSE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
