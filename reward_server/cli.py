"""``sde2-reward``: the command line of the reward server (score, explain, export, serve).

Each subcommand lives in the module that does the work; this file only wires them up. Only the
module of the subcommand being run is imported: ``sde2-reward --help`` works on a client-only
install (``pip install sde2``, no server packages), ``sde2-reward score`` never pays for the web
stack and ``serve`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Collection, Sequence
from types import FrameType

#: subcommand -> (module, one-line help). Each module provides ``add_arguments(parser)`` and
#: ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "score": ("reward_server.offline", "score a JSONL file of completions offline"),
    "explain": ("reward_server.explain_report", "why each completion got its reward (offline)"),
    "export": ("reward_server.encoders.onnx_export", "export the sentence encoder to ONNX"),
    "serve": ("reward_server.service.serve", "run the HTTP and gRPC reward server"),
}

#: Top-level packages of the optional extras -> the extra that installs them, named in the error
#: a missing one gives instead of a traceback.
EXTRA_OF_PACKAGE: dict[str, str] = {
    **dict.fromkeys(
        ("onnxruntime", "tokenizers", "fastapi", "starlette", "uvicorn", "orjson", "grpc"),
        "server",
    ),
    **dict.fromkeys(("google", "prometheus_client", "psutil"), "server"),
    **dict.fromkeys(
        ("torch", "transformers", "sentence_transformers", "onnx", "onnx_ir", "safetensors"),
        "export",
    ),
}

#: What ``serve`` exits with when stopped by SIGTERM (its drained stop); the early handler
#: below matches it, so that a stop is a stop whenever it comes.
STOPPED_EXIT_CODE = 0
#: What a file command exits with when Ctrl-C stops it: the shell's own code for SIGINT.
INTERRUPTED_EXIT_CODE = 130


def stop_during_startup(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGINT before ``serve`` installed its own (draining) handlers: exit now.

    In a container the server is PID 1, and the kernel ignores a signal that PID 1 has no
    handler for: without this one, a stop in the first fraction of a second (while the modules
    import) is dropped and the runtime waits out its whole timeout, then kills (137). A Ctrl-C
    would otherwise be a KeyboardInterrupt traceback and exit 1 (asyncio's own handler, where
    it is installed first). Nothing is being served yet, so there is nothing to drain. Once
    another thread runs (the encoder loading, possibly inside native code), a normal
    interpreter exit could abort in C++ destructors, so the process then leaves at once with
    ``os._exit``. ``--workers`` processes install it too, first thing.
    """
    os.write(2, f"sde2-reward: stopped by {signal.Signals(signum).name} during startup\n".encode())
    if threading.active_count() > 1:
        os._exit(STOPPED_EXIT_CODE)
    raise SystemExit(STOPPED_EXIT_CODE)


def missing_extra_message(exc: ModuleNotFoundError, command: str | None = None) -> str | None:
    """One line naming the extra that installs the module ``exc`` is about, or None when it is
    not a package of an optional extra (a real bug, whose traceback should show). ``export``
    needs its own extra whatever is missing (it holds the server's encoder packages too)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_PACKAGE.get(top)
    if extra is None:
        return None
    if command == "export":
        extra = "export"
    return f"{top} is not installed: this needs the {extra} extra (pip install 'sde2[{extra}]')"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand.

    Only the subcommands in ``commands`` (default: all) get their options, which imports their
    modules; the others are listed with their help line, so ``--help`` needs no extra installed.
    """
    parser = argparse.ArgumentParser(prog="sde2-reward", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def requested_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (the first argument that is not an option), if any."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sde2-reward``."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = requested_command(args_in)
    # First, before any import: only the server runs as a container's PID 1 (the other commands
    # keep the default, so that a terminated `score` does not exit 0).
    if command == "serve" and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop_during_startup)
    try:
        args = build_parser([command] if command else []).parse_args(args_in)
        return int(args._run(args))
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc, command)
        if message is None:
            raise
        print(f"sde2-reward {command}: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a file command: a line, not the worker's traceback
        if command == "serve":
            raise
        # An output file is replaced whole at the end (jsonl_files.write_output), never left
        # part-written.
        print(
            f"sde2-reward {command}: stopped (Ctrl-C); an output file is left as it was",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
