"""Generate the gRPC message code from ``protos/sde2/v1/reward.proto`` (never committed).

Generated code is a build product: committing it lets it drift from the ``.proto`` and makes
reviews noisy. Instead :func:`ensure_generated` runs ``grpc_tools.protoc`` into
``reward_server/service/_generated/`` the first time the gRPC server is imported, and again
whenever the ``.proto`` is newer than the output; ``python -m reward_server.service.protogen``
does it explicitly (e.g. at install or image build time, where the package folder is writable).

Only the message module (``reward_pb2``) is generated. The service plumbing is written by hand in
:mod:`reward_server.service.grpc_server` with grpc's generic handlers, because protoc's
``*_pb2_grpc.py`` imports its sibling as a top-level package (``from sde2.v1 import ...``),
which does not resolve inside ``reward_server``.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_DIR = PACKAGE_DIR / "_generated"
#: Where the proto lives in a source checkout (editable installs, tests, CI).
PROTO_ROOT = PACKAGE_DIR.parents[1] / "protos"
PROTO_FILE = Path("sde2") / "v1" / "reward.proto"
MODULE = "reward_server.service._generated.sde2.v1.reward_pb2"


class ProtoGenerationError(RuntimeError):
    """protoc failed or the proto cannot be found."""


def _output_file() -> Path:
    return GENERATED_DIR / PROTO_FILE.with_name("reward_pb2.py")


def is_stale(proto_root: Path = PROTO_ROOT) -> bool:
    """True when the generated module is missing or older than the proto."""
    out, src = _output_file(), proto_root / PROTO_FILE
    if not out.is_file():
        return True
    return src.is_file() and src.stat().st_mtime > out.stat().st_mtime


def generate(proto_root: Path = PROTO_ROOT) -> Path:
    """Run protoc into a temporary folder and move the result in place atomically."""
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)

    src = proto_root / PROTO_FILE
    if not src.is_file():
        raise ProtoGenerationError(f"{src} not found: run from a source checkout of sde2")
    GENERATED_DIR.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=GENERATED_DIR) as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            str(src),
        ]
        status = protoc.main(args)
        if status != 0:
            raise ProtoGenerationError(f"protoc failed with status {status} on {src}")
        for folder in (Path(tmp), Path(tmp) / "sde2", Path(tmp) / "sde2" / "v1"):
            (folder / "__init__.py").touch()
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():  # file by file with os.replace: concurrent generators are safe
                dest = GENERATED_DIR / path.relative_to(tmp)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
    return _output_file()


def ensure_generated() -> ModuleType:
    """The ``reward_pb2`` module, generating it first when missing or stale."""
    if is_stale():
        generate()
        importlib.invalidate_caches()
    return importlib.import_module(MODULE)


def main() -> int:
    """``python -m reward_server.service.protogen``: (re)generate unconditionally."""
    try:
        out = generate()
    except ProtoGenerationError as exc:
        print(f"protogen: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
