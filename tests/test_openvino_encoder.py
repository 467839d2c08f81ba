"""The OpenVINO backend (``--backend openvino``): the export on OpenVINO's CPU runtime.

It must be the same encoder as onnxruntime's to SPEC §3's fidelity (against sentence-transformers:
``tests/test_onnx_encoder.py`` runs its fidelity test on both engines; and against onnxruntime,
text by text), give the same rewards, be safe to call from many threads,
refuse what it cannot run with an error that says why, and reach the server through the same
settings as every backend.
"""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reward_server.core import ScoreItem, score_batch
from reward_server.encoders import fidelity
from reward_server.encoders.base import EMBEDDING_DIM, Encoder
from reward_server.encoders.loading import load_encoder
from reward_server.encoders.onnx_runtime import OnnxEncoder
from reward_server.encoders.openvino_runtime import (
    DEFAULT_MAX_BATCH_TOKENS,
    OpenVinoEncoder,
    OpenVinoUnavailableError,
)
from reward_server.service.config import Settings
from tests.encoder_fixtures import (  # noqa: F401  (fixtures)
    encode_concurrently,
    fidelity_texts,
    fp32_export,
    problems,
)
from tests.service_fixtures import http_client, make_service, step_items


@pytest.fixture(scope="module")
def encoder(fp32_export: Path) -> OpenVinoEncoder:  # noqa: F811
    return OpenVinoEncoder(fp32_export)


@pytest.fixture(scope="module")
def onnx(fp32_export: Path) -> OnnxEncoder:  # noqa: F811
    return OnnxEncoder(fp32_export)


@pytest.mark.slow
def test_agrees_with_onnxruntime_text_by_text(
    encoder: OpenVinoEncoder,
    onnx: OnnxEncoder,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """The two engines are one encoder: every embedding within 1e-5 (measured: 2.2e-7),
    whatever each engine's batches (their default budgets differ: 1024 against 512)."""
    ours, theirs = encoder.encode(fidelity_texts), onnx.encode(fidelity_texts)
    assert ours.shape == theirs.shape == (len(fidelity_texts), EMBEDDING_DIM)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert fidelity.row_cosines(theirs, ours).min() >= 0.99999


@pytest.mark.slow
def test_rewards_agree_with_onnxruntime(encoder: OpenVinoEncoder, onnx: OnnxEncoder) -> None:
    """Standard GRPO steps scored on each engine: rewards within SPEC's 1e-5, and the Uniq and
    Div of every item the same (no pair near δ moves across it)."""
    for seed in range(3):
        items = [ScoreItem(**i) for i in step_items(seed)]
        ours = score_batch(items, encoder, diagnostics=True)
        theirs = score_batch(items, onnx, diagnostics=True)
        np.testing.assert_allclose(ours.rewards, theirs.rewards, atol=1e-5)
        assert [r.uniq for r in ours.items] == [r.uniq for r in theirs.items]
        np.testing.assert_allclose(
            [r.div or 0.0 for r in ours.items], [r.div or 0.0 for r in theirs.items], atol=1e-5
        )


@pytest.mark.slow
def test_order_determinism_and_accounting(
    encoder: OpenVinoEncoder,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    assert isinstance(encoder, Encoder)
    assert encoder.name == "all-MiniLM-L6-v2 openvino fp32"
    description = encoder.describe()
    assert (description.backend, description.variant, description.provider) == (
        "openvino",
        "fp32",
        "cpu",
    )
    assert description.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS
    assert encoder.encode([]).shape == (0, EMBEDDING_DIM)
    texts = fidelity_texts[:40]
    forward = encoder.encode(texts)
    np.testing.assert_allclose(forward, encoder.encode(texts[::-1])[::-1], atol=1e-5)
    singles = np.stack([encoder.encode([t])[0] for t in texts[:8]])
    np.testing.assert_allclose(forward[:8], singles, atol=1e-5)
    np.testing.assert_array_equal(forward, encoder.encode(texts))  # same batches: same bits
    out, stats = encoder.encode_with_stats(["a b c", "", "one two three four five six"])
    assert out.shape == (3, EMBEDDING_DIM)
    assert stats.tokens == stats.padded_tokens == 5 + 2 + 8 and stats.batches == 3


@pytest.mark.slow
def test_threads_and_streams_give_the_same_embeddings(
    encoder: OpenVinoEncoder,
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """Concurrent callers (each stream thread has its own infer request) and any number of
    streams give the embeddings of one batch at a time."""
    texts = fidelity_texts[:60]
    single = OpenVinoEncoder(fp32_export, streams=1, max_batch_tokens=256)
    expected = single.encode(texts)
    two = OpenVinoEncoder(fp32_export, streams=2, intra_op_threads=2, max_batch_tokens=256)
    assert two.streams == 2
    np.testing.assert_allclose(two.encode(texts), expected, atol=1e-6)
    for r in encode_concurrently(two, texts):
        np.testing.assert_allclose(r, expected, atol=1e-6)


def test_refuses_a_gpu(fp32_export: Path) -> None:  # noqa: F811
    with pytest.raises(OpenVinoUnavailableError, match=r"CPU only.*--backend onnx"):
        OpenVinoEncoder(fp32_export, provider="cuda")


def test_refuses_an_export_that_is_not_fp32(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An int8 folder is refused by name (OpenVINO would run its 8-bit operators differently
    from onnxruntime, and the fidelity gate was passed on onnxruntime)."""
    folder = tmp_path / "int8"
    shutil.copytree(fp32_export, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "variant": "int8"}))
    with pytest.raises(OpenVinoUnavailableError, match=r"int8 export.*--variant fp32"):
        OpenVinoEncoder(folder)


def test_says_which_extra_is_missing(
    fp32_export: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def no_openvino(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "openvino" or name.startswith("openvino."):
            raise ImportError("No module named 'openvino'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openvino)
    with pytest.raises(OpenVinoUnavailableError, match=r"pip install 'sde2\[openvino\]'"):
        OpenVinoEncoder(fp32_export)


@pytest.mark.slow
def test_the_server_serves_the_openvino_backend(fp32_export: Path) -> None:  # noqa: F811
    """``--backend openvino`` reaches the server's loader, ``/v1/info`` names it, and a
    standard step's rewards are onnxruntime's within 1e-5."""
    from reward_server.service.serve import build_encoder

    settings = Settings(backend="openvino", model=str(fp32_export), cache_size=0)
    encoder = build_encoder(settings)
    assert isinstance(encoder, OpenVinoEncoder)
    items = step_items(7)
    want = score_batch([ScoreItem(**i) for i in items], load_encoder("onnx", str(fp32_export)))
    with http_client(make_service(encoder)) as c:
        info = c.get("/v1/info").json()
        scored = c.post("/v1/score", json={"items": items})
    assert info["encoder"] == "all-MiniLM-L6-v2 openvino fp32"
    assert scored.status_code == 200, scored.text
    assert scored.json()["encoder"] == "all-MiniLM-L6-v2 openvino fp32"
    np.testing.assert_allclose(scored.json()["rewards"], want.rewards, atol=1e-5)


def test_export_engines_by_backend() -> None:
    from reward_server.encoders.loading import export_engine, runs_export

    assert export_engine("openvino") is OpenVinoEncoder and export_engine("onnx") is OnnxEncoder
    assert not runs_export("torch")
    with pytest.raises(ValueError, match="does not run the ONNX export"):
        export_engine("torch")
