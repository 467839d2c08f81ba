"""Where exported encoders live, and how a model name becomes a ready ONNX folder.

The server must be able to start from nothing ("serve the default model") without ever importing
torch: torch costs ~1 GB of memory and seconds of import time, and it would stay resident in the
serving process. So a missing export is produced by running ``python -m
reward_server.encoders.onnx_export`` in a *subprocess*, whose memory is returned when it exits.

Several server workers (or a server and a test run) may start at once on the same cache; a file
lock per cache entry makes exactly one of them export while the others wait and then reuse the
result. Exports are renamed into place only when complete (see :func:`onnx_export.export_model`),
so a folder with a ``manifest.json`` is always a finished one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

from reward_server.encoders.base import EncoderUnavailableError

log = logging.getLogger(__name__)

#: Name of the cache entry of the default model (the offline all-MiniLM-L6-v2 package).
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
#: What an export folder holds: the graph, and the manifest that says what it is.
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
#: The numeric forms an export can take (fp16 runs on CUDA only).
Variant = Literal["fp32", "fp16", "int8"]
VARIANTS: tuple[Variant, ...] = get_args(Variant)
#: How the export builds its graph, recorded in each manifest. 2: no SkipLayerNormalization
#: on CPU (onnxruntime's CPU kernel of it is 3x slower than Add + LayerNormalization;
#: :func:`onnx_export.fusion_options`).
GRAPH_RECIPE = 2
#: The recipe in which each variant's graph last changed: a cached export made by an older one
#: is made again (fp16, the CUDA graph, did not change in recipe 2).
_GRAPH_CHANGED: dict[str, int] = {"fp32": 2, "int8": 2, "fp16": 1}
#: An export takes ~30-60 s on 2 cores; a waiting process gives up after this long.
DEFAULT_LOCK_TIMEOUT_S = 1800.0
#: The files of a model folder its export depends on: weights, settings, vocabularies.
_FINGERPRINTED_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


class ModelExportError(RuntimeError):
    """The export subprocess failed or refused; carries the tail of its output."""


#: The errors of a cache folder that cannot be written (read-only, permission, not a folder).
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST})


class ModelLoadError(RuntimeError):
    """An export folder that cannot be served as it is: a damaged, incomplete or unreadable
    file (the message names it and what to do), never a silent other model."""


#: The model store's errors whose message says what is wrong and what to do (a missing folder's
#: FileNotFoundError names it and what is missing): logged as one line, without a traceback.
EXPLAINED_LOAD_ERRORS = (
    ModelExportError,
    ModelLoadError,
    FileNotFoundError,
    EncoderUnavailableError,
)

#: What a damaged export's error advises.
EXPORT_AGAIN = "export the model again (sde2-reward export, or delete the folder from the cache)"


#: Where exported models are kept unless ``SDE2_CACHE_DIR`` says otherwise.
DEFAULT_CACHE_DIR = "~/.cache/sde2"
#: What ``SDE2_CACHE_DIR`` sets (``sde2-reward serve --help`` shows it).
CACHE_DIR_HELP = f"where exported models are kept (default {DEFAULT_CACHE_DIR})"


def cache_dir() -> Path:
    """``$SDE2_CACHE_DIR`` or :data:`DEFAULT_CACHE_DIR`."""
    return Path(os.environ.get("SDE2_CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()


def is_export(folder: Path) -> bool:
    """Whether ``folder`` is a finished ONNX export of ours."""
    return (folder / MANIFEST_FILE).is_file() and (folder / MODEL_FILE).is_file()


def read_manifest(model_dir: Path) -> dict[str, Any]:
    """The export's manifest (empty for a folder without one: a bare ``model.onnx``);
    :class:`ModelLoadError` naming it when it is not a JSON object."""
    path = model_dir / MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc}): {EXPORT_AGAIN}") from None
    if not isinstance(manifest, dict):
        raise ModelLoadError(f"{path} is not a JSON object: {EXPORT_AGAIN}")
    return manifest


def verify_manifest(model_dir: Path) -> dict[str, Any]:
    """:func:`read_manifest`, with every file it lists checked against its sha256: a damaged
    or replaced file (its size unchanged, perhaps) would otherwise serve wrong embeddings
    without an error. Hashing the 90 MB graph takes about 0.07 s on 2 cores."""
    manifest = read_manifest(model_dir)
    files = manifest.get("files", {})
    for name, digest in files.items() if isinstance(files, dict) else ():
        path = model_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing (listed in {MANIFEST_FILE}): {EXPORT_AGAIN}")
        actual = sha256_file(path)
        if actual != digest:
            raise ModelLoadError(
                f"{path}: sha256 {actual} does not match {MANIFEST_FILE} (the file is damaged "
                f"or was replaced): {EXPORT_AGAIN}"
            )
    return manifest


def graph_recipe(folder: Path) -> int:
    """The :data:`GRAPH_RECIPE` an export was made by (1 for exports that predate the field)."""
    try:
        return int(read_manifest(folder).get("graph_recipe", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def is_current_export(folder: Path, variant: str) -> bool:
    """Whether ``folder`` is a finished export of ``variant`` whose graph is this version's
    (made by the recipe that last changed it, or a later one)."""
    return is_export(folder) and graph_recipe(folder) >= _GRAPH_CHANGED.get(variant, GRAPH_RECIPE)


@contextmanager
def file_lock(path: Path, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created if needed), polling until ``timeout_s``.

    flock locks belong to the open file and vanish when the holder dies, so a crashed exporter
    never leaves a stale lock behind (unlike lock files tested for existence).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with path.open("a") as fh:
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not lock {path} within {timeout_s:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name).strip("-.") or "model"


def folder_fingerprint(folder: Path) -> str:
    """Short sha256 over the weights, settings and vocabulary files of a model folder (every
    ``.json``: sentence-transformers keeps ``max_seq_length`` in ``sentence_bert_config.json``
    and its modules' settings in their folders).

    Keyed by content, not path: re-downloading or copying the same model reuses the export, and
    changing its weights or any setting in place gets a new one.
    """
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        hidden = any(part.startswith(".") for part in relative.parts)  # .git, .cache
        if path.is_file() and not hidden and path.suffix in _FINGERPRINTED_SUFFIXES:
            h.update(str(relative).encode())
            _hash_into(h, path)
    return h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (model files are ~90 MB)."""
    h = hashlib.sha256()
    _hash_into(h, path)
    return h.hexdigest()


#: Bytes :func:`_hash_into` reads at a time where it cannot map the file.
_HASH_CHUNK = 32 << 20


def _hash_into(h: hashlib._Hash, path: Path) -> None:
    """Feed ``path``'s bytes to ``h``: in one call over a memory map of the file, else (an
    empty file, a file system that maps nothing) :data:`_HASH_CHUNK` bytes at a time.

    ``hashlib`` hashes a large buffer outside the GIL, and each time a thread takes the GIL
    back it waits out a switch interval while another thread holds it: at the server's start,
    the web stack's imports do. Read a MiB at a time, checking the 90 MB graph took 0.42 s
    there against 0.08 s alone; in 32 MiB pieces, about 0.2 s more than mapped
    (benchmarks/README, twenty-sixth pass). As for any memory-mapped model file, a file
    truncated while it is hashed ends the process (SIGBUS); the model store's own writers
    move finished files into place.
    """
    with path.open("rb", buffering=0) as fh:
        try:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # (ValueError: an empty file cannot be mapped)
            buffer = bytearray(_HASH_CHUNK)
            view = memoryview(buffer)
            while n := fh.readinto(buffer):
                h.update(view[:n])
            return
        with mapped:
            h.update(mapped)


def export_in_subprocess(
    source: str | None,
    out_dir: Path,
    variant: str,
    *,
    export_args: Sequence[str] = (),
    timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
) -> Path:
    """Run the exporter in a child Python so torch never loads into this process.

    ``export_args`` are extra ``sde2-reward export`` options (e.g. ``--fidelity-texts 100``).
    """
    cmd = [sys.executable, "-m", "reward_server.encoders.onnx_export", "--out", str(out_dir)]
    cmd += ["--variant", variant, "--overwrite", "--parent-pid", str(os.getpid())]
    if source is not None:
        cmd += ["--source", source]
    cmd += list(export_args)
    proc = _run_child(cmd, timeout_s)
    if proc.returncode != 0 or not is_export(out_dir):
        message = (
            f"exporting {source or DEFAULT_MODEL_NAME} ({variant}) failed with exit code "
            f"{proc.returncode}:\n{_tail(proc)}"
        )
        if proc.returncode == 2 and _REFUSED in (proc.stderr or ""):
            _remember_refusal(out_dir, export_args, message)
        raise ModelExportError(message)
    with contextlib.suppress(OSError):  # exported after all (with other options, or code)
        _refusal_file(out_dir).unlink(missing_ok=True)
    return out_dir


#: What the exporter prints when it refuses a model or variant (exit status 2): a verdict on
#: the model, the variant and the export's options, the same at every try.
_REFUSED = "export refused:"
#: The exporter's sources, whose digest keys a remembered refusal: changed code tries again.
_EXPORTER_SOURCES = ("onnx_export.py", "fidelity.py")


def _refusal_file(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".refused.json")


def _refusal_key(export_args: Sequence[str]) -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(b"".join((here / name).read_bytes() for name in _EXPORTER_SOURCES))
    return {"export_args": list(export_args), "exporter": digest.hexdigest()[:16]}


def _remember_refusal(out_dir: Path, export_args: Sequence[str], message: str) -> None:
    """Keep the exporter's refusal beside the cache entry, so that the next start says it at
    once: ``serve --variant int8`` spent minutes exporting and gating the shipped model on
    every start, to be refused each time. Best effort (a read-only cache just tries again)."""
    record = {**_refusal_key(export_args), "refused": message, "at": time.time()}
    with contextlib.suppress(OSError):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _refusal_file(out_dir).write_text(json.dumps(record), encoding="utf-8")


def remembered_refusal(out_dir: Path, export_args: Sequence[str] = ()) -> str | None:
    """The refusal :func:`export_in_subprocess` kept for ``out_dir`` with these options and
    this exporter, as an error message that says how to try again; None when there is none."""
    path = _refusal_file(out_dir)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    key = _refusal_key(export_args)
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in key.items()):
        return None
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(record.get("at", 0))))
    again = f"refused at {when}, remembered in {path}: delete it to try again"
    return f"{record.get('refused')}\n({again})"


#: The export children running now (:func:`stop_exports` ends them).
_children: set[subprocess.Popen[str]] = set()
_children_lock = threading.Lock()


def _run_child(cmd: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run one of the package's modules in a child Python, its output captured."""
    env = dict(os.environ)
    # The package may be used from a source checkout rather than installed: make it importable.
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    with subprocess.Popen(
        list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        with _children_lock:
            _children.add(child)
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise
        finally:
            with _children_lock:
                _children.discard(child)
    return subprocess.CompletedProcess(list(cmd), child.returncode, out, err)


def stop_exports() -> None:
    """End the exports running now (their callers get a :class:`ModelExportError`): a server
    asked to stop while it exported its model waited for the export, then the load and the
    warm-up, up to two minutes, past a stop timeout's kill."""
    with _children_lock:
        running = list(_children)
    for child in running:
        with contextlib.suppress(OSError):
            child.terminate()


def _tail(proc: subprocess.CompletedProcess[str]) -> str:
    r"""Why a child failed: the exporter's own ``export failed:`` / ``export refused:`` lines
    when it wrote some (they came last, under its progress bars and torch's warnings), else the
    last lines it wrote; and the signal that ended it, if one did.

    >>> done = subprocess.CompletedProcess([], 1, "", "Loading 100%\nexport failed: no disk")
    >>> _tail(done)
    'export failed: no disk'
    >>> _tail(subprocess.CompletedProcess([], -9, "", "TracerWarning: ..."))
    'killed by SIGKILL; its last lines:\nTracerWarning: ...'
    """
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    own = [line for line in lines if line.startswith(("export failed:", _REFUSED))]
    text = "\n".join(own or lines[-15:])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        text = f"killed by {name}; its last lines:\n{text}" if text else f"killed by {name}"
    return text


def _ensure(
    source: str | None,
    entry: str,
    variant: str,
    root: Path | None,
    export_args: Sequence[str] = (),
) -> Path:
    root = root or cache_dir()
    target = root / "models" / f"{entry}-{variant}"
    if is_current_export(target, variant):
        return target
    stale = is_export(target)  # made by an older graph recipe
    refused = None if stale else remembered_refusal(target, export_args)
    if refused is not None:
        raise ModelExportError(refused)
    try:
        with file_lock(root / "locks" / f"{entry}-{variant}.lock"):
            if is_current_export(target, variant):  # another process made it while we waited
                return target
            if not stale and (refused := remembered_refusal(target, export_args)) is not None:
                raise ModelExportError(refused)  # refused while we waited: not again, at length
            _clear_for_export(target)
            if stale:
                log.info("%s was exported by an older graph recipe: exporting it again", target)
            return export_in_subprocess(source, target, variant, export_args=export_args)
    except (ModelExportError, OSError, subprocess.SubprocessError) as exc:
        # A server-only install (no torch) or a read-only cache (no lock file, no export)
        # cannot export: an older graph computes the same embeddings, only slower, so it
        # still serves. With nothing to fall back on, the failure stands.
        if not (stale and is_export(target)):
            if isinstance(exc, OSError) and exc.errno in _NOT_WRITABLE:
                raise ModelExportError(
                    f"cannot write the model cache {root} ({exc}): set SDE2_CACHE_DIR to a "
                    "writable folder"
                ) from None
            raise
        log.warning("serving %s as it is: exporting it again failed (%s)", target, exc)
        return target


def _clear_for_export(target: Path) -> None:
    """Under the entry's lock, before exporting into ``target`` (a folder of the store's own):
    what a killed export left (its ``.NAME.*`` work folders, ~170 MB each, were never removed),
    and a folder that holds no export (its manifest gone: every start failed on it, "holds no
    export: nothing there is replaced")."""
    for leftover in target.parent.glob(f".{target.name}.*"):
        if leftover.is_dir():
            log.info("removing %s, left by an export that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
    if target.is_dir() and not (target / MANIFEST_FILE).is_file():
        log.warning(
            "%s holds no complete export (no %s): exporting it again", target, MANIFEST_FILE
        )
        shutil.rmtree(target)


def ensure_default_model(
    variant: str = "fp32", *, root: Path | None = None, export_args: Sequence[str] = ()
) -> Path:
    """The default model's export in the cache, exporting it once (in a subprocess) if missing.

    ``root`` overrides :func:`cache_dir`; ``export_args`` are passed to the exporter.
    """
    return _ensure(None, DEFAULT_MODEL_NAME, variant, root, export_args)


def local_model_folder(model: str) -> Path | None:
    """The local folder ``model`` names (an export, or a model folder to export), or None for a
    hub id; :class:`FileNotFoundError` saying what is wrong when it names a path that is
    neither. Checks the path only (no export, no download): cheap enough to run first.

    Whether a name that is not on disk is a path is :func:`names_a_path`'s rule.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if is_export(path):
            return path
        if (path / MANIFEST_FILE).is_file():
            raise FileNotFoundError(
                f"{path} holds {MANIFEST_FILE} but no {MODEL_FILE}: an incomplete export; "
                + EXPORT_AGAIN
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is neither an ONNX export (no {MANIFEST_FILE}) nor a model folder "
                "(no config.json)"
            )
        return path
    if path.exists():
        raise FileNotFoundError(f"model {model!r} is a file, not a folder")
    if names_a_path(model):
        raise FileNotFoundError(f"model {model!r}: no such folder")
    return None


def names_a_path(name: str) -> bool:
    """Whether ``name`` can only be a path, never a hub id (``name`` or ``owner/name``): it
    starts with ``.``, ``/`` or ``~``, or holds more than one ``/`` or a ``\\``.

    >>> [names_a_path(n) for n in ("org/name", "name", "./name", "a/b/c", "~/m", r"a\\b")]
    [False, False, True, True, True, True]
    """
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def resolve_model(
    model: str | None,
    variant: str = "fp32",
    *,
    root: Path | None = None,
    export_args: Sequence[str] = (),
) -> Path:
    """Turn what a user named into an ONNX export folder.

    * ``None`` -> the default model (exported once into the cache);
    * a folder with ``manifest.json`` -> used as is (``variant`` is whatever was exported);
    * any other folder (Hugging Face / sentence-transformers layout) -> exported into the cache,
      keyed by folder name and content fingerprint;
    * anything else is taken as a Hugging Face hub id and exported into the cache by name.

    ``root`` overrides :func:`cache_dir`; ``export_args`` are passed to the exporter.
    """
    if model is None:
        return ensure_default_model(variant, root=root, export_args=export_args)
    path = local_model_folder(model)
    if path is not None:
        if is_export(path):
            return path.resolve()
        entry = f"{_safe_name(path.resolve().name)}-{folder_fingerprint(path)}"
        return _ensure(str(path.resolve()), entry, variant, root, export_args)
    path = Path(model)
    try:
        return _ensure(model, _safe_name(model), variant, root, export_args)
    except ModelExportError as exc:  # a hub id, or a local folder's name mistyped
        raise ModelExportError(
            f"{exc}\n(no local folder {str(path.resolve())!r} either: a folder is named by its "
            "path, a hub id as owner/name)"
        ) from None


#: Where the ``ctranslate2`` backend's models live in the cache (one per export's graph).
CTRANSLATE2_DIR = "ctranslate2"
#: How :mod:`ctranslate2_convert` builds the model: part of the cache entry's name, with
#: CTranslate2's major.minor version, so that a changed conversion or a model file of another
#: CTranslate2 release is never loaded from the cache.
CTRANSLATE2_RECIPE = 1


def graph_digest(export_dir: Path) -> str:
    """Short sha256 of the export's ``model.onnx`` (from its manifest when recorded there)."""
    recorded = read_manifest(export_dir).get("files", {}).get(MODEL_FILE)
    if isinstance(recorded, str) and recorded:
        return recorded[:16]
    return sha256_file(export_dir / MODEL_FILE)[:16]


def ensure_ctranslate2_model(
    export_dir: Path, *, root: Path | None = None, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
) -> Path:
    """The CTranslate2 model of an fp32 export, converted once into the cache.

    Keyed by the graph's digest (so an export given by path, perhaps read-only, converts once
    too), :data:`CTRANSLATE2_RECIPE` and CTranslate2's release. The conversion
    (:mod:`ctranslate2_convert`) runs in a child process under the entry's lock and is renamed
    into place when complete, like an export.
    """
    from importlib.metadata import version

    root = root or cache_dir()
    release = ".".join(version("ctranslate2").split(".")[:2])
    entry = f"{graph_digest(export_dir)}-r{CTRANSLATE2_RECIPE}-ct{release}"
    target = root / CTRANSLATE2_DIR / entry
    if _conversion_damage(target) == []:
        return target
    try:
        with file_lock(root / "locks" / f"{CTRANSLATE2_DIR}-{entry}.lock", timeout_s):
            damage = _conversion_damage(target)
            if damage == []:  # another process made it
                return target
            if damage:
                log.warning(
                    "%s: %s damaged or unverifiable: converting the model for ctranslate2 again",
                    target,
                    ", ".join(damage),
                )
            _convert_for_ctranslate2(export_dir, target, timeout_s)
    except TimeoutError:  # the lock's own message says who and how long
        raise
    except subprocess.TimeoutExpired as exc:
        raise ModelExportError(
            f"converting {export_dir} for ctranslate2 took longer than {timeout_s:.0f} s"
        ) from exc
    except OSError as exc:
        raise ModelExportError(
            f"the ctranslate2 model of {export_dir} is converted once into the cache, and "
            f"writing it into {root} failed ({exc}): set SDE2_CACHE_DIR to a writable folder"
        ) from exc
    return target


def _convert_for_ctranslate2(export_dir: Path, target: Path, timeout_s: float) -> None:
    """Convert into ``target.partial`` in a child process, then rename it into place (over
    what a conversion that died half-way, or a cache pruned by hand, left there)."""
    partial = target.with_name(f"{target.name}.partial")
    for leftover in (partial, target):
        if leftover.exists():
            shutil.rmtree(leftover)
    module = "reward_server.encoders.ctranslate2_convert"
    proc = _run_child([sys.executable, "-m", module, str(export_dir), str(partial)], timeout_s)
    if proc.returncode != 0:
        raise ModelExportError(
            f"converting {export_dir} for ctranslate2 failed with exit code "
            f"{proc.returncode}:\n{_tail(proc)}"
        )
    digests = {f.name: sha256_file(f) for f in sorted(partial.iterdir()) if f.is_file()}
    (partial / CONVERSION_DIGESTS).write_text(json.dumps(digests, indent=1), encoding="utf-8")
    partial.rename(target)


#: The sha256 of each file of a CTranslate2 conversion, written once it is complete.
CONVERSION_DIGESTS = "sde2-digests.json"


def _conversion_damage(target: Path) -> list[str] | None:
    """None when ``target`` holds no complete CTranslate2 conversion, else its files that are
    not as written (:data:`CONVERSION_DIGESTS`; empty: intact). A damaged ``model.bin``
    loaded without complaint and embedded wrongly (a few KB zeroed: cosine 0.9998 against
    onnxruntime; 400 KB: 0.985), so such an entry, or one from before the digests, is
    converted again."""
    if not (target / "model.bin").is_file():
        return None
    try:
        digests = dict(json.loads((target / CONVERSION_DIGESTS).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return [CONVERSION_DIGESTS]
    return [name for name, digest in digests.items() if _digest_or_none(target / name) != digest]


def _digest_or_none(path: Path) -> str | None:
    """:func:`sha256_file`, or None for a file that is missing or unreadable."""
    try:
        return sha256_file(path)
    except OSError:
        return None
