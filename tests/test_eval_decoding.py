"""``sde2-eval`` decodes as ``sde2-train`` samples: the paper's temperature and top-p only.

A checkpoint's ``generation_config.json`` is not the paper's decoding: Qwen2.5-3B-Instruct ships
``repetition_penalty=1.05``, ``top_k=20``, ``top_p=0.8`` and ``temperature=0.7``, and
``generate`` fills every setting a call leaves unset from it. Training through TRL samples with
``top_k=0`` and ``repetition_penalty=1.0``; evaluation must too, or the table measures another
decoding than the one trained (the penalty even applied greedily). The logits processors
``generate`` really builds are observed on a tiny Qwen2 checkpoint carrying Qwen's settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers.generation import utils as generation_utils

from reward_server.data import GSM8K_DIR
from tests.test_eval_inputs import URL, FakeClient, fake_client  # noqa: F401 - fixture
from tests.tiny_models import tiny_qwen2
from trainer_client import evaluate
from trainer_client.datasets import Example

#: Qwen/Qwen2.5-3B-Instruct's published generation_config.json (sampling part).
QWEN_INSTRUCT = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


@pytest.fixture(scope="module")
def qwenlike(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("qwenlike"), chat=True, generation=QWEN_INSTRUCT)


@pytest.fixture
def processors(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The logits processors of each ``generate`` call, as transformers built them (the real
    method runs; its result is only read)."""
    seen: list[list[str]] = []
    build = generation_utils.GenerationMixin._get_logits_processor

    def observed(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = build(self, *args, **kwargs)
        seen.append([type(p).__name__ for p in out])
        return out

    monkeypatch.setattr(generation_utils.GenerationMixin, "_get_logits_processor", observed)
    return seen


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [("0.2", ["TemperatureLogitsWarper", "TopPLogitsWarper"]), ("0", [])],
)
def test_only_temperature_and_top_p_shape_the_tokens(
    qwenlike: Path, processors: list[list[str]], temperature: str, expected: list[str]
) -> None:
    argv = ["--reward-url", URL, "--model", str(qwenlike), "--max-new-tokens", "3"]
    parser = evaluate.build_parser()
    args = parser.parse_args([*argv, "--temperature", temperature])
    evaluate.check_arguments(parser, args)  # decides the base quantization, as main does
    run, _ = evaluate.generate_run(args, [Example("2 + 2?", "4", "numeric")] * 2)
    assert processors == [expected]  # no RepetitionPenalty, no TopK from the checkpoint
    assert run.decoding is not None
    assert run.decoding["top_k"] == 0 and run.decoding["repetition_penalty"] == 1.0
    assert run.decoding["min_p"] is None
    assert run.decoding["do_sample"] is (temperature != "0")


def test_every_decoding_setting_is_in_the_json(
    qwenlike: Path,
    processors: list[list[str]],
    fake_client: type[FakeClient],  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "eval.json"
    argv = ["--reward-url", URL, "--model", str(qwenlike), "--data", str(GSM8K_DIR)]
    argv += ["--split", "test", "--limit", "2", "--max-new-tokens", "3", "--json", str(out)]
    assert evaluate.main([*argv, "--temperature", "0.25", "--top-p", "0.9"]) == 0
    decoding = json.loads(out.read_text())["meta"]["decoding"]
    tokenizer_eos = 1  # tiny_qwen2's <|im_end|>, the checkpoint's EOS too
    assert decoding == {
        "do_sample": True,
        "temperature": 0.25,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "max_new_tokens": 3,
        "eos_token_id": [tokenizer_eos],
        "pad_token_id": 0,
    }


def test_a_generated_run_is_kept_and_counted_as_generated(
    qwenlike: Path,
    fake_client: type[FakeClient],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """#TOK was the decoded text tokenized again (past --max-new-tokens on this model); a
    --save-completions that could not be written ended the command with a traceback, the
    generation lost; and the flags printed to score a kept run again left out its recipe and
    parameters (its Uniq was then counted at the server's δ)."""
    import shlex

    argv = ["--reward-url", URL, "--model", str(qwenlike), "--data", str(GSM8K_DIR)]
    argv += ["--split", "test", "--limit", "4", "--max-new-tokens", "6", "--temperature", "1"]
    argv += ["--recipe", "cfl", "--param", "length_target=64", "--save-completions", "/dev/full"]
    fake_client.fail = True
    assert evaluate.main(argv) == 2
    assert "cannot write the generated completions to /dev/full" in caplog.text
    err = capsys.readouterr().err
    (flags,) = [line for line in err.splitlines() if "score them again with" in line]
    again = shlex.split(flags.partition("score them again with ")[2])
    kept = Path(again[1].partition("=")[2])
    assert again[2:] == ["--recipe", "cfl", "--param=length_target=64"]
    lines = [json.loads(line) for line in kept.read_text().splitlines()]
    assert len(lines) == 4 and all(1 <= line["num_tokens"] <= 6 for line in lines)
    fake_client.fail = False
    assert evaluate.main(["--reward-url", URL, *again]) == 0
    assert fake_client.options[-1]["recipe"] == "cfl"
    assert fake_client.options[-1]["params"] == {"length_target": 64}
    kept.unlink()
