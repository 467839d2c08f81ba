"""``sde2-train`` end to end on a tiny Qwen2 checkpoint built in-process: a real reward server
process, a real TRL ``GRPOTrainer`` step, in seconds (the SmolLM2 runs of
``tests/test_train_e2e.py`` take minutes). What a run leaves behind is checked here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from reward_server.data import GSM8K_DIR
from tests.client_fixtures import ServerProcess, reward_server  # noqa: F401 - fixture
from tests.tiny_models import tiny_qwen2
from trainer_client import train

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny"), chat=True)


def tiny_argv(url: str, model: Path, out: Path, *extra: str) -> list[str]:
    """One GRPO step: 1 prompt x 2 completions of 8 tokens."""
    return [
        "--model", str(model), "--reward-url", url,
        "--data", str(GSM8K_DIR), "--limit", "2",
        "--max-steps", "1", "--num-generations", "2", "--batch-size", "2",
        "--max-new-tokens", "8", "--save-steps", "100", "--no-gradient-checkpointing",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def test_the_run_writes_what_it_trained_with(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    assert (
        train.main(tiny_argv(reward_server.url, tiny_model, out, "--param=explore_rate=0.2")) == 0
    )
    record = json.loads((out / "final" / train.TRAINING_RECORD).read_text())
    assert json.loads((out / train.TRAINING_RECORD).read_text()) == record
    assert record["load_in_4bit"] is False  # no CUDA here, and the record says so
    assert record["optimizer"] == "adamw_torch" and record["bf16"] is False
    assert record["params"] == {"explore_rate": 0.2} and record["recipe"] == "sde2"
    assert (out / "final" / "adapter_config.json").is_file()


def paper_advantages(rewards: list[float], g: int, eps: float = 1e-6) -> torch.Tensor:
    """Paper App. A.2 / SPEC §5: ``(R − μ_b)/(σ_b + eps)`` over each prompt's ``g`` completions,
    ``σ_b`` the population standard deviation, from the step's ``R_final`` (float64)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1)


def eos_prone(model: Any, tokenizer: Any) -> Any:
    """The tiny model with its EOS logit scaled up: about half of the positions end the
    completion, so completions differ in length and the length term (``cfl``) tells them
    apart (an untrained model's completions are otherwise all alike to the reward)."""
    with torch.no_grad():
        row = model.lm_head.weight[tokenizer.eos_token_id]
        row.mul_(12.0 / row.norm())
    return model


def test_trl_trains_on_the_papers_group_advantages(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """TRL's advantages — what enters the GRPO loss — equal the paper's to 1e-6: population std
    (TRL's own scaling, from R_final, gave √((G−1)/G) = 0.866 of them at G = 4)."""
    from trainer_client.modeling import ModelRef, load_model, load_tokenizer

    g = 4
    argv = tiny_argv(reward_server.url, tiny_model, tmp_path / "run", "--recipe", "cfl")
    argv += ["--param=length_target=2", "--num-generations", str(g), "--batch-size", "8"]
    argv += ["--temperature", "1.0", "--max-steps", "2"]
    args = train.build_parser().parse_args(argv)
    ref = ModelRef.parse(str(tiny_model))
    tokenizer = load_tokenizer(ref)
    model = eos_prone(load_model(ref), tokenizer)
    trainer, holder = train.build_trainer(args, model=model, tokenizer=tokenizer)
    assert trainer.args.scale_rewards == "none"
    results: list[Any] = []
    advantages: list[torch.Tensor] = []
    generate = trainer._generate_and_score_completions

    def recording(batch: Any) -> Any:  # what TRL hands its loss, and the reward behind it
        out = generate(batch)
        advantages.append(out["advantages"].detach().clone())
        results.append(holder.last_result)
        return out

    trainer._generate_and_score_completions = recording
    trainer.train()

    assert len(results) == len(advantages) == 2
    for result, adv in zip(results, advantages, strict=True):
        expected = paper_advantages(result.rewards, g)
        assert torch.allclose(adv.double(), expected, atol=1e-6)
        assert result.advantages == pytest.approx(expected.tolist(), abs=1e-9)
    spread = torch.cat(advantages).abs().max().item()
    assert spread > 0.5  # rewards differed within groups: not a check of zeros
    logs = [h for h in trainer.state.log_history if "cfl/raw_reward" in h]
    # The step's Σ_k w_k · mean(R_k) (cfl's weights: 1), while R_final's mean and TRL's own
    # "reward" (the mean advantage) are 0 by construction.
    raw = [sum(sum(v) for v in r.components.values()) / len(r) for r in results]
    assert all(abs(x) > 1e-3 for x in raw)
    assert all(abs(sum(r.rewards)) < 1e-6 for r in results)
    assert [h["cfl/raw_reward"] for h in logs] == pytest.approx(raw, abs=1e-6)
    assert all(abs(h["reward"]) < 1e-6 for h in logs)


def test_a_trainer_that_would_rescale_the_advantages_is_refused() -> None:
    from trl import GRPOConfig

    from trainer_client.trl import SDE2Reward

    def config(**settings: Any) -> Any:
        return GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, **settings)

    holder = SDE2Reward("http://127.0.0.1:19602", returns="advantages", num_generations=4)
    with pytest.raises(ValueError, match=r"scale_rewards='group' \(needs 'none'\)"):
        holder.check_trainer_args(config(num_generations=4))  # TRL's default
    with pytest.raises(ValueError, match=r"num_generations=6 \(needs 4\)"):
        holder.check_trainer_args(
            config(num_generations=6, per_device_train_batch_size=6, scale_rewards="none")
        )
    holder.check_trainer_args(config(num_generations=4, scale_rewards="none"))
    ok = {"num_generations": 4, "scale_rewards": "none"}
    with pytest.raises(ValueError, match=r"reward_weights=\[0.5\] \(needs \[1.0\]"):
        holder.check_trainer_args(config(**ok, reward_weights=[0.5]))  # halves the advantages
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, 1.0\]"):
        holder.check_trainer_args(config(**ok, reward_weights=[1, 1]))  # another function
    with pytest.raises(ValueError, match=r"num_generations_eval=1 \(needs None or 4"):
        holder.check_trainer_args(config(**ok, num_generations_eval=1))
    with pytest.raises(ValueError, match=r"num_generations_eval=8 \(needs None or 4"):
        holder.check_trainer_args(
            config(**ok, num_generations_eval=8, per_device_eval_batch_size=8)
        )
    holder.check_trainer_args(config(**ok, num_generations_eval=4, reward_weights=[1]))
    with pytest.raises(ValueError, match="needs num_generations"):
        SDE2Reward("http://127.0.0.1:19602", returns="advantages")


def test_a_resumed_run_keeps_the_settings_it_was_trained_with(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A resume command without the run's ``--prompt single`` trained step 2 on the multi prompt
    and rewrote the record to say multi: it is refused, naming the flag and the recorded value,
    and each checkpoint carries the record of what it was trained with."""
    out = tmp_path / "run"
    first = tiny_argv(reward_server.url, tiny_model, out, "--save-steps", "1")
    assert train.main([*first, "--prompt", "single", "--param=explore_rate=0.2"]) == 0
    recorded = (out / train.TRAINING_RECORD).read_text()
    assert json.loads((out / "checkpoint-1" / train.TRAINING_RECORD).read_text())["prompt"] == (
        "single"
    )
    capsys.readouterr()
    resume = [*first, "--max-steps", "2", "--resume"]
    with pytest.raises(SystemExit) as refused:
        train.main([*resume, "--temperature", "0.3"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert '--prompt: the run has prompt="single", this command "multi"' in err
    assert '--param/--weight: the run has params={"explore_rate": 0.2}, this command {}' in err
    assert "--temperature: the run has temperature=0.2, this command 0.3" in err
    assert (out / train.TRAINING_RECORD).read_text() == recorded  # left as it was
    assert not (out / "checkpoint-2").exists()  # nothing trained

    assert train.main([*resume, "--prompt", "single", "--param=explore_rate=0.2"]) == 0
    for folder in (out, out / "checkpoint-2", out / "final"):
        record = json.loads((folder / train.TRAINING_RECORD).read_text())
        assert record["prompt"] == "single" and record["params"] == {"explore_rate": 0.2}


def test_the_reward_checks_the_trainer_that_calls_it(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """A holder told G = 2 inside TRL groups of 4 scored half-groups without an error (2
    divides 4), unless the user called ``check_trainer_args``: the function now checks the
    trainer behind TRL's ``log_metric`` at its first call; and a trainer summing another
    reward function with the advantages, or weighting them, is refused given the trainer."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trainer_client.modeling import ModelRef, load_model, load_tokenizer
    from trainer_client.trl import SDE2Reward

    ref = ModelRef.parse(str(tiny_model))
    tokenizer = load_tokenizer(ref)
    data = Dataset.from_list(
        [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    )

    def trainer(holder: SDE2Reward, *funcs: Any, **settings: Any) -> Any:
        config = GRPOConfig(
            output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
            num_generations=4, per_device_train_batch_size=4, max_completion_length=4,
            scale_rewards="none", max_steps=1, save_strategy="no", **settings,
        )  # fmt: skip
        return GRPOTrainer(
            model=load_model(ref),
            reward_funcs=[holder.reward_function, *funcs],
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
        )

    wrong_g = SDE2Reward(reward_server.url, returns="advantages", num_generations=2)
    with pytest.raises(ValueError, match=r"num_generations=4 \(needs 2\)"):
        trainer(wrong_g).train()  # at the first reward call, before any request

    holder = SDE2Reward(reward_server.url, returns="advantages", num_generations=4)

    def length(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    summed = trainer(holder, length)
    with pytest.raises(ValueError, match=r"other reward functions \['length'\]"):
        summed.train()
    weighted = trainer(holder, length, reward_weights=[0.5, 0.0])  # length adds nothing
    with pytest.raises(ValueError, match=r"reward_weights=\[0.5, 0.0\] \(needs 1 for this"):
        holder.check_trainer_args(weighted)
    holder.check_trainer_args(trainer(holder, length, reward_weights=[1.0, 0.0]))


def test_a_sigterm_saves_a_checkpoint_to_resume_from(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """SIGTERM (``timeout``, a scheduler) and Ctrl-C ended the run at once: every step since
    the last save (``--save-steps``, 500) was lost, and nothing was said. The step in progress
    now ends, a checkpoint is saved, and the run exits 143 naming it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    argv = tiny_argv(
        reward_server.url, tiny_model, out, "--max-steps", "400", "--save-steps", "500"
    )
    command = [sys.executable, "-m", "trainer_client.train", *argv]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as run:
        deadline = time.monotonic() + 300
        while not (out / train.TRAINING_RECORD).exists() and time.monotonic() < deadline:
            assert run.poll() is None, run.stderr.read() if run.stderr else ""
            time.sleep(0.2)
        time.sleep(3)  # a few steps in
        os.kill(run.pid, signal.SIGTERM)
        _, err = run.communicate(timeout=300)
    assert run.returncode == 143, err[-2000:]
    (checkpoint,) = out.glob("checkpoint-*")
    step = train.checkpoint_step(checkpoint)
    assert 1 <= step < 400 and not (out / "final").exists()
    assert f"training stopped by SIGTERM at step {step}; last checkpoint: {checkpoint}" in err
    assert "rerun with --resume" in err


def test_a_reward_service_outage_saves_the_finished_steps(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reward server dies after step 1 and stays down past ``--reward-deadline``: the run
    stopped with exit code 2 and no checkpoint (the next was due at ``--save-steps``), so every
    step since the last save was lost. It now saves ``checkpoint-1`` first, holding the weights
    step 1 left (the failed step had not touched them), and a resume from it on a new server
    finishes the run."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from tests.client_fixtures import running_server

    out = tmp_path / "run"
    after_step_1: dict[str, torch.Tensor] = {}
    build = train.build_trainer

    def build_with_an_outage(*args: Any, **kwargs: Any) -> Any:
        trainer, holder = build(*args, **kwargs)

        class ServerDiesAfterStep1(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step == 1:
                    after_step_1.update(
                        (name, p.detach().clone())
                        for name, p in kw["model"].named_parameters()
                        if p.requires_grad
                    )
                    server.kill()

        trainer.add_callback(ServerDiesAfterStep1())
        return trainer, holder

    argv = tiny_argv("", tiny_model, out, "--max-steps", "3", "--reward-deadline", "3")
    with running_server() as server, monkeypatch.context() as patched:
        patched.setattr(train, "build_trainer", build_with_an_outage)
        argv[argv.index("--reward-url") + 1] = server.url
        assert train.main(argv) == 2
    checkpoint = out / "checkpoint-1"
    assert train.latest_checkpoint(out) == checkpoint and train.checkpoint_step(checkpoint) == 1
    assert (checkpoint / "optimizer.pt").is_file() and (
        checkpoint / train.TRAINING_RECORD
    ).is_file()
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert after_step_1 and len(saved) == len(after_step_1)
    for name, value in after_step_1.items():
        key = name.removeprefix("base_model.model.").replace(".default.weight", ".weight")
        assert torch.equal(saved["base_model.model." + key], value), name
    with running_server() as server:
        argv[argv.index("--reward-url") + 1] = server.url
        assert train.main([*argv, "--resume"]) == 0
    assert train.checkpoint_step(train.latest_checkpoint(out) or out) == 3
    assert (out / "final" / "adapter_config.json").is_file()


def test_lora_targets_are_module_names_checked_before_the_load(
    reward_server: ServerProcess,  # noqa: F811
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--lora-target q_proj,v_proj`` went to PEFT as one regular expression, which matched no
    module; any name the model lacks failed only once the weights were loaded. Names separated
    by commas are a list now, and a name the model lacks is refused before the load, with the
    model's layer names."""
    from trainer_client import modeling

    out = tmp_path / "run"
    assert (
        train.main(tiny_argv(reward_server.url, tiny_model, out, "--lora-target=q_proj,v_proj"))
        == 0
    )
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(modeling, "load_model", no_load)
    argv = tiny_argv(reward_server.url, tiny_model, tmp_path / "bad", "--lora-target", "qproj")
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "--lora-target: no layer LoRA can adapt is named 'qproj'; the model's: " in err
    assert "q_proj" in err and "lm_head" in err
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--lora-target", "q_proj,,v_proj"])
    assert "module names separated by commas" in capsys.readouterr().err
    # A module LoRA cannot adapt (PEFT refused it only after the load), a regular expression
    # (PEFT's own reading of a string, as before) and all-linear in another case.
    skeleton = modeling.model_skeleton(modeling.ModelRef(str(tiny_model)))
    for flag, issue in (
        ("mlp", "no layer LoRA can adapt is named 'mlp'"),
        ("q_proj,input_layernorm", "no layer LoRA can adapt is named 'input_layernorm'"),
        (r".*\.(q|v)_proj", None),
        (r".*\.(q|v)_prj", "the regular expression '.*\\\\.(q|v)_prj' matches no layer"),
        ("ALL-LINEAR", None),
    ):
        targets = train.lora_targets(flag)
        found = modeling.lora_target_issue(skeleton, targets)
        assert found is None if issue is None else found.startswith(issue), (flag, found)
    # A config the skeleton cannot be built from: no early check (the load is the judge).
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"model_type": "no-such-architecture"}')
    assert modeling.model_skeleton(modeling.ModelRef(str(odd))) is None
    assert modeling.model_skeleton(modeling.ModelRef(str(tiny_model))) is not None


def test_resume_takes_the_newest_whole_checkpoint(tmp_path: Path) -> None:
    """A save cut short (no trainer_state.json) was picked as the newest and failed once the
    model had loaded; it is passed over."""
    for step, whole in ((2, True), (3, False), (10, True), (11, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if whole:
            (folder / train.TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    assert train.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert train.latest_checkpoint(tmp_path / "none") is None
    (tmp_path / "checkpoint-10" / train.TRAINER_STATE).write_text("{")
    with pytest.raises(train.FlagError, match=r"checkpoint-10/trainer_state\.json cannot be read"):
        train.checkpoint_step(tmp_path / "checkpoint-10")
