"""Wall time of `spaceserve <cmd> --help` for every command, each in a fresh process (CPU).

A command's `--help` should answer at once (goal: under 1 s on a CPU): the parser is built
before torch, triton, transformers or the engine are imported. Each command runs `--repeat`
times in its own subprocess (``python -m spaceserve.cli CMD --help``); the table shows the
median and the fastest wall time, the bare interpreter start for scale, and the usage line, which
must name the command as ``spaceserve CMD``.

    PYTHONPATH=. python -m bench.serving.cli_help [--repeat 3] [--json runs/cli_help.json]

Timing is measured here, never asserted in a unit test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 1.0
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("demo",), ("compile-check",), ("sim",), ("profile",), ("serve",), ("bench",),
    ("bench", "serve"))


def time_help(cmd: tuple[str, ...], repeat: int) -> dict[str, object]:
    """Run ``spaceserve CMD --help`` `repeat` times; median / min seconds and the usage line."""
    argv = [sys.executable, "-m", "spaceserve.cli", *cmd, "--help"] if cmd else \
        [sys.executable, "-c", "pass"]
    times, usage, rc = [], "", 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
        times.append(time.perf_counter() - t0)
        rc = rc or proc.returncode
        text = (proc.stdout or proc.stderr).strip()
        usage = text.splitlines()[0] if text else ""
    name = " ".join(cmd) if cmd else "(python -c pass)"
    med = statistics.median(times)
    return {"command": name, "median_s": round(med, 3), "min_s": round(min(times), 3),
            "rc": rc, "ok": "-" if not cmd else ("yes" if med < GOAL_S and rc == 0 else "NO"),
            "usage": usage[:60]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.cli_help", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs per command (default: 3)")
    p.add_argument("--json", type=Path, help="also write the rows here (default: no file)")
    args = p.parse_args(argv)
    rows = [time_help((), args.repeat)] + [time_help(c, args.repeat) for c in COMMANDS]
    from bench.common import format_table  # after timing: it imports torch

    print(f"`spaceserve CMD --help` wall time, median of {args.repeat} fresh processes "
          f"(CPU, goal < {GOAL_S:g} s)")
    print(format_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"goal_s": GOAL_S, "rows": rows}, indent=1))
    return 0 if all(r["ok"] != "NO" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
