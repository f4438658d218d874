"""``best-temporal``: the strongest time-multiplexed schedule, found per SLO and rate, not chosen.

At every rate of a sweep, each candidate time-multiplexed configuration runs the same seeds,
and the one with the highest goodput (ties: the lower p99 TTFT of the served image requests)
is reported as the mode ``best-temporal``, its row naming the knobs it chose (``knobs``) and
what every candidate reached (``tuned``). The candidates (`candidates`): for each prefill token
budget of `TUNE_BUDGETS` (``max_num_batched_tokens``), ``temporal`` (the engine's whole FIFO
encoder passes) and ``temporal-chunked`` with TWSRFT at the SLO-derived window
(`chunked_window_s` at that budget) and at twice it, and with FIFO order at the derived window.
``temporal`` in a sweep keeps the vLLM-like defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.sim.config import SimConfig, chunked_window_s

BEST = "best-temporal"
TUNE_BUDGETS = (512, 1024, 2048, 4096)

Row = dict[str, Any]


def candidates(curves: CurveSet, base: SimConfig,
               budgets: Sequence[int] = TUNE_BUDGETS) -> list[tuple[dict[str, Any], SimConfig]]:
    """(knobs, config) of every time-multiplexed configuration the tuner tries."""
    out: list[tuple[dict[str, Any], SimConfig]] = []
    for budget in budgets:
        b = dataclasses.replace(base, max_num_batched_tokens=budget)
        out.append(({"mode": "temporal", "max_num_batched_tokens": budget,
                     "encoder_policy": "fifo", "window_ms": None},
                    dataclasses.replace(b, mode="temporal", encoder_policy=None, window_s=None)))
        chunked = dataclasses.replace(b, mode="temporal-chunked")
        window = chunked_window_s(curves, chunked)
        for policy, w in (("twsrft", window), ("twsrft", 2 * window), ("fifo", window)):
            out.append(({"mode": "temporal-chunked", "max_num_batched_tokens": budget,
                         "encoder_policy": policy, "window_ms": round(1e3 * w, 3)},
                        dataclasses.replace(chunked, encoder_policy=policy, window_s=w)))
    return out


def _key(row: Row) -> tuple[float, float]:
    p99 = row["image"]["ttft"]["p99_ms"]
    return row["goodput"]["rate_per_s"], -(p99 if not math.isnan(p99) else math.inf)


def best_rows(curves: CurveSet, base: SimConfig, rates: Sequence[float],
              run_point: Callable[[SimConfig, float], Row],
              budgets: Sequence[int] = TUNE_BUDGETS) -> list[Row]:
    """One ``best-temporal`` row per rate: every candidate (over `budgets`) run by
    `run_point(config, rate)`, the best kept with its knobs and every candidate's outcome."""
    tried = candidates(curves, base, budgets)
    out = []
    for rate in rates:
        rows = [(knobs, run_point(cfg, rate)) for knobs, cfg in tried]
        knobs, best = max(rows, key=lambda kr: _key(kr[1]))
        best = dict(best, knobs=knobs, tuned=[
            {**k, "rate_per_s": r["goodput"]["rate_per_s"],
             "attainment": r["goodput"]["attainment"],
             "image_ttft_p99_ms": r["image"]["ttft"]["p99_ms"]} for k, r in rows])
        out.append(best)
    return out
