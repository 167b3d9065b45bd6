"""``--help`` that shows every option's default, for the command lines outside :mod:`vdbench.cli`.

Why a module of its own: ``stitch_comparison.py``, ``python -m vdbench.report`` and ``bench/*.py`` need the same
rule as the render CLIs (every flag says what it does and what it is when not given) without importing torch or
the render stack just to print their help. It imports nothing of vdbench.
"""

from __future__ import annotations

import argparse

__all__ = ["DefaultsHelpFormatter"]


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description as written and ends each option's help with its default -- ``(default: 24)``,
    ``(default: off)`` for a switch, ``(default: none)`` for an option that is unset unless given, ``(required)``
    for one that must be given -- unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        if action.required:
            return text if "required" in text.lower() else f"{text} (required)".strip()
        if action.nargs == 0 and isinstance(action.default, bool):
            shown = "on" if action.default else "off"
        elif action.default is None:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".strip()
