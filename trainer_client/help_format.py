"""How the commands' ``--help`` shows defaults."""

from __future__ import annotations

import argparse


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless there is none to show (no value, a switch
    off, an empty list) or the help already says it: ``(default: G)`` was followed by
    ``(default: None)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default, text = action.default, action.help or ""
        if default is None or default is False or default == [] or "default" in text:
            return action.help
        return super()._get_help_string(action)
