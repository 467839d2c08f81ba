"""JSONL files in and out for the command-line tools (``sde2-reward score`` and ``explain``,
``sde2-eval``, ``sde2-train``'s data): lines read as editors number them, parsed as the server
parses a request, errors that name the file, the line and the field; outputs checked before any
work and written atomically.

No I/O outside what each function names, and nothing heavier than pydantic's JSON parser: the
trainer client imports it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pydantic_core

from reward_server.field_names import not_utf8, shown_path, unencodable_in_json
from reward_server.signal_handlers import exit_with_status, handling

#: The exit status after the reader of stdout went away (``| head``): what a shell reports for a
#: Unix tool that SIGPIPE ended.
BROKEN_PIPE_STATUS = 128 + int(signal.SIGPIPE)
_UTF8_BOM = b"\xef\xbb\xbf"


class InputError(ValueError):
    """A malformed input (file, line and field named) or argument (flag named)."""


class OutputError(ValueError):
    """An output path that cannot be written, found before any work is spent on it."""


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages.

    >>> json_type([1]), json_type(None), json_type(True), json_type(2.5), json_type("x")
    ('array', 'null', 'boolean', 'number', 'string')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of a UTF-8 JSONL file, numbered from 1.

    Lines end at ``\\n`` only (a ``\\r`` before it is dropped): U+2028, U+0085 and their kin may
    stand unescaped inside a JSON string, and ``str.splitlines`` would cut the line there and
    shift every later number. A BOM opening a line is dropped (``utf-8-sig``: some editors write
    one, and ``cat a.jsonl b.jsonl`` puts the second file's inside: it read "not JSON" at column
    1 of a line that looked right); bytes that are not UTF-8 are an :class:`InputError` naming
    the line and column.
    """
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.removeprefix(_UTF8_BOM).removesuffix(b"\n").removesuffix(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[: exc.start].decode("utf-8", "replace")) + 1
                raise InputError(
                    f"{path}: line {number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                    f"{column}); save the file as UTF-8"
                ) from None
            if text.strip(" \t\r"):  # JSON's whitespace; anything else is for the parser
                yield number, text


def json_error(path: Path, number: int, message: str, text: str) -> InputError:
    """A JSON syntax error of line ``number`` (``text``), its column as an editor shows it
    (each line is parsed alone, so the parser's "line 1" is the file's line ``number``); a
    string holding a lone surrogate escape is named by its field."""
    found = unencodable_in_json(text)
    if found is not None:
        where, at = found
        return InputError(f"{path}: line {number}: {shown_path(where)}: {not_utf8(at)}")
    message = re.sub(r" at line 1 column (\d+)$", r" at column \1", message)
    if "surrogate" in message or "end of hex escape" in message:
        message += "; a lone UTF-16 surrogate (\\ud800-\\udfff) is not text"
    return InputError(f"{path}: line {number}: not JSON ({message})")


def parse_json_line(path: Path, number: int, text: str) -> Any:
    """One JSONL line parsed by pydantic's JSON parser, the server's: lone surrogates, which
    ``json.loads`` lets through and no UTF-8 writer or tokenizer accepts, are refused."""
    try:
        return pydantic_core.from_json(text)
    except ValueError as exc:
        raise json_error(path, number, str(exc), text) from None


def check_output(path: Path, flag: str = "--out", inputs: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse an output path (given as ``flag``) that cannot be written before the parse and
    the encoder spend minutes on it: a folder, a missing parent folder, no write permission,
    or one of the command's ``inputs`` (``(flag, file)`` pairs: the output would replace it)."""
    if str(path) == "-":
        return
    if path.is_dir():
        raise OutputError(f"{flag} {path}: is a folder; name a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OutputError(f"{flag} {path}: not writable")
        if not path.is_file():
            return  # a device or a pipe: written in place
        for input_flag, source in inputs:
            if source.is_file() and path.samefile(source):
                raise OutputError(
                    f"{flag} {path}: is the {input_flag} file; writing it would replace what "
                    "it reads: name another file"
                )
    parent = path.resolve().parent
    shown = parent if path.is_symlink() else path.parent  # a link names its target's folder
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: no folder {shown}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: the folder {shown} is not writable")


def write_atomically(path: Path, lines: Iterable[str]) -> None:
    """Write ``lines`` to a temporary file next to ``path``, then rename it over ``path``: a
    failed write (disk full, file size limit, a value that cannot be encoded) leaves the
    previous file as it was, and a reader never sees half a file that looks complete. A
    SIGTERM while writing (``timeout``, a batch scheduler) ends the process as it would
    (status 143), without leaving the temporary file."""
    with handling([signal.SIGTERM], exit_with_status):  # the main thread only
        _write_atomically(path, lines)


def _write_atomically(path: Path, lines: Iterable[str]) -> None:
    target = path.resolve() if path.is_symlink() else path
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output(path: Path, lines: Iterable[str]) -> None:
    """``lines`` to stdout (``-``), in place to a device or pipe (``/dev/null``), or atomically
    to a file (:func:`write_atomically`)."""
    if str(path) == "-":
        sys.stdout.writelines(lines)
        sys.stdout.flush()  # a closed pipe fails here, inside the caller's handler
    elif path.exists() and not path.is_file():
        with path.open("w", encoding="utf-8") as f:
            f.writelines(lines)
    else:
        write_atomically(path, lines)


def end_on_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): end quietly, as Unix tools do. stdout is
    pointed at ``/dev/null`` first, so that the interpreter's last flush of the dead pipe
    prints no error either."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return BROKEN_PIPE_STATUS


def emit(command: str, path: Path, lines: Iterable[str]) -> int:
    """Write the output (:func:`write_output`); the exit status, a failure said on one line."""
    try:
        write_output(path, lines)
    except BrokenPipeError:
        return end_on_broken_pipe()
    except (OSError, UnicodeError) as exc:
        name = "stdout" if str(path) == "-" else str(path)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"{command}: cannot write {name}: {reason}", file=sys.stderr)
        return 1
    return 0
