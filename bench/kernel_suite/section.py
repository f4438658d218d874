"""The kernel suite as a GPU-harness section: `run(results_dir, time_budget_s) -> rows`.

Runs the suite's GPU profile (the CPU profile without a GPU) in a pytest subprocess whose
`--kernel-deadline` leaves room to finish inside the budget: benchmarks still queued at the
deadline are skipped, and the pytest-benchmark JSON of those that ran is written either way.
Into `results_dir`: ``kernel_suite.json`` (pytest-benchmark JSON) and ``kernel_suite.png``
(latency and GB/s against SMs per kernel). Returns one row per benchmark, plus a headline per
kernel: its bandwidth and share of peak at the whole device, and the fewest SMs within 10% of
the whole device's latency (the knee of its resource-utility curve).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from . import SUITE_DIR

STARTUP_S = 25.0  # interpreter start, imports, collection
TAIL_S = 15.0  # the benchmark in flight at the deadline, the JSON, the tables
KNEE = 1.10  # "within 10% of the whole device"


def headlines(points: list[Any]) -> list[dict[str, Any]]:
    """A headline per (kernel, backend): the first case's whole-device figures and its knee."""
    seen, rows = set(), []
    for p in points:
        key = (p.kernel, p.backend)
        if key in seen:
            continue
        curve = sorted((q for q in points if q.group == p.group and q.backend == p.backend),
                       key=lambda q: q.budget)
        full = curve[-1]
        knee = next(q for q in curve if q.median_s <= full.median_s * KNEE)
        seen.add(key)
        rows.append({"headline": (
            f"{p.kernel} [{p.backend}] {p.case} {p.dtype}: {full.median_s * 1e6:.1f} us, "
            f"{full.gbs:.0f} GB/s, {full.tflops:.1f} TFLOP/s at {full.budget} SMs; within 10% "
            f"from {knee.budget} SMs")})
    return rows


def run(results_dir: Path, time_budget_s: float, *, select: str | None = None,
        profile: str | None = None) -> list[dict[str, Any]]:
    """Run the suite into `results_dir` within `time_budget_s` seconds; rows for the harness."""
    import torch

    from spaceserve.bench.kernels.plots import load_points, plot_curves
    from spaceserve.bench.kernels.suite import pytest_command, suite_env

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    source = SUITE_DIR.parents[1]
    json_path = results_dir / "kernel_suite.json"
    json_path.unlink(missing_ok=True)
    profile = profile or ("gpu" if torch.cuda.is_available() else "cpu")
    deadline = max(5.0, time_budget_s - STARTUP_S - TAIL_S)
    cmd = pytest_command(source, json_path=str(json_path), select=select, profile=profile,
                         deadline_s=deadline,
                         extra=["-q", "--benchmark-columns=min,median,rounds"])
    rows: list[dict[str, Any]] = [{"profile": profile, "deadline_s": deadline}]
    try:
        rc = subprocess.run(cmd, cwd=source, env=suite_env(source),
                            timeout=max(10.0, time_budget_s - 2)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rows[0]["pytest_exit"] = rc
    if not json_path.exists():
        rows[0]["headline"] = f"kernel suite wrote no JSON (pytest exit {rc})"
        return rows
    points = load_points(json_path, profile)
    for p in points:
        rows.append({"kernel": p.kernel, "backend": p.backend, "case": p.case, "dtype": p.dtype,
                     "budget": p.budget, "median_us": p.median_s * 1e6, "gbs": p.gbs,
                     "tflops": p.tflops})
    rows[0]["benchmarks"] = len(points)
    if points:
        rows += headlines(points)
        try:
            plot_curves(points, results_dir / "kernel_suite.png")
        except RuntimeError as exc:  # no matplotlib: the JSON is the result
            rows[0]["plot"] = str(exc)
    return rows


def dry_run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The harness's dry run: one small slice of the CPU profile, so the control flow (pytest
    subprocess, JSON, rows, plot) runs without a GPU in a few seconds."""
    return run(results_dir, max(time_budget_s, STARTUP_S + TAIL_S + 5), select="store_kv",
               profile="cpu")
