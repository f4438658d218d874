"""Timing and plain-text tables for the package's benchmarks and the kernel demo.

Times are medians in milliseconds. On CUDA they come from `triton.testing.do_bench` (which
flushes L2 between calls and syncs the device); on CPU from wall-clock repeats. Nothing here
imports a kernel module, so the demo can set TRITON_INTERPRET before kernels are imported, and
torch is imported by the functions that time (a table alone does not need it). The repo-level
benchmarks (bench/common.py) use the same helpers.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device (no-op on CPU)."""
    import torch

    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        torch.cuda.synchronize(dev)


def bench_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100,
             device: torch.device | str | None = None, min_reps: int = 1) -> float:
    """Median time of one call of `fn` in milliseconds."""
    import torch

    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="median"))
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start) * 1e3 < rep_ms:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 1000:
            break
    return statistics.median(times)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:.3g}" if a < 1e-2 or a >= 1e5 else f"{v:.2f}" if a < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Plain-text table of dict rows (columns default to the keys of the first row)."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns else list(rows[0])
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()
    out = [line, "-" * len(line)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            for row in cells]
    return "\n".join(out)
