"""The GPU harness: runs the registered sections (bench/gpu/sections.py), each in its own process
under its own time budget, and keeps a summary, a log and one archive of every result up to date
in an output folder after every section.

    bash bench/gpu/run.sh --out OUTDIR                  # on the GPU machine, from the repo root
    bash bench/gpu/run.sh --dry-run OUTDIR              # the same control flow on CPU, ~1 min

OUTDIR receives three files: results.tar.gz (the whole results folder), summary.json (every
section with its status, rows, headlines and figures) and harness.log (the console). The full
results stay in RESULTS_DIR (default bench/results/<date>-<gpu>/). One Triton cache serves the
whole run, warmed first by the "warmup" section. The run exits 0 even when sections fail (the
summary says which; --strict makes failures exit 1).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gpu.runner import (  # noqa: F401  (re-exported: the harness's public names)
    ROOT,
    SOFT_FRACTION,
    Outcome,
    RunOptions,
    blocked_imports_dir,
    child_main,
    run_all,
    run_section,
)
from bench.gpu.sections import DEFAULT_TOTAL_S, DRY_TOTAL_S, SECTIONS, Section  # noqa: F401
from bench.gpu.summary import Publisher, archive, format_summary  # noqa: F401


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (no CUDA context is created here), else None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return names[0] if out.returncode == 0 and names else None


def default_results_dir(gpu: str | None) -> Path:
    """bench/results/<date>-<gpu>/, e.g. 2026-11-02-h200."""
    tag = "cpu"
    if gpu:
        tag = next((w for w in gpu.lower().replace("-", " ").split()
                    if any(c.isdigit() for c in w)), "gpu")
    return ROOT / "bench" / "results" / f"{_dt.date.today().isoformat()}-{tag}"


def _budget(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected SECTION=SECONDS, got {text!r}")
    return name, float(seconds)


def _stall(text: str) -> tuple[str, int]:
    name, sep, rows = text.partition(":")
    if not sep or not rows.isdigit() or int(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected SECTION:ROWS (ROWS >= 1), got {text!r}")
    return name, int(rows)


def build_parser(sections: dict[str, Section] | None = None) -> argparse.ArgumentParser:
    table = SECTIONS if sections is None else sections
    p = argparse.ArgumentParser(prog="bench/gpu/run.sh", description="SpaceServe GPU harness")
    p.add_argument("results_dir", nargs="?", type=Path,
                   help="where JSON, PNGs and logs go (default bench/results/<date>-<gpu>/; "
                   "a fresh temporary folder in a dry run)")
    p.add_argument("--out", type=Path, metavar="OUTDIR",
                   help="folder that receives results.tar.gz, summary.json and harness.log, "
                   "refreshed after every section")
    p.add_argument("--dry-run", nargs="?", const=True, default=None, metavar="OUTDIR",
                   help="run every section's control flow on CPU with the CUDA work skipped or "
                   "faked (serve extra blocked, as on the GPU image); OUTDIR as --out")
    p.add_argument("--only", nargs="+", choices=list(table), metavar="SECTION",
                   help=f"run only these sections: {', '.join(table)}")
    p.add_argument("--budget", type=_budget, action="append", default=[],
                   metavar="SECTION=SECONDS", help="override a section's time budget")
    p.add_argument("--total-s", type=float, default=None,
                   help=f"wall-clock cap for all sections (default {DEFAULT_TOTAL_S:.0f}; "
                   f"{DRY_TOTAL_S:.0f} in a dry run)")
    p.add_argument("--archive", type=Path,
                   help="pack the results folder into this .tar.gz (default OUTDIR/"
                   "results.tar.gz)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a section fails or times out (default: exit 0, the "
                   "summary says which)")
    p.add_argument("--stall", type=_stall, metavar="SECTION:ROWS",
                   help="dry run only: make SECTION hang after ROWS rows, to check that a "
                   "section killed at its limit keeps its rows")
    p.add_argument("--list", action="store_true", help="list the sections and exit")
    return p


def main(argv: list[str] | None = None, sections: dict[str, Section] | None = None) -> int:
    table = SECTIONS if sections is None else sections
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # a section's own process (see runner.run_section)
        child = argparse.ArgumentParser(prog="bench.gpu.harness --child")
        for flag, kind in (("--child", str), ("--target", str), ("--budget", float),
                           ("--stall-after", int)):
            child.add_argument(flag, type=kind)
        child.add_argument("results_dir", type=Path)
        c = child.parse_args(argv)
        return child_main(c.child, c.target, c.budget, c.results_dir, c.stall_after)
    parser = build_parser(table)
    args = parser.parse_args(argv)
    if args.list:
        for name, s in table.items():
            print(f"{name:16} {s.budget_s:5.0f} s  {s.help}")
        return 0
    dry = args.dry_run is not None
    out = args.out or (Path(args.dry_run) if isinstance(args.dry_run, str) else None)
    if args.stall and not dry:
        parser.error("--stall is for dry runs only")
    names = args.only or list(table)
    unknown = [n for n, _ in args.budget if n not in table] + \
        ([args.stall[0]] if args.stall and args.stall[0] not in table else [])
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}")
    gpu = None if dry else gpu_name()
    scratch = None  # a dry run's own folder, removed at the end when the archive holds it
    if args.results_dir:
        results_dir = args.results_dir.resolve()
    elif dry:
        scratch = Path(tempfile.mkdtemp(prefix="spaceserve-dry-run-"))
        results_dir = scratch / "results"
    else:
        results_dir = default_results_dir(gpu)
    budgets = {n: table[n].dry_budget_s if dry else table[n].budget_s for n in names}
    budgets.update({n: s for n, s in args.budget if n in budgets})
    total = args.total_s or (DRY_TOTAL_S if dry else DEFAULT_TOTAL_S)
    env = {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(
        results_dir.parent / ".triton-cache" if dry else ROOT / ".triton" / "cache")}
    if dry:
        env |= {"SPACESERVE_GPU_DRY_RUN": "1", "PYTHONPATH": str(blocked_imports_dir())}
    os.environ["TRITON_CACHE_DIR"] = env["TRITON_CACHE_DIR"]  # recorded in the summary
    # As run.sh exports it, for a harness started without run.sh; sections inherit it.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    publisher = Publisher(results_dir, out.resolve() if out else None,
                          {"argv": argv, "dry_run": dry, "total_s": total}, gpu,
                          args.archive.resolve() if args.archive else None)
    try:
        print(f"SpaceServe GPU harness{' (dry run)' if dry else ''} -> {results_dir}"
              + (f", output folder {out}" if out else "") + f"; sections: {', '.join(names)}",
              flush=True)
        publisher.update([Outcome(n, budget_s=budgets[n]) for n in names])
        options = RunOptions(results_dir, dry_run=dry, stall=args.stall, env=env)
        outcomes = run_all(names, results_dir, total, table, options=options, budgets=budgets,
                           on_done=publisher.update)
        publisher.update(outcomes, finished=True)
        print("\n=== SpaceServe GPU harness summary ===")
        print(format_summary(outcomes), flush=True)
    finally:
        publisher.close()
        if scratch is not None and publisher.archive_path is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if args.strict and not all(o.ok for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
