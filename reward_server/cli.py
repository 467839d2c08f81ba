"""``sde2-reward``: the command line of the reward server (score, explain, export, serve).

Each subcommand lives in the module that does the work; this file only wires them up, importing
lazily so that ``sde2-reward score`` never pays for the server stack and ``serve`` never imports
torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help). Each module provides ``add_arguments(parser)`` and
#: ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "score": ("reward_server.offline", "score a JSONL file of completions offline"),
    "explain": ("reward_server.explain_report", "why each completion got its reward (offline)"),
    "export": ("reward_server.encoders.onnx_export", "export the sentence encoder to ONNX"),
    "serve": ("reward_server.service.serve", "run the HTTP and gRPC reward server"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="sde2-reward", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sde2-reward``."""
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
