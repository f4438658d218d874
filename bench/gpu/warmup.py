"""The "warmup" section: compile every launcher's shapes into the run's one Triton cache
(``TRITON_CACHE_DIR``, shared by every later section) before anything is measured.

Round 1 runs the cases of bench/gpu/warm_cases.py in parallel worker processes (one per core, at
most 16: Triton compiles on the host, one kernel per process at a time) and records, through
Triton's compilation listener, each kernel specialisation compiled and its compile time. Round 2
runs every case again in fresh processes: each first launch now loads from the cache, and the
listener counts any recompile (a cache miss). Rows: one per case and round as they finish, one
per kernel (specialisations, compile seconds, second-launch time, misses) and a headline with
the warm-up's wall time. In a dry run (no CUDA) the workers fake each launch (no torch, no
Triton), so the pool, the rounds, the deadlines and the rows run as they would.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

SECTION = "warmup"
MAX_WORKERS = 16
ROUND1_SHARE = 0.7  # of the budget; round 2 gets what is left
FAKE_LAUNCH_S = 0.02
_WORKER: dict[str, Any] = {}


def _init_worker(fake: bool) -> None:
    """Per worker: CUDA up and Triton's compilation listener installed (not in a dry run)."""
    _WORKER.update(fake=fake, compiles=[])
    if fake:
        return
    import torch
    import triton

    torch.cuda.init()
    torch.ones(1, device="cuda").sum().item()

    def listener(*, src: Any, metadata: dict, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        name = getattr(src, "name", None) or metadata.get("name", "?")
        seconds = 0.0 if cache_hit else getattr(times, "total", 0) / 1e6
        _WORKER["compiles"].append((str(name), cache_hit, seconds))

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "compilation"):
        knobs.compilation.listener = listener


def _launch(case: tuple[str, str, str, dict[str, Any], float]) -> dict[str, Any]:
    """Run one case in this worker: its launches' time and what Triton compiled or loaded."""
    name, kernel, func, kwargs, _ = case
    row: dict[str, Any] = {"case": name, "kernel": kernel, "pid": os.getpid()}
    calls: list[float] = []
    _WORKER["compiles"] = []
    t0 = time.perf_counter()
    try:
        if _WORKER["fake"]:
            time.sleep(FAKE_LAUNCH_S)
            calls.append(FAKE_LAUNCH_S)
        else:
            import torch

            def timer(fn: Any) -> float:
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                calls.append(time.perf_counter() - start)
                return calls[-1] * 1e3

            fn = getattr(importlib.import_module("bench.gpu.warm_cases"), func)
            fn(torch.device("cuda"), timer, **kwargs)
    except Exception as exc:  # one failing case must not stop the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    compiles = _WORKER["compiles"]
    row.update(wall_s=time.perf_counter() - t0, launches=len(calls),
               first_launch_ms=calls[0] * 1e3 if calls else None,
               launch_ms=sum(calls) * 1e3,
               compiled=sum(1 for c in compiles if not c[1]),
               loaded=sum(1 for c in compiles if c[1]),
               compile_s=sum(c[2] for c in compiles),
               compiled_kernels=sorted({c[0] for c in compiles if not c[1]}))
    if _WORKER["fake"]:
        row["dry_run"] = True
    return row


def run_round(cases: list, workers: int, deadline: float, fake: bool, rows: list,
              label: str) -> dict[str, dict[str, Any]]:
    """Run `cases` on a fresh pool of `workers` processes until done or `deadline`; each result
    is appended to `rows` as it arrives. Returns {case: row}."""
    done: dict[str, dict[str, Any]] = {}
    pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(fake,))
    try:
        results = pool.imap_unordered(_launch, cases)
        for _ in cases:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                row = results.next(timeout=left)
            except mp.TimeoutError:
                break
            row["round"] = label
            done[row["case"]] = row
            rows.append(row)
    finally:
        pool.terminate()  # workers still compiling at the deadline are stopped
        pool.join()
    return done


def kernel_rows(cases: list, cold: dict, second: dict) -> list[dict[str, Any]]:
    """Per kernel: cases, specialisations compiled, compile seconds, second-launch time, misses."""
    out = []
    for kernel in dict.fromkeys(c[1] for c in cases):
        names = [c[0] for c in cases if c[1] == kernel]
        c1 = [cold[n] for n in names if n in cold]
        c2 = [second[n] for n in names if n in second]
        out.append({"kernel": kernel, "cases": len(names), "warmed": len(c1),
                    "specialisations": sum(r["compiled"] for r in c1),
                    "compile_s": sum(r["compile_s"] for r in c1),
                    "cold_wall_s": max((r["wall_s"] for r in c1), default=None),
                    "second_launch_ms": max((r["first_launch_ms"] or 0.0 for r in c2),
                                            default=None),
                    "second_misses": sum(r["compiled"] for r in c2),
                    "errors": sum(1 for r in c1 + c2 if "error" in r)})
    return out


def measure(results_dir: Path, time_budget_s: float, fake: bool) -> list[dict[str, Any]]:
    from bench.common import section_rows
    from bench.gpu.warm_cases import cases as warm_cases

    start = time.perf_counter()
    rows = section_rows()  # saved after every row
    cases = warm_cases()
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1, len(cases)))
    cold = run_round(cases, workers, start + ROUND1_SHARE * time_budget_s, fake, rows, "cold")
    warm_s = time.perf_counter() - start
    again = [c for c in cases if c[0] in cold and "error" not in cold[c[0]]]
    second = run_round(again, workers, start + time_budget_s, fake, rows, "second")
    per_kernel = kernel_rows(cases, cold, second)
    for r in per_kernel:
        rows.append({"round": "per kernel", **r})
    launches = [r["first_launch_ms"] for r in second.values() if r["first_launch_ms"]]
    misses = sum(r["compiled"] for r in second.values())
    specs = sum(r["compiled"] for r in cold.values())
    figures = {"warmup_s": warm_s, "warm_cases": len(cold), "cases": len(cases),
               "workers": workers, "specialisations": specs,
               "compile_s": sum(r["compile_s"] for r in cold.values()),
               "second_launch_ms_median": statistics.median(launches) if launches else None,
               "second_launch_ms_max": max(launches) if launches else None,
               "second_misses": misses}
    slowest = max(second.values(), key=lambda r: r["first_launch_ms"] or 0.0, default=None)
    rows.append({"round": "summary", "figures": figures, **({"dry_run": True} if fake else {}),
                 "headline": f"warm-up {warm_s:.0f} s{' (dry run, faked)' if fake else ''}: "
                 f"{len(cold)}/{len(cases)} cases on {workers} workers, {specs} specialisations"
                 f" compiled ({figures['compile_s']:.0f} s of compile); second launch in fresh "
                 f"processes {figures['second_launch_ms_median'] or 0:.1f} ms median, "
                 f"{figures['second_launch_ms_max'] or 0:.0f} ms max"
                 + (f" ({slowest['case']})" if slowest else "") + f", {misses} recompiled"})
    return list(rows)


def run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The GPU harness entry point (skips without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return [{"section": SECTION, "skipped": "needs a CUDA device"}]
    return measure(Path(results_dir), time_budget_s, fake=False)


def dry_run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The dry run: the same pool, rounds and rows, every launch faked."""
    return measure(Path(results_dir), time_budget_s, fake=True)
