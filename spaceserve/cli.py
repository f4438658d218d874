"""The `spaceserve` command: one subcommand per tool, each imported only when it runs.

Each entry of `COMMANDS` names a module whose `main(argv: list[str] | None) -> int` takes the
arguments after the subcommand, so `spaceserve demo --help` shows the demo's own options. A
command module builds its parser before importing anything heavy (torch, triton, transformers,
the engine), so every ``--help`` answers at once. Where the implementation's package itself is
heavy to import (`spaceserve.kernels`), a third field ``"module:function"`` names a light parser
builder: the arguments are parsed there first, then the module's ``run(args)`` runs. A new tool
is one line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .cli_args import HelpFormatter

# subcommand -> (module with main(argv) -> int, one-line help[, light parser "module:function";
# then the module provides run(args) -> int instead])
COMMANDS: dict[str, tuple[str, ...]] = {
    "demo": ("spaceserve.bench.kernels.demo",
             "run every kernel at several SM budgets against its reference"),
    "compile-check": ("spaceserve.kernels.aot",
                      "compile every kernel configuration for sm_90a (no GPU needed)",
                      "spaceserve.cli_args:build_compile_check_parser"),
    "sim": ("spaceserve.runtime.sim.cli",
            "simulate TWSRFT + SIS on resource-utility curves: TPOT against image rate per mode"),
    "profile": ("autotune.profile", "measure resource-utility curves of a model on this device"),
    "serve": ("spaceserve.server.serve", "OpenAI-compatible HTTP server (--model PATH or tiny)"),
    "bench": ("spaceserve.bench.cli",
              "benchmarks: `bench serve` (serving, in-process or HTTP), `bench kernels` (the "
              "kernel suite over SM budgets), `bench plot-kernels` (its resource-utility "
              "curves)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spaceserve", formatter_class=HelpFormatter,
        description="SpaceServe: a vision encoder and an LLM decoder on disjoint SM budgets.\n"
                    "`spaceserve COMMAND --help` shows a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text, *_rest) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the subcommand is parsed here; everything after it belongs to the tool.
    args = build_parser().parse_args(argv[:1])
    module_name, _, *parser_ref = COMMANDS[args.command]
    if parser_ref:
        where, _, func = parser_ref[0].partition(":")
        parsed = getattr(importlib.import_module(where), func)().parse_args(argv[1:])
        return int(importlib.import_module(module_name).run(parsed) or 0)
    rc = importlib.import_module(module_name).main(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
