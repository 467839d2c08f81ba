"""OnnxEncoder: fidelity to sentence-transformers, batching, stats, threads, provider checks."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from reward_server.encoders import fidelity
from reward_server.encoders.base import EMBEDDING_DIM, MAX_SEQ_LENGTH, Encoder
from reward_server.encoders.batched import BatchedEncoder, available_cpus, plan_batches
from reward_server.encoders.ctranslate2_runtime import CTranslate2Encoder
from reward_server.encoders.model_store import verify_manifest
from reward_server.encoders.onnx_runtime import (
    CUDA_LENGTH_MULTIPLE,
    CUDA_ROW_MULTIPLE,
    OnnxEncoder,
    ProviderUnavailableError,
    check_provider_available,
    check_session_provider,
)
from reward_server.encoders.openvino_runtime import OpenVinoEncoder
from tests.encoder_fixtures import (  # noqa: F401  (fixtures)
    encode_concurrently,
    fidelity_texts,
    fp32_export,
    problems,
    reference_embeddings,
    reference_encoder,
)

MIN_COSINE = 0.9999  # SPEC §3


@pytest.fixture(scope="module")
def encoder(fp32_export: Path) -> OnnxEncoder:  # noqa: F811
    return OnnxEncoder(fp32_export)


# ------------------------------------------------------------------ fidelity (slow: needs export)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [OnnxEncoder, OpenVinoEncoder, CTranslate2Encoder])
@pytest.mark.parametrize("budget", [1, None, 1_000_000])
def test_fp32_matches_sentence_transformers_on_every_text(
    encoder: OnnxEncoder,
    fidelity_texts: list[str],  # noqa: F811
    reference_embeddings: npt.NDArray[np.float32],  # noqa: F811
    engine: type[BatchedEncoder],
    budget: int | None,
) -> None:
    """Each engine that runs the export (onnxruntime, OpenVINO, CTranslate2). budget 1: one
    text per batch; None: the engine's default runs; 1e6: everything padded to 256."""
    texts, ref = fidelity_texts, reference_embeddings
    if budget == 1:  # one run per text: a 100-text slice is enough to check batch-size 1
        texts, ref = texts[:100], ref[:100]
    if budget == 1_000_000:  # one batch of one very long text + many short ones: heavy padding
        lengths = [len(ids) for ids in encoder._tokenizer.encode_batch(texts)]
        longest = int(np.argmax(lengths))
        short = [i for i in np.argsort(lengths) if lengths[i] < 40][:40]
        idx = [longest, *short]
        texts, ref = [texts[i] for i in idx], ref[idx]
        assert lengths[longest] == MAX_SEQ_LENGTH
    # min_row_fill=0 lets short texts join the long one's batch (the budget-1e6 case).
    enc = engine(encoder.model_dir, max_batch_tokens=budget, min_row_fill=0.0)
    out, stats = enc.encode_with_stats(texts)
    cos = fidelity.row_cosines(ref, out)
    assert cos.min() >= MIN_COSINE, f"worst text: {texts[int(np.argmin(cos))][:200]!r}"
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    if budget == 1:
        assert stats.batches == len(texts) and stats.padded_tokens == stats.tokens
    if budget == 1_000_000:
        assert stats.batches == 1 and stats.padded_tokens == len(texts) * MAX_SEQ_LENGTH


@pytest.mark.slow
def test_order_and_determinism(encoder: OnnxEncoder, fidelity_texts: list[str]) -> None:  # noqa: F811
    texts = fidelity_texts[:40]
    forward = encoder.encode(texts)
    backward = encoder.encode(texts[::-1])
    np.testing.assert_allclose(forward, backward[::-1], atol=1e-5)
    singles = np.stack([encoder.encode([t])[0] for t in texts[:8]])
    np.testing.assert_allclose(forward[:8], singles, atol=1e-5)


def test_padded_shapes_leave_every_embedding_as_it_was(
    fp32_export: Path,  # noqa: F811
    encoder: OnnxEncoder,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """CUDA's runs are padded to repeating shapes (``pad_shapes``): the extra columns are masked
    and the extra rows dropped, so each text's embedding is the one its exact run gives."""
    assert not encoder.pad_shapes  # CPU's default: no FLOPs spent on padding
    padded = OnnxEncoder(fp32_export, pad_shapes=True, max_batch_tokens=4096)
    runs: list[tuple[int, int]] = []
    texts_and_lengths: list[tuple[int, int]] = []  # each run's real rows and longest text
    session = padded._session

    class Recording:  # the session, noting each run's shape
        def run(self, outputs: Any, feeds: dict[str, npt.NDArray[np.int64]]) -> Any:
            runs.append(feeds["input_ids"].shape)
            real = feeds["input_ids"][:, 0] != 0  # a text starts with [CLS]; a pad row is [PAD]
            longest = int(feeds["attention_mask"][real].sum(axis=1).max())
            texts_and_lengths.append((int(real.sum()), longest))
            return session.run(outputs, feeds)

    padded._session = Recording()
    texts = fidelity_texts[:45]
    out, stats = padded.encode_with_stats(texts)
    exact, exact_stats = encoder.encode_with_stats(texts)
    np.testing.assert_allclose(out, exact, atol=1e-5)
    assert len(runs) > 1
    # Rows rounded up, but for a full batch (as many rows as the budget holds at its length).
    assert all(r % CUDA_ROW_MULTIPLE == 0 or r == 4096 // n for r, n in runs)
    assert all(n % CUDA_LENGTH_MULTIPLE == 0 for _, n in runs)
    # Runs of several texts (shorter ones masked within the run), rows added, columns added.
    assert any(real > 1 for real, _ in texts_and_lengths)
    assert any(real < r for (r, _), (real, _) in zip(runs, texts_and_lengths, strict=True))
    assert any(longest < n for (_, n), (_, longest) in zip(runs, texts_and_lengths, strict=True))
    # The tokens computed, as the metrics count them, include the rounding.
    assert stats.padded_tokens == sum(r * n for r, n in runs) > exact_stats.padded_tokens
    # The length is rounded no further than the model's positions reach.
    assert padded._run_shape(3, padded.max_seq_length - 1) == (16, padded.max_seq_length)
    padded.max_batch_tokens = 4095  # rows rounded up only within the budget
    assert padded._run_shape(3, padded.max_seq_length - 1) == (3, padded.max_seq_length)
    padded.max_batch_tokens = 1 << 16
    padded.max_seq_length = 300  # a model of 300 positions: 290 tokens run at 300, not 320
    assert padded._run_shape(3, 290) == (16, 300) and padded._run_shape(3, 300) == (16, 300)


@pytest.mark.parametrize("budget", [64, 4096])
def test_padded_runs_stay_within_the_batch_budget(
    fp32_export: Path,  # noqa: F811
    budget: int,
) -> None:
    """``max_batch_tokens`` (``--encoder-batch-tokens``, "padded tokens per encoder run") bounds
    the shape a run is computed at, the CUDA rounding included: batches planned at their exact
    lengths ran 300 texts of 3-4 tokens 16 x 32 under a budget of 64 and 304 x 32 under 4096."""
    padded = OnnxEncoder(fp32_export, pad_shapes=True, max_batch_tokens=budget, streams=1)
    runs: list[tuple[int, int]] = []
    session = padded._session

    class Recording:  # the session, noting each run's shape
        def run(self, outputs: Any, feeds: dict[str, npt.NDArray[np.int64]]) -> Any:
            runs.append(feeds["input_ids"].shape)
            return session.run(outputs, feeds)

    padded._session = Recording()
    longest = 12 if budget < MAX_SEQ_LENGTH else 40  # 62 or 202 tokens: a row fits the budget
    texts = [f"w{i}" for i in range(300)]
    texts += ["two plus two is four " * k for k in range(1, longest + 1)]
    out, stats = padded.encode_with_stats(texts)
    assert runs and all(r * n <= budget and n % CUDA_LENGTH_MULTIPLE == 0 for r, n in runs), runs
    assert stats.padded_tokens == sum(r * n for r, n in runs)
    exact = OnnxEncoder(fp32_export, streams=1).encode(texts)
    np.testing.assert_allclose(out, exact, atol=1e-5)


@pytest.mark.slow
def test_protocol_name_empty_and_stats(encoder: OnnxEncoder) -> None:
    assert isinstance(encoder, Encoder)
    assert encoder.name == "all-MiniLM-L6-v2 onnx fp32"
    assert encoder.encode([]).shape == (0, EMBEDDING_DIM)
    before = encoder.totals.texts, encoder.totals.batches
    out, stats = encoder.encode_with_stats(["a b c", "", "one two three four five six"])
    assert out.shape == (3, EMBEDDING_DIM) and out.dtype == np.float32
    assert stats.tokens == 5 + 2 + 8  # [CLS] ... [SEP] each
    assert stats.batches == 3 and stats.padded_tokens == 5 + 2 + 8  # lengths too different
    assert encoder.totals.texts == before[0] + 3
    assert encoder.totals.batches == before[1] + 3
    encoder.warmup()


@pytest.mark.slow
def test_concurrent_calls_agree(encoder: OnnxEncoder, fidelity_texts: list[str]) -> None:  # noqa: F811
    texts = fidelity_texts[:12]
    expected = encoder.encode(texts)
    for r in encode_concurrently(encoder, texts):
        np.testing.assert_allclose(r, expected, atol=1e-5)


@pytest.mark.slow
def test_threads_option(fp32_export: Path) -> None:  # noqa: F811
    assert OnnxEncoder(fp32_export, intra_op_threads=1).intra_op_threads == 1
    assert OnnxEncoder(fp32_export).intra_op_threads == available_cpus()
    # 0 read as the default (``or``), and a negative count was kept as given.
    for option in ("intra_op_threads", "max_batch_tokens", "streams"):
        for value in (0, -3):
            with pytest.raises(ValueError, match=f"{option} must be >= 1"):
                OnnxEncoder(fp32_export, **{option: value})  # type: ignore[arg-type]


def test_an_engine_run_of_the_wrong_shape_fails_the_call(
    encoder: OnnxEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy spread a run's one row over all of its texts' rows, silently."""
    monkeypatch.setattr(encoder, "_run", lambda ids, mask: np.ones((1, 384), np.float32))
    with pytest.raises(RuntimeError, match=r"returned \(1, 384\) for a run of 3 texts"):
        encoder.encode(["one", "two", "three"])


@pytest.mark.slow
def test_streams_give_the_embeddings_and_stats_of_one_stream(
    fp32_export: Path,  # noqa: F811
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    """Two batches at once, each with its share of the threads: bit for bit the embeddings of
    one batch at a time, in input order, with the same accounting (many small batches, so that
    both streams really run)."""
    texts = [*fidelity_texts[:60], "short", "a much longer text " * 40]
    one = OnnxEncoder(fp32_export, intra_op_threads=2, streams=1, max_batch_tokens=256)
    two = OnnxEncoder(fp32_export, intra_op_threads=2, streams=2, max_batch_tokens=256)
    a, stats_a = one.encode_with_stats(texts)
    b, stats_b = two.encode_with_stats(texts)
    assert stats_a.batches > 4
    np.testing.assert_array_equal(a, b)
    assert (stats_b.batches, stats_b.padded_tokens, stats_b.tokens) == (
        stats_a.batches,
        stats_a.padded_tokens,
        stats_a.tokens,
    )
    assert {t.name.split("_")[0] for t in threading.enumerate()} >= {"sde2-onnx"}


@pytest.mark.slow
def test_streams_default_and_thread_share(fp32_export: Path) -> None:  # noqa: F811
    assert OnnxEncoder(fp32_export, intra_op_threads=2).streams == 2
    assert OnnxEncoder(fp32_export, intra_op_threads=1).streams == 1
    four = OnnxEncoder(fp32_export, intra_op_threads=4, streams=2)
    assert (
        four._session_options(
            sequential=True, graph_optimization="all", allow_spinning=False, memory_arena=True
        ).intra_op_num_threads
        == 2
    )
    with pytest.raises(ValueError, match="streams"):
        OnnxEncoder(fp32_export, streams=0)


@pytest.mark.slow
def test_a_failed_run_in_a_stream_fails_the_call(
    fp32_export: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run that fails on a stream's thread is the caller's exception, not a missing row."""
    encoder = OnnxEncoder(fp32_export, intra_op_threads=2, streams=2, max_batch_tokens=64)
    real = encoder._run
    calls: list[int] = []

    def flaky(ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("run failed")
        return real(ids, mask)

    monkeypatch.setattr(encoder, "_run", flaky)
    with pytest.raises(RuntimeError, match="run failed"):
        encoder.encode([f"text number {i} " * (i % 7 + 1) for i in range(40)])


@pytest.mark.slow
def test_fp16_export_is_refused_on_cpu(fp32_export: Path, tmp_path: Path) -> None:  # noqa: F811
    fake = tmp_path / "fp16"
    shutil.copytree(fp32_export, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["variant"] = "fp16"
    (fake / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProviderUnavailableError, match="CUDA only"):
        OnnxEncoder(fake, provider="cpu")


def _session_graph_ops(model: Path, tmp_path: Path, disabled: list[str]) -> dict[str, int]:
    """Op counts of the graph an onnxruntime CPU session really runs (its optimized model)."""
    import onnxruntime as ort

    from reward_server.encoders.onnx_export import _op_counts

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "session.onnx")
    ort.InferenceSession(
        str(model / "model.onnx"),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=disabled,
    )
    return _op_counts(tmp_path / "session.onnx")


@pytest.mark.slow
def test_cpu_session_keeps_residuals_apart_from_layer_norms(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """onnxruntime ignores optimizer names it does not know, so check on its optimized graph
    that ``CPU_DISABLED_OPTIMIZERS`` still stops the session from fusing each residual ``Add``
    into its ``LayerNormalization`` (the slow ``SkipLayerNormalization`` CPU kernel); without
    it the session does fuse them."""
    from reward_server.encoders.onnx_runtime import CPU_DISABLED_OPTIMIZERS

    ours = _session_graph_ops(fp32_export, tmp_path, list(CPU_DISABLED_OPTIMIZERS))
    assert ours["LayerNormalization"] == 12 and "SkipLayerNormalization" not in ours
    fused = _session_graph_ops(fp32_export, tmp_path, [])
    assert fused["SkipLayerNormalization"] == 12


@pytest.mark.slow
def test_the_encoders_own_cpu_session_runs_the_unfused_residuals(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """What :class:`OnnxEncoder` itself opens on CPU: its session's optimized graph (written
    out by onnxruntime) has no ``SkipLayerNormalization``, so the encoder passes the disabled
    fusion, and its embeddings are those of the plain session."""
    from reward_server.encoders.onnx_export import _op_counts

    dumped = tmp_path / "encoder-session.onnx"

    class Dumping(OnnxEncoder):
        def _session_options(self, **settings: Any) -> Any:
            options = super()._session_options(**settings)
            options.optimized_model_filepath = str(dumped)
            return options

    texts = ["a first text", "and a second, longer one about apples and pears"]
    encoder = Dumping(fp32_export)
    ops = _op_counts(dumped)
    assert "LayerNormalization" in ops and "SkipLayerNormalization" not in ops
    np.testing.assert_array_equal(encoder.encode(texts), OnnxEncoder(fp32_export).encode(texts))


@pytest.mark.slow
def test_an_export_with_fused_residuals_is_served_with_a_warning(
    fp32_export: Path,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A folder exported by an older sde2 (its manifest lists ``SkipLayerNormalization``) still
    loads, and the log says to export it again for the faster graph."""
    old = tmp_path / "old"
    shutil.copytree(fp32_export, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["graph_ops"]["SkipLayerNormalization"] = 12
    (old / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="reward_server.encoders.onnx_runtime"):
        OnnxEncoder(old)
    assert any("export it again" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="reward_server.encoders.onnx_runtime"):
        OnnxEncoder(fp32_export)
    assert not caplog.records


# ------------------------------------------------------------------ batching (fast, pure)


@pytest.mark.parametrize("budget", [1, 50, 256, 1000, 4096])
def test_plan_batches_covers_everything_within_budget(budget: int) -> None:
    rng = np.random.default_rng(budget)
    lengths = [int(x) for x in rng.integers(2, 257, size=300)]
    batches = plan_batches(lengths, budget)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(300))
    previous_longest = MAX_SEQ_LENGTH + 1
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest  # first row is the longest: padded width known
        assert longest <= previous_longest  # sorted: similar lengths share a batch
        previous_longest = longest
        assert len(b) == 1 or len(b) * longest <= budget
        assert min(lengths[i] for i in b) >= 0.8 * longest


def test_plan_batches_limits_padding_waste() -> None:
    lengths = [256] + [10] * 200
    batches = plan_batches(lengths, 4096)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded == sum(lengths)  # the long text is alone; short ones are not padded to 256
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(2, 257, size=500)]
    batches = plan_batches(lengths, 4096)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded <= 1.25 * sum(lengths)


# ------------------------------------------------------------------ thread detection


def _cgroup(tmp_path: Path, content: str | None, v1: tuple[int, int] | None = None) -> Path:
    root = tmp_path / "cg"
    root.mkdir()
    if content is not None:
        (root / "cpu.max").write_text(content)
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(str(v1[0]))
        (root / "cpu" / "cpu.cfs_period_us").write_text(str(v1[1]))
    return root


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "v1", "expected"),
    [
        (8, None, None, 8),  # no cgroup limit: the affinity mask decides
        (8, "max 100000", None, 8),  # v2 without quota
        (8, "200000 100000", None, 2),  # v2 quota of 2 CPUs
        (8, "150000 100000", None, 2),  # 1.5 CPUs -> 2 threads
        (8, "50000 100000", None, 1),  # half a CPU -> at least 1
        (2, "400000 100000", None, 2),  # quota above the mask: the mask decides
        (8, None, (300000, 100000), 3),  # cgroup v1 quota
        (8, None, (-1, 100000), 8),  # v1 unlimited
    ],
)
def test_available_cpus(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    affinity: int,
    cpu_max: str | None,
    v1: tuple[int, int] | None,
    expected: int,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(affinity)))
    assert available_cpus(_cgroup(tmp_path, cpu_max, v1)) == expected


def test_available_cpus_on_this_machine() -> None:
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


# ------------------------------------------------------------------ provider checks


def test_cuda_missing_from_the_build_is_a_clear_error() -> None:
    with pytest.raises(ProviderUnavailableError, match=r"CUDAExecutionProvider.*onnxruntime-gpu"):
        check_provider_available("cuda", ["AzureExecutionProvider", "CPUExecutionProvider"])
    assert check_provider_available("cpu", ["CPUExecutionProvider"]) == "CPUExecutionProvider"
    with pytest.raises(ValueError):
        check_provider_available("tpu", ["CPUExecutionProvider"])  # type: ignore[arg-type]


def test_cuda_libraries_of_nvidia_wheels_are_loaded_before_a_cuda_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """onnxruntime-gpu with NVIDIA's pip wheels (the GPU image's ``ORT_GPU_EXTRAS``): its CUDA
    provider finds their libraries only once loaded (``import torch`` does, the server does
    not), so :func:`load_cuda_libraries` has onnxruntime load them; without the wheels (a CUDA
    base's system libraries) it does nothing. The CUDA session itself needs the lent GPU."""
    from types import SimpleNamespace

    from reward_server.encoders.onnx_runtime import load_cuda_libraries

    calls: list[str] = []

    def preload_dlls() -> None:  # as onnxruntime's, which prints what it cannot load
        calls.append("preload")
        print("Failed to load libcudnn.so.9: no such file")

    ort = SimpleNamespace(preload_dlls=preload_dlls)
    load_cuda_libraries(ort)
    assert calls == []  # no nvidia-* wheels here: nothing to load
    (tmp_path / "nvidia" / "cu13").mkdir(parents=True)  # what the nvidia-* wheels install
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="reward_server.encoders.onnx_runtime"):
        load_cuda_libraries(ort)
    assert calls == ["preload"]
    assert "Failed to load libcudnn.so.9" in caplog.text
    load_cuda_libraries(SimpleNamespace())  # an onnxruntime older than preload_dlls: no error


def test_silent_cpu_fallback_is_detected() -> None:
    """onnxruntime-gpu without working CUDA builds a CPU session without raising: we must."""
    with pytest.raises(ProviderUnavailableError, match="running"):
        check_session_provider("cuda", ["CPUExecutionProvider"])
    check_session_provider("cuda", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    check_session_provider("cpu", ["CPUExecutionProvider"])


@pytest.mark.slow
def test_asking_for_cuda_here_raises_instead_of_running_on_cpu(
    fp32_export: Path,  # noqa: F811
) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ProviderUnavailableError, match="CUDAExecutionProvider"):
        OnnxEncoder(fp32_export, provider="cuda")


# ------------------------------------------------------------------ GPU (lent GPU machine only)


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_on_cuda_matches_fp32(
    fp32_export: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    fidelity_texts: list[str],  # noqa: F811
) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu and an NVIDIA GPU")
    from reward_server.encoders.onnx_export import export_model

    fp16_dir = export_model(
        None, tmp_path_factory.mktemp("fp16") / "fp16", "fp16", n_texts=60, n_completions=100
    )
    # Where CUDA runs it, the export measures the fp16 graph and gates it as it does int8.
    report = verify_manifest(fp16_dir)["fidelity"]
    assert report["fp16_vs_fp32"]["min_cosine"] >= 0.999, report
    assert report["fp16_vs_sentence_transformers"]["min_cosine"] >= 0.999, report
    assert report["fp16_uniq_gate"]["passed"], report
    assert report["fp16_uniq_gate"]["n_completions"] == 100
    gpu = OnnxEncoder(fp16_dir, provider="cuda")
    assert gpu.name.endswith("fp16 cuda")
    gpu.warmup()
    out, stats = gpu.encode_with_stats(fidelity_texts)
    ref = OnnxEncoder(fp32_export).encode(fidelity_texts)
    cos = fidelity.row_cosines(ref, out)
    assert cos.min() >= 0.999, cos.min()
    assert stats.batches >= 1
    # fp32 graph on CUDA too: same numbers as on CPU.
    gpu32 = OnnxEncoder(fp32_export, provider="cuda")
    assert fidelity.row_cosines(ref, gpu32.encode(fidelity_texts)).min() >= MIN_COSINE


# ------------------------------------------------------------------ the torch reference backend


@pytest.mark.slow
def test_reference_backend(reference_encoder: Any) -> None:  # noqa: F811
    assert isinstance(reference_encoder, Encoder)
    assert reference_encoder.name == "all-MiniLM-L6-v2 torch"
    assert reference_encoder.max_seq_length == MAX_SEQ_LENGTH
    assert reference_encoder.encode([]).shape == (0, EMBEDDING_DIM)
    out = reference_encoder.encode(["So the answer is 18.", ""])
    assert out.dtype == np.float32 and out.shape == (2, EMBEDDING_DIM)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_serving_on_a_provider_this_build_lacks_stops_in_one_line(
    fp32_export: Path,  # noqa: F811
) -> None:
    """``--provider cuda`` on a CPU-only onnxruntime logged a traceback, then "received
    SIGTERM: draining" though no signal came: the cause, once, then exit status 1."""
    import subprocess
    import sys

    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA: the provider is available here")
    cmd = [sys.executable, "-m", "reward_server.cli", "serve", "--provider", "cuda",
           "--port", "0", "--model", str(fp32_export)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "SIGTERM" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("CUDAExecutionProvider is not available in this onnxruntime") >= 1
    assert "install onnxruntime-gpu" in done.stderr
