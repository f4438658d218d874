"""Spatial sharing ("share"), spatial as a superset ("superset": + whole-GPU encoder windows)
and temporal-chunked with a 5 ms window and 2048-token prefill chunks (or 512), simulated (modelled
Qwen2-VL-7B on the H200 preset) under SLO A and SLO B of bench/sim/goodput_sweep.py.

Per point: goodput (image requests/s meeting the SLO), attainment, the p99 TTFT of the image
requests that were served (finished within --drain s of the last arrival) against 2x the TTFT
bound, and for spatial SIS's action counts (`SpaceInferenceScheduler.action_counts`).

    PYTHONPATH=. python -m bench.sim.sis_superset [--rates 12,16,20,24] [--seeds 0,1] \
        [--duration 30] [--drain 10] [--overdue S] [--json out.json]

``--overdue S`` sets TWSRFT's opt-in tail bound (`SchedulingPolicy.overdue_s`: an image past
its deadline by more than S seconds goes first while the live jobs' slack allows) in every
variant; the simulator has no flag for it yet, so it is set on the policy the run builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from typing import Any

from bench.sim.goodput_sweep import SLOS
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.workload import Workload

VARIANTS = {
    "spatial-share": dict(mode="spatial", sis_actions="share"),
    "spatial-superset": dict(mode="spatial", sis_actions="superset"),
    "temporal-chunked-5ms-2048": dict(mode="temporal-chunked", window_s=0.005,
                                      chunk_tokens=2048),
    "temporal-chunked-5ms-512": dict(mode="temporal-chunked", window_s=0.005, chunk_tokens=512),
}
DEFAULT_VARIANTS = "spatial-share,spatial-superset,temporal-chunked-5ms-2048"


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def point(curves: Any, slo: Slo, variant: str, rate: float, seeds: list[int], duration: float,
          drain: float) -> dict[str, Any]:
    met = counted = 0
    ttfts: list[float] = []
    counts: Counter[str] = Counter()
    for seed in seeds:
        cfg = SimConfig(slo=slo, **VARIANTS[variant])
        res = simulate(curves, cfg, Workload(rate, duration, seed=seed), drain_s=drain)
        g = res.goodput(slo)
        met, counted = met + g.met, counted + g.counted
        ttfts += [r.first_token - r.arrival for r in res.requests
                  if r.kind == "image" and r.finish is not None]
        if res.gpus[0].sis is not None:
            counts.update(res.gpus[0].sis.action_counts())
    return {"variant": variant, "rate": rate, "goodput": met / (duration * len(seeds)),
            "attainment": met / counted if counted else 1.0, "p99_ttft_served_s": p99(ttfts),
            "served": len(ttfts), "actions": dict(sorted(counts.items()))}


def set_overdue(overdue_s: float) -> None:
    """Every simulator built from now on runs TWSRFT with this overdue bound."""
    from spaceserve.runtime.sim import engine

    base = engine.sim_policy
    engine.sim_policy = lambda curves, c: dataclasses.replace(base(curves, c),
                                                              overdue_s=overdue_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="12,16,20,24")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--slos", default="A,B")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--overdue", type=float, default=None, metavar="S",
                    help="TWSRFT's overdue bound in seconds (default: off)")
    ap.add_argument("--json", default=None, help="also write every point here")
    args = ap.parse_args(argv)
    if args.overdue is not None:
        set_overdue(args.overdue)
    curves = analytic_curves()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = []
    for name in args.slos.split(","):
        slo = Slo.parse(SLOS[name])
        bound = 2 * slo.ttft / 1e3 if slo.ttft else float("inf")
        print(f"SLO {name} ({SLOS[name]}), seeds {seeds}, {args.duration:g} s, "
              f"drain {args.drain:g} s, overdue bound {args.overdue}")
        print(f"{'variant':28} {'rate':>5} {'goodput':>8} {'attain':>7} {'p99 TTFT':>9} "
              f"{'<=2x':>5}  actions")
        for rate in [float(r) for r in args.rates.split(",")]:
            for v in args.variants.split(","):
                row = point(curves, slo, v, rate, seeds, args.duration, args.drain)
                row["slo"] = name
                out.append(row)
                ok = "yes" if row["p99_ttft_served_s"] <= bound else "NO"
                print(f"{v:28} {rate:5g} {row['goodput']:8.2f} {row['attainment']:7.3f} "
                      f"{row['p99_ttft_served_s']:8.2f}s {ok:>5}  {row['actions'] or ''}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
