"""The paper's QLoRA setting (4-bit NF4 base, 8-bit AdamW) is never silently off.

``sde2-train`` on a CUDA machine without ``bitsandbytes`` trained in bf16 with ``adamw_torch``
and said nothing; it now refuses at start, naming the extra to install and the flag to opt out.
``sde2-eval`` evaluates an adapter on the base quantization its training run used (the run's
``sde2_training.json``), or refuses when that cannot load, naming the flag that overrides it.
CUDA is faked by the project's own ``cuda_available`` (this machine has none); the absence of
``bitsandbytes`` by hiding its module spec from ``importlib`` (whatever the environment has).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from reward_server.data import GSM8K_DIR
from tests.test_eval_inputs import URL, FakeClient, _generated, fake_client  # noqa: F401
from trainer_client import evaluate, modeling, train


@pytest.fixture
def cuda_without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA machine (as torch would report it) where ``bitsandbytes`` is not installed."""
    find_spec = importlib.util.find_spec

    def hidden(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name.split(".")[0] == "bitsandbytes" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setattr(modeling, "cuda_available", lambda: True)


def train_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--model", "org/model", "--reward-url", "http://127.0.0.1:19601",
        "--data", str(GSM8K_DIR), "--limit", "2", "--output-dir", str(tmp_path / "run"), *extra,
    ]  # fmt: skip


def test_train_refuses_to_start_on_cuda_without_bitsandbytes(
    cuda_without_bitsandbytes: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:  # before the server probe and the model
        train.main(train_argv(tmp_path))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "bitsandbytes" in err and "pip install 'sde2[qlora]'" in err and "--no-4bit" in err
    assert not (tmp_path / "run").exists()


def test_no_4bit_opts_out_and_says_so(
    cuda_without_bitsandbytes: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = train.build_parser().parse_args(train_argv(tmp_path, "--no-4bit"))
    with caplog.at_level(logging.INFO, logger="sde2.train"):
        assert train.use_4bit(args) is False
    assert "--no-4bit: full-precision base weights, adamw_torch" in caplog.text


def test_the_record_holds_the_precision_and_optimizer_trl_got(tmp_path: Path) -> None:
    args = train.build_parser().parse_args(train_argv(tmp_path))
    config = train.grpo_config(args, quantize_4bit=True, cuda=False)
    record = train.training_record(args, config, True, {"similarity_threshold": 0.75})
    assert record["load_in_4bit"] is True and record["optimizer"] == "adamw_8bit"
    assert record["params"] == {"similarity_threshold": 0.75}
    train.write_training_record(tmp_path / "final", record)
    assert json.loads((tmp_path / "final" / train.TRAINING_RECORD).read_text()) == record
    assert evaluate.TRAINING_RECORD == train.TRAINING_RECORD  # what sde2-eval looks for


def adapter_trained(folder: Path, load_in_4bit: bool) -> Path:
    """An adapter folder with its training run's record (the weights are not read first)."""
    folder.mkdir(parents=True)
    record = {"model": "org/model", "load_in_4bit": load_in_4bit, "optimizer": "adamw_8bit"}
    (folder / train.TRAINING_RECORD).write_text(json.dumps(record))
    return folder


def test_eval_refuses_a_4bit_trained_adapter_it_cannot_load_so(
    tmp_path: Path,
    fake_client: type[FakeClient],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = adapter_trained(tmp_path / "final", load_in_4bit=True)
    argv = ["--reward-url", URL, "--model", str(tmp_path), "--adapter", str(adapter)]
    with pytest.raises(SystemExit) as stop:  # no CUDA here: a 4-bit base cannot load
        evaluate.main([*argv, "--data", str(GSM8K_DIR), "--limit", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"{adapter / train.TRAINING_RECORD} says the adapter was trained on a 4-bit base" in err
    assert "--base-quantization none" in err and "sde2[qlora]" in err
    assert fake_client.requests == []


def test_eval_follows_the_record_unless_told(
    tmp_path: Path, cuda_without_bitsandbytes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantized = adapter_trained(tmp_path / "q" / "final", load_in_4bit=True)
    full = adapter_trained(tmp_path / "f" / "final", load_in_4bit=False)
    checkpoint = tmp_path / "q" / "checkpoint-500"  # its record is its run's, one folder up
    checkpoint.mkdir()
    (tmp_path / "q" / train.TRAINING_RECORD).write_text(json.dumps({"load_in_4bit": True}))

    def decided(*flags: str) -> tuple[bool, str]:
        argv = ["--reward-url", URL, "--model", "org/model", *flags]
        args = evaluate.build_parser().parse_args(argv)
        return evaluate.base_quantization(args, evaluate.adapter_record(args))

    assert decided("--adapter", str(full))[0] is False
    assert decided("--adapter", str(quantized), "--base-quantization", "none")[0] is False
    assert decided()[0] is False  # a base model alone: full precision
    monkeypatch.setattr(modeling, "bitsandbytes_available", lambda: True)  # a QLoRA machine
    assert decided("--adapter", str(quantized)) == (
        True,
        f"auto: {quantized / train.TRAINING_RECORD} says the adapter was trained on a 4-bit base",
    )
    assert decided("--adapter", str(checkpoint))[0] is True


def test_eval_reads_the_record_once_per_run(
    tmp_path: Path,
    fake_client: type[FakeClient],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scoring, the prompt warning and the base quantization (decided before the
    generation, again at it and again for ``--json``) each read the record anew: it is read
    once, and every one of them follows that reading."""
    adapter = tmp_path / "final"
    adapter.mkdir()
    path = adapter / train.TRAINING_RECORD
    path.write_text(json.dumps({"recipe": "cfl", "prompt": "single", "load_in_4bit": False}))
    reads: list[Path] = []
    read = evaluate.read_training_record

    def counted(record: Path) -> dict[str, Any]:
        reads.append(record)
        return read(record)

    monkeypatch.setattr(evaluate, "read_training_record", counted)
    monkeypatch.setattr(evaluate, "generate_run", _generated)
    out = tmp_path / "eval.json"
    argv = ["--reward-url", URL, "--model", "org/model", "--adapter", str(adapter)]
    argv += ["--data", str(GSM8K_DIR), "--limit", "1", "--json", str(out)]
    with caplog.at_level(logging.INFO, logger="sde2.eval"):
        assert evaluate.main(argv) == 0
    assert reads == [path]
    meta = json.loads(out.read_text())["meta"]
    assert meta["base_quantization"] == {"4bit": False, "why": f"auto: full precision ({path})"}
    assert meta["recipe"] == "cfl" and meta["scoring_from"]["recipe"] == str(path)
    assert f"--prompt multi, but {path} says the adapter was trained with --prompt single" in (
        caplog.text
    )


def test_the_refusal_names_the_extra_only_where_it_installs_bitsandbytes(
    cuda_without_bitsandbytes: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extra's marker installs bitsandbytes on Linux and Windows (PyPI has its CUDA wheels
    for both); the refusal told every CUDA user to install it, and the marker left Windows
    out. Elsewhere the extra installs nothing: the refusal says --no-4bit alone."""
    import tomllib

    from packaging.markers import Marker
    from packaging.requirements import Requirement

    monkeypatch.setattr(modeling, "platform", lambda: "darwin")
    with pytest.raises(SystemExit) as stop:
        train.main(train_argv(tmp_path))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "pass --no-4bit" in err and "not on darwin" in err and "pip install" not in err

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    (spec,) = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["qlora"]
    marker = Requirement(spec).marker
    assert isinstance(marker, Marker)
    for platform in ("linux", "win32", "darwin"):
        installs = marker.evaluate({"sys_platform": platform})
        assert installs == (platform in modeling.QLORA_PLATFORMS), platform
    assert set(modeling.QLORA_PLATFORMS) == {"linux", "win32"}
