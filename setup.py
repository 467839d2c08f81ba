"""The build hook: gRPC message code is generated from ``protos/`` while the package is built.

Everything else about the package is declared in ``pyproject.toml``. ``build_py`` runs for a
wheel, for a wheel built from the sdist and for an editable install (``pip install -e .``), so
all of them carry ``reward_server/service/_generated/`` (messages and typed stubs) without it
being committed, and the installed server never runs protoc or writes into its own folder.
Editable installs get the code in place, in the source tree (setuptools' rule for generated files
of editable builds); the other builds get it in ``build_lib``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _protogen() -> ModuleType:
    """``protos/generate.py`` (not a package module: it is a build tool, shipped in the sdist)."""
    spec = importlib.util.spec_from_file_location("sde2_protogen", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """``build_py`` followed by protoc into the ``_generated`` package."""

    def run(self) -> None:
        super().run()
        protogen = _protogen()
        base = ROOT if self.editable_mode else Path(self.build_lib)
        for path in protogen.generate(base / protogen.PACKAGE_PATH):
            print(f"generated {path}")


setup(cmdclass={"build_py": BuildPyWithProtos})
