"""`spaceserve bench SUITE ...`: the benchmark suites (`serve`; `kernels` runs the kernel suite,
`plot-kernels` plots its JSON)."""

from __future__ import annotations

import sys

SUITES = {"serve": "spaceserve.bench.serve",
          "kernels": "spaceserve.bench.kernel_suite",
          "plot-kernels": "spaceserve.bench.kernel_plots"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUITES:
        print(f"usage: spaceserve bench {{{','.join(SUITES)}}} [ARGS] (see `spaceserve bench "
              "SUITE --help`)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    import importlib

    return int(importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0)
