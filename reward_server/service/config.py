"""One settings object for the reward server, filled from CLI flags, then ``SDE2_*`` env vars.

Every knob that bounds the server's work lives here so that the limits are visible in one place
and reported by ``GET /v1/info``. Each flag ``--some-name`` can also be given as the environment
variable ``SDE2_SOME_NAME`` (flags win), which is how containers configure the server; the API
key is only read from ``SDE2_API_KEY`` so that it never shows in ``ps`` output.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from reward_server.encoders.base import Provider
from reward_server.encoders.loading import Backend
from reward_server.encoders.model_store import Variant

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
_AT_LEAST_ONE = (
    "max_body_bytes", "max_items", "max_completion_chars", "max_answer_chars",
    "queue_capacity", "batch_tokens", "workers", "max_header_bytes", "keep_alive_timeout",
    "max_request_tokens", "math_workers", "max_explain_cells",
)  # fmt: skip
_POSITIVE = ("request_timeout", "math_timeout", "header_timeout", "body_timeout")
#: The largest integer any setting takes: what the libraries given them (gRPC, onnxruntime)
#: hold in a C int; a larger one would be a traceback there, or a 500 on every math request. (A body
#: past it would not fit gRPC's 32-bit message limit either.)
_MAX_INT = 2**31 - 1
#: Processes, threads and streams: more than a machine runs (99999999999999999999 workers
#: would be a MemoryError while the list of processes is built).
_MAX_COUNT = 1024
_COUNTS = ("workers", "math_workers", "intra_op_threads", "encoder_streams")
_BEARER_KEY = re.compile(r"[\x21-\x7e]+")
#: The longest duration any setting may take (a year): longer overflows the waits it bounds.
MAX_SECONDS = 365 * 86400


@dataclass(frozen=True)
class Settings:
    """Server settings. Defaults are sized for the standard GRPO step (64 completions with 1-10
    strategies of 30-120 words) on a small CPU machine."""

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    grpc_port: int | None = field(
        default=None, metadata={"help": "gRPC port (off when not given; 0 picks a free port)"}
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": "exported ONNX folder, Hugging Face folder or hub id "
            "(default: the embedded all-MiniLM-L6-v2, exported once into a cache)"
        },
    )
    backend: Backend = field(
        default="onnx",
        metadata={
            "help": "encoder backend: onnxruntime; OpenVINO or CTranslate2 on the same export "
            "(CPU, fp32; each needs its extra); or the sentence-transformers reference "
            "(torch: exact, slower; needs the export extra)"
        },
    )
    variant: Variant = field(
        default="fp32", metadata={"help": "export variant when the model must be exported"}
    )
    provider: Provider = field(default="cpu", metadata={"help": "where the encoder runs"})
    workers: int = field(
        default=1,
        metadata={
            "help": "server processes sharing the ports through SO_REUSEPORT, each with its own "
            "encoder, batcher, queue capacity and cache (CPU threads are split between them; "
            "/metrics, whichever answers it, adds up all of them; /v1/info's limits are each "
            "process's)"
        },
    )
    intra_op_threads: int | None = field(
        default=None, metadata={"help": "encoder threads per process (default: usable CPUs)"}
    )
    encoder_streams: int | None = field(
        default=None,
        metadata={
            "help": "batches the export encoder runs at once, sharing its threads (default: 2 on "
            "CPU with at least 2 threads, else 1)"
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "bearer key for the scoring routes (a flag would show it in ps)",
            "env": True,
            "secret": True,
            "info": "api_key_required",
        },
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={"info": "max_body_bytes", "help": "largest request body (413 above)"},
    )
    max_items: int = field(
        default=1024, metadata={"info": "max_items", "help": "most items per request (422 above)"}
    )
    max_completion_chars: int = field(
        default=200_000,
        metadata={
            "info": "max_completion_chars",
            "help": "longest completion in characters (422 above)",
        },
    )
    max_answer_chars: int = field(
        default=10_000,
        metadata={
            "info": "max_answer_chars",
            "help": "longest gold answer in characters (422 above)",
        },
    )
    max_request_tokens: int = field(
        default=262_144,
        metadata={
            "info": "max_request_tokens",
            "help": "most encoder tokens one request may need (estimated: 4 characters a token, "
            "at most 256 a text, distinct texts only); 422 above",
        },
    )
    max_explain_cells: int = field(
        default=131_072,
        metadata={
            "info": "max_explain_cells",
            "help": "most cosine-matrix entries one explanation may hold (the sum of m² over "
            "its items, m the kept strategies); 422 above",
        },
    )
    max_header_bytes: int = field(
        default=32 * 1024,
        metadata={
            "info": "max_header_bytes",
            "help": "largest request line plus headers in bytes (431 and the connection closed "
            "above)",
        },
    )
    header_timeout: float = field(
        default=10.0,
        metadata={
            "info": "header_timeout_s",
            "help": "seconds a client has to send a request's line and headers, from the "
            "connection (or the next request's first byte); the connection is closed after it",
        },
    )
    body_timeout: float = field(
        default=15.0,
        metadata={
            "info": "body_timeout_s",
            "help": "seconds an admitted request has to send its whole body (408 after it): how "
            "long a stalled upload can hold an admission slot; and a client that stops reading "
            "its answer is dropped after it",
        },
    )
    keep_alive_timeout: int = field(
        default=5,
        metadata={
            "info": "keep_alive_timeout_s",
            "help": "seconds an idle keep-alive connection is kept open",
        },
    )
    request_timeout: float = field(
        default=120.0,
        metadata={
            "info": "request_timeout_s",
            "help": "seconds a request may take in the server before a 503 (deadline)",
        },
    )
    queue_capacity: int = field(
        default=64,
        metadata={
            "info": "queue_capacity",
            "help": "requests admitted at once (parsing, queued or encoding); 429 above",
        },
    )
    batch_tokens: int = field(
        default=32768,
        metadata={
            "info": "batch_tokens",
            "help": "estimated tokens the encoder worker takes from the queue per coalesced call",
        },
    )
    chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "estimated tokens the encoder runs between checks for requests past their "
            "deadline (bounds how long the encoder keeps working for a request after its 503; "
            "default: 4096 per encoder stream, ~0.55 s of fp32 on 2 CPU cores, or the encoder's "
            "padded tokens per run when larger, as on a GPU)"
        },
    )
    encoder_batch_tokens: int | None = field(
        default=None, metadata={"help": "padded tokens per encoder run (default: the backend's)"}
    )
    inline_bytes: int = field(
        default=256 * 1024,
        metadata={
            "help": "request bodies up to this size are validated and parsed (and rewarded, when "
            "every embedding is cached) on the event loop, without two thread hand-offs (~0.1 ms "
            "a request); larger ones in the CPU pool, so a big body never stalls the loop for "
            "long (0: always the pool)"
        },
    )
    # ~1.7 kB per entry: 20k entries bound the cache near 35 MB, inside the memory budget, and
    # still hold a few GRPO steps for retried or re-scored batches.
    cache_size: int = field(
        default=20_000,
        metadata={"info": "cache_size", "help": "embeddings kept in the LRU cache (0 disables it)"},
    )
    math_timeout: float = field(
        default=2.0,
        metadata={
            "info": "math_timeout_s",  # it decides verdicts: a check past it is not equivalent
            "help": "seconds one answer_type=math equivalence check may run (in a child process "
            "that is killed after it); a check that runs out counts as not equivalent for its "
            "request and is never cached (one starved of CPU is retried once)",
        },
    )
    math_workers: int = field(
        default=2,
        metadata={
            "help": "child processes checking answer_type=math answers; each request checks one "
            "answer at a time and requests take free children in turn"
        },
    )
    drain_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds SIGTERM waits for in-flight requests (then they answer 503)"},
    )
    log_level: LogLevel = field(default="info", metadata={"help": "uvicorn / server log level"})

    def __post_init__(self) -> None:
        rules: list[tuple[str, bool, str]] = [
            *((name, getattr(self, name) >= 1, "an integer >= 1") for name in _AT_LEAST_ONE),
            *((name, getattr(self, name) > 0, "a number > 0") for name in _POSITIVE),
            ("drain_timeout", self.drain_timeout >= 0, "a number >= 0"),
            ("cache_size", self.cache_size >= 0, "an integer >= 0"),
            ("inline_bytes", self.inline_bytes >= 0, "an integer >= 0"),
            ("port", 0 <= self.port <= 65535, "a port number (0-65535)"),
            (
                "grpc_port",
                self.grpc_port is None or 0 <= self.grpc_port <= 65535,
                "a port number (0-65535)",
            ),
            # One port for both: alone the second bind fails (exit 3), but --workers binds with
            # SO_REUSEPORT, where both bound and gRPC clients reached the HTTP server.
            (
                "grpc_port",
                not self.grpc_port or self.grpc_port != self.port,
                "another port than --port",
            ),
        ]
        for f in dataclasses.fields(self):
            choices = _kind(f.name).choices
            if choices is not None:
                ok = getattr(self, f.name) in choices
                rules.append((f.name, ok, "one of " + ", ".join(choices)))
        for name in ("intra_op_threads", "encoder_streams", "encoder_batch_tokens", "chunk_tokens"):
            value = getattr(self, name)
            rules.append((name, value is None or value >= 1, "an integer >= 1 (or unset)"))
        for f in dataclasses.fields(self):
            value, most = getattr(self, f.name), _MAX_COUNT if f.name in _COUNTS else _MAX_INT
            if isinstance(value, int) and value > most:
                rules.append((f.name, False, f"at most {most}"))
        rules.extend(self._combination_rules())
        # An Authorization header and gRPC metadata carry printable ASCII: any other key could
        # never be sent, and every client would get a 401 no one can explain.
        key_ok = self.api_key is None or _BEARER_KEY.fullmatch(self.api_key) is not None
        rules.append(("api_key", key_ok, "printable ASCII without spaces"))
        keep_alive_ok = self.keep_alive_timeout <= MAX_SECONDS
        rules.append(("keep_alive_timeout", keep_alive_ok, f"at most {MAX_SECONDS} s"))
        for f in dataclasses.fields(self):  # "inf" and "1e400" parse as floats: no duration
            value = getattr(self, f.name)
            if isinstance(value, float):
                # Durations past a year overflow the waits (thread joins, timers) they bound.
                rules.insert(0, (f.name, value <= MAX_SECONDS, f"at most {MAX_SECONDS} s"))
                rules.insert(0, (f.name, math.isfinite(value), "a finite number"))
        env_only = {f.name for f in dataclasses.fields(self) if f.metadata.get("env")}
        for name, ok, rule in rules:
            if not ok:
                flag = "" if name in env_only else f"--{name.replace('_', '-')} / "
                got = (
                    "a value not shown (a secret)"
                    if name == "api_key"
                    else repr(getattr(self, name))
                )
                raise ValueError(f"{name} ({flag}{env_name(name)}) must be {rule}, got {got}")

    def _combination_rules(self) -> list[tuple[str, bool, str]]:
        """Settings that cannot work together, refused before any export or load (else found
        only after a long export, in the background, as exit 1)."""
        export_only = ("encoder_streams", "encoder_batch_tokens")
        if self.backend == "torch":  # the reference runs the model itself, not an export
            return [
                ("variant", self.variant == "fp32", "fp32 with --backend torch (no export)"),
                *(
                    (name, getattr(self, name) is None, "unset with --backend torch (no export)")
                    for name in export_only
                ),
            ]
        if self.backend != "onnx":  # OpenVINO and CTranslate2 run the fp32 export on the CPU
            return [
                ("provider", self.provider == "cpu", f"cpu with --backend {self.backend}"),
                ("variant", self.variant == "fp32", f"fp32 with --backend {self.backend}"),
            ]
        fp16_ok = self.variant != "fp16" or self.provider == "cuda"
        return [("variant", fp16_ok, "fp32 or int8 on --provider cpu (fp16 is for CUDA only)")]

    def public(self, unenforced: Collection[str] = ()) -> dict[str, Any]:
        """What ``/v1/info`` (and gRPC ``Info``) report of the settings, as ``limits``: each field
        whose metadata names its ``info`` key, except the ``unenforced`` ones (limits of a
        transport that something else stands in for, such as Ray's proxy); a secret shows
        only whether it is set."""
        shown: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if "info" in f.metadata and f.name not in unenforced:
                value = getattr(self, f.name)
                shown[f.metadata["info"]] = value is not None if f.metadata.get("secret") else value
        return shown


#: Each setting's type, resolved from its annotation (which this module's ``from __future__``
#: import keeps as text).
_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(Settings)
_FIELD_SECRET = {f.name: bool(f.metadata.get("secret")) for f in dataclasses.fields(Settings)}
#: ``SDE2_*`` variables that are no server setting but are read elsewhere in the project (the
#: client and its trainer hooks, the image's build and user, the tests): not reported as unknown.
OTHER_VARIABLES = frozenset(
    {"SDE2_CACHE_DIR", "SDE2_URL", "SDE2_MAX_ATTEMPTS", "SDE2_REWARD_DEADLINE", "SDE2_RECIPE",
     "SDE2_ANSWER_TYPE", "SDE2_UID", "SDE2_ARTIFACTS", "SDE2_VERL_PYTHON", "SDE2_GSM8K",
     "SDE2_BASE_IMAGE", "SDE2_DEBIAN_MIRROR", "SDE2_PODMAN_DIR", "SDE2_REBUILD_BASE"}
)  # fmt: skip


def env_name(name: str) -> str:
    """``max_items`` -> ``SDE2_MAX_ITEMS``."""
    return "SDE2_" + name.upper()


@dataclass(frozen=True)
class _Kind:
    """How a flag or env string becomes a field's value, read off the field's type."""

    convert: Callable[[str], Any]
    #: The allowed values of a ``Literal`` field (argparse ``choices``; checked on every source).
    choices: tuple[str, ...] | None = None


def _kind(name: str) -> _Kind:
    """The :class:`_Kind` of the field ``name``: ``int``, ``float``, ``str``, a ``Literal`` of
    strings, or one of these or ``None`` (an optional setting is unset by "" or "none", the model
    included, which then is the embedded default; a secret is taken as given, so that a key
    spelled "none" stays a key)."""
    hint = _FIELD_TYPES[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(base) is Literal:
        return _Kind(str, typing.get_args(base))
    if base not in (int, float, str):
        raise TypeError(f"setting {name}: no parser for {hint!r}")
    secret = _FIELD_SECRET.get(name, False)
    # A text is taken without surrounding blanks (--host " 127.0.0.1" would otherwise be an
    # exit 3, "cannot bind"), as a number is; a secret exactly as given.
    convert: Callable[[str], Any] = str.strip if base is str and not secret else base
    if optional and not secret:
        return _Kind(_or_none(convert))
    return _Kind(convert)


def _or_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert``, except that "" and "none" (any case) give ``None``."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("", "none") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in its errors
    return parse


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting (except the API key), absent from the namespace unless given
    (so that a flag given as "none" unsets its setting, over any ``SDE2_*`` variable)."""
    for f in dataclasses.fields(Settings):
        if f.metadata.get("env"):
            continue
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "type": _kind(f.name).convert,
            "choices": _kind(f.name).choices,
            "help": f"{f.metadata['help']} (env {env_name(f.name)}{_default_help(f)})",
        }
        parser.add_argument(flag, **kwargs)


def _default_help(f: dataclasses.Field[Any]) -> str:
    """``; default X`` for ``--help``, unless the help names its default itself (an unset
    one: "default: usable CPUs" read beside "default None")."""
    return "" if "default" in f.metadata["help"] else f"; default {f.default}"


def env_only_help() -> list[str]:
    """``NAME: help`` of each setting read from its ``SDE2_*`` variable alone (no flag), for
    ``--help`` to list: a setting with no flag would be nowhere in it.

    >>> env_only_help()
    ['SDE2_API_KEY: bearer key for the scoring routes (a flag would show it in ps)']
    """
    fields = dataclasses.fields(Settings)
    return [f"{env_name(f.name)}: {f.metadata['help']}" for f in fields if f.metadata.get("env")]


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A line for each ``SDE2_*`` variable that is no setting (nor one of
    :data:`OTHER_VARIABLES`, nor a test's ``SDE2_TEST_*``), naming the setting it resembles:
    such a variable is ignored, and ``SDE2_APIKEY`` left the scoring routes open.

    >>> unknown_variables({"SDE2_APIKEY": "k", "SDE2_URL": "http://h", "SDE2_PORT": "80"})
    ['SDE2_APIKEY is no setting, ignored (did you mean SDE2_API_KEY?)']
    """
    environ = os.environ if environ is None else environ
    settings = [env_name(f.name) for f in dataclasses.fields(Settings)]
    lines = []
    for name in sorted(environ):
        if not name.startswith("SDE2_") or name.startswith("SDE2_TEST_"):
            continue
        if name in settings or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name, settings, n=1, cutoff=0.75)
        lines.append(
            f"{name} is no setting, ignored" + (f" (did you mean {close[0]}?)" if close else "")
        )
    return lines


def load_settings(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Flags first (one given as "none" included), then ``SDE2_*`` environment variables, then
    the defaults. An empty variable is as if unset (an unset shell or compose variable expands
    to ""): ``SDE2_HOST=`` bound every interface, ``SDE2_MODEL=`` loaded the current folder."""
    environ = os.environ if environ is None else environ
    flags = vars(args) if args is not None else {}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if f.name in flags and not f.metadata.get("env"):
            values[f.name] = flags[f.name]
        elif env_name(f.name) in environ:
            raw = environ[env_name(f.name)]
            # SDE2_API_KEY= means no key, SDE2_HOST= the default address; a key of blanks is
            # refused below, never taken as no key (a Secret holding a newline opened the routes).
            if not (raw if f.metadata.get("secret") else raw.strip()):
                continue
            try:
                values[f.name] = _kind(f.name).convert(raw)
            except ValueError as exc:
                raise ValueError(f"{env_name(f.name)}={raw!r}: {exc}") from exc
    return Settings(**values)
