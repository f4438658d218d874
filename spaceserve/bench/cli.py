"""`spaceserve bench SUITE ...`: the benchmark suites (one so far: `serve`)."""

from __future__ import annotations

import sys

SUITES = {"serve": "spaceserve.bench.serve"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUITES:
        print(f"usage: spaceserve bench {{{','.join(SUITES)}}} [ARGS] (see `spaceserve bench "
              "serve --help`)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    import importlib

    return int(importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0)
