"""`spaceserve bench SUITE ...`: the benchmark suites (`serve`; `kernels` runs the kernel suite,
`plot-kernels` plots its JSON).

Only the suite name is parsed here; everything after it belongs to the suite, so
`spaceserve bench serve --help` shows the suite's own options. A suite's module is imported
only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from spaceserve.cli_args import HelpFormatter

# suite -> (module with main(argv) -> int, one-line help)
SUITES: dict[str, tuple[str, str]] = {
    "serve": ("spaceserve.bench.serve",
              "serving benchmark: TTFT / TPOT / ITL / goodput against request rate, in-process "
              "engines or a server over HTTP"),
    "kernels": ("spaceserve.bench.kernels.suite",
                "kernel suite (pytest-benchmark) over SM budgets and attention backends"),
    "plot-kernels": ("spaceserve.bench.kernels.plots",
                     "plot kernel-suite JSON files: latency and GB/s against SMs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spaceserve bench", formatter_class=HelpFormatter,
        description="SpaceServe benchmarks. `spaceserve bench SUITE --help` shows a suite's "
                    "options.")
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, (_, help_text) in SUITES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv[:1])
    return int(importlib.import_module(SUITES[args.suite][0]).main(argv[1:]) or 0)
