"""The CTranslate2 model of an export: read from the export's graph, converted once, refused
when the graph is not the BERT it knows (``reward_server/encoders/ctranslate2_convert.py``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from reward_server.encoders import model_store
from reward_server.encoders.ctranslate2_convert import (
    UnsupportedGraphError,
    read_bert_weights,
)
from reward_server.encoders.ctranslate2_runtime import CTranslate2Encoder, mean_pooled_units
from reward_server.encoders.model_store import MODEL_FILE, ensure_ctranslate2_model
from reward_server.encoders.onnx_runtime import OnnxEncoder
from tests.encoder_fixtures import fp32_export  # noqa: F401  (fixture)


def test_reads_every_weight_of_the_export(fp32_export: Path) -> None:  # noqa: F811
    """Six layers of all-MiniLM-L6-v2, each projection (out, in) as CTranslate2 stores it, and
    the values the graph holds (the first layer's Q, K, V are the packed Attention weight)."""
    w = read_bert_weights(fp32_export / MODEL_FILE)
    assert (len(w.layers), w.num_heads, w.epsilon) == (6, 12, pytest.approx(1e-12))
    assert w.word_embeddings.shape == (30522, 384) and w.position_embeddings.shape == (512, 384)
    layer = w.layers[0]
    assert layer.qkv.weight.shape == (1152, 384) and layer.qkv.bias.shape == (1152,)
    assert layer.ffn_in.weight.shape == (1536, 384) and layer.ffn_out.weight.shape == (384, 1536)
    graph = onnx.load(str(fp32_export / MODEL_FILE)).graph
    packed = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    np.testing.assert_array_equal(layer.qkv.weight, packed["Attention_0_qkv_weight"].T)
    # The layers are distinct (the walk moved from one layer to the next).
    assert not np.array_equal(w.layers[0].ffn_in.weight, w.layers[1].ffn_in.weight)


def _edited(export: Path, tmp_path: Path, edit: str) -> Path:
    """A copy of the export's graph with one change: ``skip``, the first layer norm as the
    fused residual (an older recipe); ``eps``, a layer norm with its own epsilon (CTranslate2
    has one); ``no-embed``, no embedding layer (not BERT)."""
    model = onnx.load(str(export / MODEL_FILE))
    nodes = list(model.graph.node)
    first = next(n for n in nodes if n.op_type == "LayerNormalization")
    if edit == "skip":
        first.op_type = "SkipLayerNormalization"
        first.domain = "com.microsoft"
    elif edit == "eps":
        next(a for a in first.attribute if a.name == "epsilon").f = 1e-5
    else:
        model.graph.node.remove(next(n for n in nodes if n.op_type == "EmbedLayerNormalization"))
    path = tmp_path / f"{edit}.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("skip", r"fuses each residual.*export it again"),
        ("eps", "an epsilon other than the embeddings'"),
        ("no-embed", "EmbedLayerNormalization"),
    ],
)
def test_refuses_a_graph_it_does_not_know(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    edit: str,
    message: str,
) -> None:
    with pytest.raises(UnsupportedGraphError, match=message):
        read_bert_weights(_edited(fp32_export, tmp_path, edit))


def test_converts_once_into_the_cache(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keyed by the graph's digest, the conversion's recipe and CTranslate2's release; folders
    left by a conversion that died half-way (or an entry emptied by hand) are replaced, never
    loaded; a second encoder reuses the model, and it encodes as onnxruntime does."""
    root = tmp_path / "cache"
    digest = model_store.graph_digest(fp32_export)
    folder = root / model_store.CTRANSLATE2_DIR
    target = ensure_ctranslate2_model(fp32_export, root=root)
    assert target.parent == folder and target.name.startswith(f"{digest}-r1-ct")
    partial = target.with_name(f"{target.name}.partial")
    assert not partial.exists() and (target / "model.bin").stat().st_size > 80e6
    shutil.rmtree(target)  # what a dead conversion leaves, and an entry pruned by hand
    for leftover in (partial, target):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    assert ensure_ctranslate2_model(fp32_export, root=root) == target
    assert not partial.exists() and (target / "model.bin").stat().st_size > 80e6
    stamp = os.stat(target / "model.bin").st_mtime_ns
    calls: list[object] = []
    monkeypatch.setattr(model_store, "_run_child", lambda *a: calls.append(a))
    assert ensure_ctranslate2_model(fp32_export, root=root) == target
    assert calls == [] and os.stat(target / "model.bin").st_mtime_ns == stamp
    monkeypatch.setenv("SDE2_CACHE_DIR", str(root))
    texts = ["x", "Multiply the 3 boxes by the 6 apples in each box: 3 * 6 = 18 apples."]
    got = CTranslate2Encoder(fp32_export).encode(texts)
    assert calls == []  # the cached model, not a second conversion
    # The same encoder as onnxruntime's (a Q, K, V or transpose mistake is far off).
    np.testing.assert_allclose(got, OnnxEncoder(fp32_export).encode(texts), atol=1e-5)


def test_a_failed_conversion_says_why(fp32_export: Path, tmp_path: Path) -> None:  # noqa: F811
    """An export whose graph cannot be converted fails with the converter's reason."""
    folder = tmp_path / "old"
    folder.mkdir()
    for f in fp32_export.iterdir():
        if f.name != MODEL_FILE:
            (folder / f.name).write_bytes(f.read_bytes())
    _edited(fp32_export, tmp_path, "skip").rename(folder / MODEL_FILE)
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(model_store.ModelExportError, match=r"fuses each residual"):
        ensure_ctranslate2_model(folder, root=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("model.bin"))  # nothing to load by mistake


def test_mean_pooling_never_reads_padding() -> None:
    """Positions past a text's length do not count, even where an engine left NaN there."""
    hidden = np.full((2, 3, 2), np.nan, dtype=np.float32)
    hidden[0, :2] = [[3.0, 0.0], [0.0, 4.0]]
    hidden[1, :3] = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    out = mean_pooled_units(hidden, np.array([2, 3]))
    np.testing.assert_allclose(out, [[0.6, 0.8], [1.0, 0.0]], rtol=1e-6)


def test_an_unwritable_cache_says_what_to_set(fp32_export: Path, tmp_path: Path) -> None:  # noqa: F811
    """No model yet and a cache it cannot write: the error names SDE2_CACHE_DIR."""
    root = tmp_path / "read-only"
    root.write_text("a file where the cache folder should be")
    with pytest.raises(model_store.ModelExportError, match=r"SDE2_CACHE_DIR"):
        ensure_ctranslate2_model(fp32_export, root=root)


def test_a_damaged_conversion_is_converted_again(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cached model.bin with bytes zeroed (its size unchanged) loaded without complaint and
    embedded wrongly (400 KB: cosine 0.985 against onnxruntime); an entry whose files differ
    from the digests written after its conversion is converted again, said in the log."""
    root = tmp_path / "cache"
    target = ensure_ctranslate2_model(fp32_export, root=root)
    digests = json.loads((target / model_store.CONVERSION_DIGESTS).read_text())
    assert set(digests) == {p.name for p in target.iterdir()} - {model_store.CONVERSION_DIGESTS}
    with (target / "model.bin").open("r+b") as f:
        f.seek(20_000_000)
        f.write(b"\0" * 400_000)
    with caplog.at_level("WARNING", logger=model_store.__name__):
        assert ensure_ctranslate2_model(fp32_export, root=root) == target
    assert "model.bin damaged or unverifiable: converting the model for ctranslate2 again" in (
        caplog.text
    )
    assert json.loads((target / model_store.CONVERSION_DIGESTS).read_text()) == digests
    monkeypatch.setenv("SDE2_CACHE_DIR", str(root))
    texts = ["Multiply the 3 boxes by the 6 apples in each box: 3 * 6 = 18 apples."]
    got = CTranslate2Encoder(fp32_export).encode(texts)
    np.testing.assert_allclose(got, OnnxEncoder(fp32_export).encode(texts), atol=1e-5)
