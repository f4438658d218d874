"""``best-temporal``: the strongest time-multiplexed schedule, found per SLO and rate, not chosen.

At every rate of a sweep, each candidate time-multiplexed configuration runs the same seeds,
and the one with the highest goodput (ties: the lower p99 TTFT of the served image requests)
is reported as the mode ``best-temporal``, its row naming the knobs it chose (``knobs``) and
what every candidate reached (``tuned``). The search has two stages. The grid (`candidates`):
for each prefill token budget of `TUNE_BUDGETS` (``max_num_batched_tokens``), ``temporal`` (the
engine's whole FIFO encoder passes) and ``temporal-chunked`` in FIFO and in TWSRFT order, each
at `WINDOW_STEPS` x the SLO-derived window (`chunked_window_s` at that budget). Then, at each
rate, the window is refined (`refined`) around the `REFINE` best chunked (budget, order) pairs
of the grid: `REFINE_STEPS` x the window each chose. A coarse grid alone misses the best window
by up to 7% of goodput at a point past saturation (docs/results/sim-best-temporal.md): with
128 decodes under ``ttft:2000,itl:21`` the best window is 0.7x the derived one, under
``ttft:2000,tpot:50`` 0.4x at a 1024-token budget. Last, the `FLIPS` best configurations run
again with the engine's other scheduling (``async_scheduling``): pipelined steps hide the
host's time but see new arrivals and freed embedding slots one interval later
(`loops.pipelined`), unpipelined ones pay the host's time each step; past saturation either
may serve more. ``temporal`` in a sweep keeps the vLLM-like defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.sim.config import MIN_WINDOW_S, SimConfig, chunked_window_s

BEST = "best-temporal"
TUNE_BUDGETS = (512, 1024, 2048, 4096)
WINDOW_STEPS = (0.5, 1.0, 2.0)  # the grid's windows: x the SLO-derived window, both orders
REFINE = 2  # chunked (budget, order) pairs of the grid refined at each rate
REFINE_STEPS = (0.7, 0.85, 1.2, 1.4)  # the refined windows: x the window the pair chose
FLIPS = 2  # the best configurations at each rate also run with the other async_scheduling

Row = dict[str, Any]


def _chunked(budget: int, policy: str, window_s: float, cfg: SimConfig
             ) -> tuple[dict[str, Any], SimConfig]:
    window_s = max(MIN_WINDOW_S, window_s)  # a shorter window runs no layer
    return ({"mode": "temporal-chunked", "max_num_batched_tokens": budget,
             "encoder_policy": policy, "window_ms": round(1e3 * window_s, 3),
             "async_scheduling": cfg.async_scheduling},
            dataclasses.replace(cfg, mode="temporal-chunked", max_num_batched_tokens=budget,
                                encoder_policy=policy, window_s=window_s))


def candidates(curves: CurveSet, base: SimConfig,
               budgets: Sequence[int] = TUNE_BUDGETS) -> list[tuple[dict[str, Any], SimConfig]]:
    """(knobs, config) of every time-multiplexed configuration of the tuner's grid."""
    out: list[tuple[dict[str, Any], SimConfig]] = []
    for budget in budgets:
        b = dataclasses.replace(base, max_num_batched_tokens=budget)
        out.append(({"mode": "temporal", "max_num_batched_tokens": budget,
                     "encoder_policy": "fifo", "window_ms": None,
                     "async_scheduling": base.async_scheduling},
                    dataclasses.replace(b, mode="temporal", encoder_policy=None, window_s=None)))
        window = chunked_window_s(curves, dataclasses.replace(b, mode="temporal-chunked"))
        for policy in ("fifo", "twsrft"):
            out.extend(_chunked(budget, policy, f * window, b) for f in WINDOW_STEPS)
    return _distinct(out)


def refined(base: SimConfig, rows: Sequence[tuple[dict[str, Any], Row]],
            top: int = REFINE) -> list[tuple[dict[str, Any], SimConfig]]:
    """The second stage: for the `top` best chunked (budget, order) pairs among `rows` (the
    grid's (knobs, row)s at one rate), `REFINE_STEPS` x the window each pair did best with."""
    best: dict[tuple[int, str], tuple[dict[str, Any], Row]] = {}
    for knobs, row in rows:
        if knobs["mode"] == "temporal-chunked":
            pair = (knobs["max_num_batched_tokens"], knobs["encoder_policy"])
            if pair not in best or _key(row) > _key(best[pair][1]):
                best[pair] = (knobs, row)
    ranked = sorted(best.values(), key=lambda kr: _key(kr[1]), reverse=True)[:top]
    seen = [knobs for knobs, _ in rows]
    return [kc for kc in _distinct([_chunked(k["max_num_batched_tokens"], k["encoder_policy"],
                                             f * k["window_ms"] / 1e3, base)
                                    for k, _ in ranked for f in REFINE_STEPS])
            if kc[0] not in seen]


def flipped(runs: Sequence[tuple[dict[str, Any], SimConfig]],
            rows: Sequence[tuple[dict[str, Any], Row]],
            top: int = FLIPS) -> list[tuple[dict[str, Any], SimConfig]]:
    """The last stage: the `top` best of `runs` (knobs, config), by their `rows` (knobs, row),
    with the engine's other scheduling - each once."""
    ranked = sorted(zip(runs, rows, strict=True), key=lambda rr: _key(rr[1][1]), reverse=True)
    seen = [knobs for knobs, _ in rows]
    out = []
    for (knobs, cfg), _ in ranked[:top]:
        flip = not cfg.async_scheduling
        k = {**knobs, "async_scheduling": flip}
        if k not in seen:
            out.append((k, dataclasses.replace(cfg, async_scheduling=flip)))
    return out


def _distinct(tried: list[tuple[dict[str, Any], SimConfig]]
              ) -> list[tuple[dict[str, Any], SimConfig]]:
    """`tried` without repeated knobs (windows clamped to the same 1 ms)."""
    out: list[tuple[dict[str, Any], SimConfig]] = []
    for knobs, cfg in tried:
        if all(knobs != k for k, _ in out):
            out.append((knobs, cfg))
    return out


def _key(row: Row) -> tuple[float, float]:
    p99 = row["image"]["ttft"]["p99_ms"]
    return row["goodput"]["rate_per_s"], -(p99 if not math.isnan(p99) else math.inf)


def best_rows(curves: CurveSet, base: SimConfig, rates: Sequence[float],
              run_point: Callable[[SimConfig, float], Row],
              budgets: Sequence[int] = TUNE_BUDGETS) -> list[Row]:
    """One ``best-temporal`` row per rate: every candidate of the grid (over `budgets`) and of
    its refinement run by `run_point(config, rate)`, the best kept with its knobs and every
    candidate's outcome."""
    tried = candidates(curves, base, budgets)
    out = []
    for rate in rates:
        rows = [(knobs, run_point(cfg, rate)) for knobs, cfg in tried]
        more = refined(base, rows)
        rows += [(knobs, run_point(cfg, rate)) for knobs, cfg in more]
        rows += [(knobs, run_point(cfg, rate)) for knobs, cfg in flipped(tried + more, rows)]
        knobs, best = max(rows, key=lambda kr: _key(kr[1]))
        best = dict(best, knobs=knobs, tuned=[
            {**k, "rate_per_s": r["goodput"]["rate_per_s"],
             "attainment": r["goodput"]["attainment"],
             "image_ttft_p99_ms": r["image"]["ttft"]["p99_ms"]} for k, r in rows])
        out.append(best)
    return out
