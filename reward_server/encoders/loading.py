"""Build the encoder a command asked for: one place that maps (backend, model) to an Encoder.

``onnx`` (the default) resolves ``model`` through the model store (an export folder, a Hugging
Face folder or hub id, or the embedded default) and runs it on onnxruntime; ``openvino`` runs the
same export on OpenVINO's CPU runtime (the ``openvino`` extra), ``ctranslate2`` on CTranslate2's
(the ``ctranslate2`` extra; its model converted once from the export); ``torch`` is the
sentence-transformers reference. Any may run behind the LRU embedding cache. Imports are lazy so
that choosing an export never imports torch.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal, get_args

from reward_server.encoders.base import Encoder, Provider
from reward_server.encoders.model_store import ModelExportError

if TYPE_CHECKING:
    from reward_server.encoders.batched import BatchedEncoder

Backend = Literal["onnx", "openvino", "ctranslate2", "torch"]
#: The backends :func:`load_encoder` offers (the server's ``--backend`` choices).
BACKENDS: tuple[Backend, ...] = get_args(Backend)


def load_encoder(
    backend: Backend = "onnx",
    model: str | None = None,
    *,
    variant: str = "fp32",
    provider: Provider = "cpu",
    intra_op_threads: int | None = None,
    streams: int | None = None,
    max_batch_tokens: int | None = None,
    cache_size: int = 0,
) -> Encoder:
    """The encoder for ``backend`` and ``model`` (``None``: the embedded default).

    ``variant`` is the ONNX export to make when ``model`` is not an export yet;
    ``max_batch_tokens`` is the export's padded tokens per run; ``intra_op_threads`` the
    backend's CPU threads, shared out between ``streams`` runs at once (export backends;
    default: two on CPU); ``cache_size`` > 0 puts the LRU embedding cache in front.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    encoder: Encoder
    if runs_export(backend):
        from reward_server.encoders.model_store import resolve_model

        encoder = export_engine(backend)(
            resolve_model(model, variant),
            provider=provider,
            intra_op_threads=intra_op_threads,
            streams=streams,
            max_batch_tokens=max_batch_tokens,
        )
    else:
        require_torch_stack(
            "--backend torch (the sentence-transformers reference)",
            "or serve the ONNX export with --backend onnx (--model / SDE2_MODEL names an export)",
        )
        from reward_server.encoders.reference import SentenceTransformerEncoder

        encoder = SentenceTransformerEncoder(
            model, device="cuda" if provider == "cuda" else "cpu", num_threads=intra_op_threads
        )
    if cache_size > 0:
        from reward_server.encoders.cache import CachedEncoder

        encoder = CachedEncoder(encoder, cache_size)
    return encoder


def export_engine(backend: Backend) -> type[BatchedEncoder]:
    """The class that runs the export for ``backend`` (imported only when chosen); a
    :class:`ValueError` for a backend that does not run the export (see :func:`runs_export`)."""
    if backend == "openvino":
        from reward_server.encoders.openvino_runtime import OpenVinoEncoder

        return OpenVinoEncoder
    if backend == "ctranslate2":
        from reward_server.encoders.ctranslate2_runtime import CTranslate2Encoder

        return CTranslate2Encoder
    if backend == "onnx":
        from reward_server.encoders.onnx_runtime import OnnxEncoder

        return OnnxEncoder
    raise ValueError(f"backend {backend!r} does not run the ONNX export")


def runs_export(backend: Backend) -> bool:
    """Whether ``backend`` runs the ONNX export (resolved through the model store), rather
    than loading a sentence-transformers model itself.

    >>> runs_export("openvino"), runs_export("torch")
    (True, False)
    """
    return backend != "torch"


def model_problem(backend: Backend, model: str | None) -> str | None:
    """Why ``model`` cannot serve ``backend``, told before anything loads (loading may come
    minutes later, after a parse or in a server's background), or None. Checks the path only:
    a name that is no local path is a hub id, tried when the encoder loads."""
    from reward_server.encoders.model_store import is_export, local_model_folder

    if model is None:
        return None
    try:
        folder = local_model_folder(model)
    except FileNotFoundError as exc:
        return str(exc)
    if folder is not None and not runs_export(backend) and is_export(folder):
        return f"{folder} is an ONNX export; the {backend} backend needs the model folder"
    return None


#: The backends that run the ONNX export (``--backend`` choices of the encoder benchmarks).
EXPORT_BACKENDS: tuple[Backend, ...] = tuple(b for b in BACKENDS if runs_export(b))


#: What running the encoder in torch (the export, the reference backend) imports: the
#: ``export`` extra, which a server-only install (``sde2[server]``) leaves out.
TORCH_STACK = ("torch", "sentence_transformers")
#: What exporting needs beyond it (torch's exporter writes with ``onnx``, the weights are read
#: with ``safetensors``, the int8 variant's quantizer imports ``onnx_ir``).
EXPORT_STACK = (*TORCH_STACK, "onnx", "onnx_ir", "safetensors")


def require_torch_stack(
    needed_by: str, otherwise: str, packages: tuple[str, ...] = TORCH_STACK
) -> None:
    """:class:`ModelExportError` in one line, naming the ``export`` extra and ``otherwise`` (what
    to do without it), when one of ``packages`` (default :data:`TORCH_STACK`) is not installed.

    Checked before the first import: the import's own ``ModuleNotFoundError`` would surface as a
    traceback from deep inside the export (twice, when the server runs it in a child process),
    without saying which extra to install or that an existing export needs none of it.
    """
    missing = [name for name in packages if not _installed(name)]
    if missing:
        raise ModelExportError(
            f"{needed_by} needs {' and '.join(missing)} (not installed): "
            f"pip install 'sde2[export]', {otherwise}"
        )


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (torch takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        return False
