"""Argument-parsing pieces shared by the `spaceserve` commands; argparse only, nothing heavy.

`HelpFormatter` keeps a description's own line breaks and shows every flag's default. The
parsers of commands whose implementation module is heavy to import (the compile check lives in
`spaceserve.kernels`, whose package loads torch and triton) are built here, so that
``spaceserve <cmd> --help`` answers before any of it is imported.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Raw description, and ``(default: X)`` after every optional flag's help unless the help
    already says what the default is. A flag that takes no value shows its default in its own
    sense: ``--no-prefix-caching`` "(default: prefix caching on)", ``--quick`` "(default:
    off)", never the stored ``True`` / ``False``, which reads as the flag's own state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or action.required:
            return text
        if action.nargs == 0 and isinstance(action.default, bool):
            return f"{text} (default: {switch_default(action)})"
        return super()._get_help_string(action)


def switch_default(action: argparse.Action) -> str:
    """What a flag without a value leaves in place when not given, in words: ``--no-X``
    turns X off, so X is on unless the flag is given; another flag turns its thing on."""
    long = next((o for o in action.option_strings if o.startswith("--")),
                action.option_strings[0])
    as_if_given = action.default == action.const  # the flag would change nothing
    if long.startswith("--no-"):
        return f"{long[5:].replace('-', ' ')} {'off' if as_if_given else 'on'}"
    return "on" if as_if_given else "off"


def build_compile_check_parser(prog: str = "spaceserve compile-check") -> argparse.ArgumentParser:
    """The parser of `spaceserve compile-check` (= ``python -m spaceserve.kernels.aot``)."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Compile every kernel configuration for sm_90a with Triton's own compiler\n"
                    "and ptxas (no GPU needed; run with TRITON_INTERPRET unset), and check shared\n"
                    "memory and wgmma use.")
    p.add_argument("--json", type=Path, help="write the results as JSON here (default: none)")
    p.add_argument("--module", action="append", default=None,
                   help="a module (dotted name or .py path) to check instead of the package; "
                        "repeatable (default: every kernel module)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="parallel compiles")
    p.add_argument("--no-spills", action="store_true",
                   help="skip the second ptxas run that counts spill bytes")
    return p
