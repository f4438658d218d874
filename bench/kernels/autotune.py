"""The "autotune" section: measured resource-utility curves and per-budget kernel configs.

1. A quick profile (`autotune.profile.Grid.quick`) of Qwen2-VL-7B (random weights, bf16) on the
   current GPU: encoder pass, prefill chunk and decode step against SMs, alone and co-running,
   written as ``autotune/curves.json`` + ``curves.png`` (resumable checkpoint beside them).
2. The analytic roofline curves (`policy.analytic.model`) against every measured point:
   ``autotune/analytic_error.json`` and a summary row per stage and mode.
3. Kernel configs tuned for linear, gated_mlp, paged_decode and vit_attention at budgets 32,
   66 and 132 (``autotune/kernel_configs.json``), each timed against the launcher's default.

The profile gets about half of the time budget and stops early (incomplete, resumable) when it
runs out; the tuner skips what it cannot fit. Nothing runs without CUDA.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SECTION = "autotune"
BUDGETS = (32, 66, 132)
KERNELS = ("paged_decode", "linear", "gated_mlp", "vit_attention")


def preset_for(device: torch.device) -> str:
    """The analytic device preset closest to `device` (H200 unless the name says otherwise)."""
    from spaceserve.runtime.policy.analytic.model import PRESETS

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((p for p in PRESETS if p in name.upper()), "H200")


def _profile(config: Any, name: str, device: torch.device, dtype: torch.dtype, out: Path,
             budget_s: float, grid: Any, timer: Any, backend: str | None) -> tuple[list, Any]:
    from autotune.profile import Grid, Profiler
    from autotune.timers import CudaTimer, WallTimer
    from autotune.workload import Qwen2VLWorkload
    from spaceserve.models import from_config

    t0 = time.perf_counter()
    model = from_config(config, attention_backend=backend or (
        "triton" if device.type == "cuda" else "torch"), dtype=dtype, device=device)
    workload = Qwen2VLWorkload(model, name=name)
    build_s = time.perf_counter() - t0
    timer = timer or (CudaTimer(device) if device.type == "cuda" else WallTimer())
    profiler = Profiler(workload, grid or Grid.quick(workload.num_sms), out, timer=timer,
                        progress=False)
    result = profiler.run(max(0.0, budget_s - build_s))
    if hasattr(timer, "close"):
        timer.close()  # its graphs and green partitions go before the workload's memory
    workload.close()
    row = {"section": SECTION, "stage": "profile", "model": name, "build_s": build_s,
           "points": len(result.measured), "of": result.total, "seconds": result.seconds,
           "complete": result.complete,
           "files": {k: str(v) for k, v in result.files.items()}}
    uncovered = getattr(timer, "uncovered", [])
    if uncovered:
        row["background_stopped_early"] = uncovered
    for attr, key in (("eager", "not_graph_timed"), ("green", "green_corun_points")):
        if getattr(timer, attr, None):
            row[key] = len(getattr(timer, attr))
    if hasattr(timer, "host_bound_points"):
        row["host_bound_points"] = timer.host_bound_points()
    row["headline"] = (f"profile {name}: {len(result.measured)}/{result.total} points in "
                       f"{result.seconds:.0f} s" + ("" if result.complete else
                                                    " (incomplete: rerun to resume)"))
    return [row], (profiler, result)


def _errors(config: Any, name: str, device: torch.device, dtype: torch.dtype, out: Path,
            profiler: Any, result: Any) -> list[dict]:
    from autotune.compare import point_errors, summarize_errors
    from bench.common import write_json
    from spaceserve.runtime.policy.analytic.model import analytic_curves

    preset = preset_for(device)
    model = analytic_curves(config, preset, name=name, dtype=str(dtype).removeprefix("torch."))
    errs = point_errors(result.measured, profiler.points(), model)
    write_json(out / "analytic_error.json", {"preset": preset, "points": errs})
    rows = [{"section": SECTION, "stage": "analytic-error", "preset": preset,
             "curve": s.pop("stage"), **s} for s in summarize_errors(errs)]
    iso = {r["curve"]: r["median_abs_err"] for r in rows if r["mode"] == "isolated"}
    if iso:
        rows.append({"section": SECTION, "stage": "analytic-error", "headline":
                     f"analytic ({preset}) vs measured, median |error| isolated: "
                     + ", ".join(f"{s} {e:.0%}" for s, e in iso.items())})
    return rows


def _tune(device: torch.device, dtype: torch.dtype, out: Path, budget_s: float, shapes: Any,
          budgets: Sequence[int], kernels: Sequence[str], bench: Callable | None) -> list[dict]:
    from autotune.cases import TuneShapes
    from autotune.tune_kernels import Tuner, result_rows

    tuner = Tuner(device, dtype, shapes or TuneShapes.qwen2_vl_7b(), list(budgets), bench=bench,
                  time_budget_s=budget_s)
    rows: list[dict[str, Any]] = []
    results = []
    for name in kernels:
        try:
            results.append(tuner.tune_kernel(name))
        except Exception as exc:  # one kernel's failure must not lose the others
            rows.append({"section": SECTION, "stage": "tune", "kernel": name,
                         "error": f"{type(exc).__name__}: {exc}"[:400]})
    path = tuner.save(out / "kernel_configs.json")
    for r in result_rows(results):
        rows.append({"section": SECTION, "stage": "tune", **r})
    for r in results:
        if r.skipped:
            continue
        speed = [f"{(r.default_ms[b] / r.tuned_ms[b]):.2f}x@{b}" for b in sorted(r.tuned_ms)
                 if r.default_ms.get(b) and r.tuned_ms.get(b)]
        rows.append({"section": SECTION, "stage": "tune", "kernel": r.name, "headline":
                     f"{r.name}: tuned vs default {' '.join(speed) or 'n/a'}; identity "
                     f"{r.identity}"})
    rows.append({"section": SECTION, "stage": "tune", "file": str(path)})
    return rows


def run_suite(config: Any, name: str, device: torch.device, dtype: torch.dtype,
              out_dir: str | Path, time_budget_s: float, *, grid: Any = None,
              timer: Any = None, shapes: Any = None, budgets: Sequence[int] = BUDGETS,
              kernels: Sequence[str] = KERNELS, bench: Callable | None = None,
              backend: str | None = None, profile_share: float = 0.5) -> list[dict]:
    """Profile, analytic error and tuning for `config` on `device` (the GPU section runs it at
    7B shapes; tests at tiny shapes on CPU)."""
    from bench.common import section_rows

    start = time.perf_counter()
    out = Path(out_dir)
    rows = section_rows()  # saved after every stage's rows (the profile checkpoints itself)
    first, (profiler, result) = _profile(config, name, device, dtype, out,
                                         time_budget_s * profile_share, grid, timer, backend)
    rows += first
    rows += _errors(config, name, device, dtype, out, profiler, result)
    del profiler, result
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    left = time_budget_s - (time.perf_counter() - start)
    rows += _tune(device, dtype, out, max(0.0, left * 0.8), shapes, budgets, kernels, bench)
    return list(rows)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict]:
    """GPU harness entry point: Qwen2-VL-7B shapes, bf16, on the current CUDA device."""
    if not torch.cuda.is_available():
        return [{"section": SECTION, "skipped": "needs a CUDA device"}]
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config

    return run_suite(qwen2_vl_7b_config(), "Qwen2-VL-7B", torch.device("cuda"), torch.bfloat16,
                     Path(results_dir) / SECTION, time_budget_s * 0.95)
