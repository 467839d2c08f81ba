"""The other CPU engines of the export: OpenVINO (``--backend openvino``) and CTranslate2
(``--backend ctranslate2``), each behind its optional extra.

Each must be the same encoder as onnxruntime's to SPEC §3's fidelity (against
sentence-transformers: ``tests/test_onnx_encoder.py`` runs its fidelity test on every engine;
and against onnxruntime, text by text), give the same rewards, be safe to call from many
threads, refuse what it cannot run with an error that says why, and reach the server through
the same settings as every backend.
"""

from __future__ import annotations

import builtins
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reward_server.core import ScoreItem, score_batch
from reward_server.encoders import ctranslate2_runtime, fidelity, openvino_runtime
from reward_server.encoders.base import EMBEDDING_DIM, Encoder
from reward_server.encoders.batched import BatchedEncoder
from reward_server.encoders.ctranslate2_runtime import CTranslate2Encoder
from reward_server.encoders.loading import load_encoder
from reward_server.encoders.onnx_runtime import OnnxEncoder
from reward_server.encoders.openvino_runtime import OpenVinoEncoder
from reward_server.service.config import Settings
from tests.encoder_fixtures import (  # noqa: F401  (fixtures)
    encode_concurrently,
    fidelity_texts,
    fp32_export,
    problems,
)
from tests.service_fixtures import http_client, make_service, step_items


@dataclass(frozen=True)
class Engine:
    """One engine as the tests see it: its class, the error it refuses with, its module (and
    extra) name, and its default run size."""

    cls: type[BatchedEncoder]
    unavailable: type[Exception]
    module: str
    default_tokens: int

    @property
    def backend(self) -> str:
        return str(self.cls.backend)


ENGINES = [
    Engine(
        OpenVinoEncoder,
        openvino_runtime.OpenVinoUnavailableError,
        "openvino",
        openvino_runtime.DEFAULT_MAX_BATCH_TOKENS,
    ),
    Engine(
        CTranslate2Encoder,
        ctranslate2_runtime.CTranslate2UnavailableError,
        "ctranslate2",
        ctranslate2_runtime.DEFAULT_MAX_BATCH_TOKENS,
    ),
]


@pytest.fixture(scope="module", params=ENGINES, ids=lambda e: e.backend)
def engine(request: pytest.FixtureRequest) -> Engine:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def encoder(engine: Engine, fp32_export: Path) -> BatchedEncoder:  # noqa: F811
    return engine.cls(fp32_export)


@pytest.fixture(scope="module")
def onnx(fp32_export: Path) -> OnnxEncoder:  # noqa: F811
    return OnnxEncoder(fp32_export)


@pytest.mark.slow
def test_agrees_with_onnxruntime_text_by_text(
    encoder: BatchedEncoder,
    onnx: OnnxEncoder,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """The engines are one encoder: every embedding within 1e-5 of onnxruntime's (measured:
    OpenVINO 2.2e-7, CTranslate2 2.6e-7), whatever each engine's batches (their default
    budgets differ: 1024 and 192 against 512)."""
    ours, theirs = encoder.encode(fidelity_texts), onnx.encode(fidelity_texts)
    assert ours.shape == theirs.shape == (len(fidelity_texts), EMBEDDING_DIM)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert fidelity.row_cosines(theirs, ours).min() >= 0.99999


@pytest.mark.slow
def test_rewards_agree_with_onnxruntime(encoder: BatchedEncoder, onnx: OnnxEncoder) -> None:
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
    engine: Engine,
    encoder: BatchedEncoder,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    assert isinstance(encoder, Encoder)
    assert encoder.name == f"all-MiniLM-L6-v2 {engine.backend} fp32"
    description = encoder.describe()
    assert (description.backend, description.variant, description.provider) == (
        engine.backend,
        "fp32",
        "cpu",
    )
    assert description.max_batch_tokens == engine.default_tokens
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
    engine: Engine,
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """Concurrent callers (each stream thread with its own infer request or replica) and any
    number of streams give the embeddings of one batch at a time."""
    texts = fidelity_texts[:60]
    single = engine.cls(fp32_export, streams=1, max_batch_tokens=256)
    expected = single.encode(texts)
    two = engine.cls(fp32_export, streams=2, intra_op_threads=2, max_batch_tokens=256)
    assert two.streams == 2
    np.testing.assert_allclose(two.encode(texts), expected, atol=1e-6)
    for r in encode_concurrently(two, texts):
        np.testing.assert_allclose(r, expected, atol=1e-6)


def test_refuses_a_gpu(engine: Engine, fp32_export: Path) -> None:  # noqa: F811
    with pytest.raises(engine.unavailable, match=r"CPU only.*--backend onnx"):
        engine.cls(fp32_export, provider="cuda")


def test_refuses_an_export_that_is_not_fp32(
    engine: Engine,
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An int8 folder is refused by name (the engine would run its 8-bit operators differently
    from onnxruntime, and the fidelity gate was passed on onnxruntime)."""
    folder = tmp_path / "int8"
    shutil.copytree(fp32_export, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "variant": "int8"}))
    with pytest.raises(engine.unavailable, match=r"int8 export.*--variant fp32"):
        engine.cls(folder)


def test_says_which_extra_is_missing(
    engine: Engine,
    fp32_export: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def missing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == engine.module or name.startswith(f"{engine.module}."):
            raise ImportError(f"No module named {engine.module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    with pytest.raises(engine.unavailable, match=rf"pip install 'sde2\[{engine.module}\]'"):
        engine.cls(fp32_export)


def test_ctranslate2_without_onnx_names_its_extra(
    fp32_export: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extra's other package: the conversion failed in its child process with a traceback
    ending in ``No module named 'onnx'``, naming no extra."""
    real_import = builtins.__import__

    def missing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "onnx" or name.startswith("onnx."):
            raise ImportError("No module named 'onnx'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    with pytest.raises(
        ctranslate2_runtime.CTranslate2UnavailableError,
        match=r"pip install 'sde2\[ctranslate2\]' \(No module named 'onnx'\)",
    ):
        CTranslate2Encoder(fp32_export)


@pytest.mark.slow
def test_the_server_serves_the_backend(engine: Engine, fp32_export: Path) -> None:  # noqa: F811
    """``--backend openvino|ctranslate2`` reaches the server's loader, ``/v1/info`` names it,
    and a standard step's rewards are onnxruntime's within 1e-5."""
    from reward_server.service.serve import build_encoder

    settings = Settings(backend=engine.backend, model=str(fp32_export), cache_size=0)  # type: ignore[arg-type]
    encoder = build_encoder(settings)
    assert isinstance(encoder, engine.cls)
    items = step_items(7)
    want = score_batch([ScoreItem(**i) for i in items], load_encoder("onnx", str(fp32_export)))
    with http_client(make_service(encoder)) as c:
        info = c.get("/v1/info").json()
        scored = c.post("/v1/score", json={"items": items})
    assert info["encoder"] == f"all-MiniLM-L6-v2 {engine.backend} fp32"
    assert scored.status_code == 200, scored.text
    assert scored.json()["encoder"] == f"all-MiniLM-L6-v2 {engine.backend} fp32"
    np.testing.assert_allclose(scored.json()["rewards"], want.rewards, atol=1e-5)


def test_export_engines_by_backend() -> None:
    from reward_server.encoders.loading import export_engine, runs_export

    assert export_engine("openvino") is OpenVinoEncoder and export_engine("onnx") is OnnxEncoder
    assert export_engine("ctranslate2") is CTranslate2Encoder
    assert not runs_export("torch")
    with pytest.raises(ValueError, match="does not run the ONNX export"):
        export_engine("torch")
