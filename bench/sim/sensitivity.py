"""Where sharing pays: spatial against the strongest time-multiplexing as the hardware varies.

The analytic curves fix three hardware facts that decide whether co-locating the encoder and
the decoder beats taking turns on the whole GPU; this sweep varies each (simulator, H200
preset, Qwen2-VL-7B, modelled):

- co-run contention: the slowdown of both stages while they share the GPU (0, 8, 20, 35%);
- the decoder's SM saturation: how many SMs decode needs to pull most of the HBM bandwidth
  (the preset's ``hbm_bw / per_sm_bw``: 66 SMs on the H200 preset), varied by ``per_sm_bw``;
- the encoder's SM scaling exponent: its throughput grows as SMs^alpha (1: linear, the
  roofline's compute-bound encoder; below 1, a partition loses less than its share of SMs).

Each cell runs, at rates around the encode+prefill capacity of the whole GPU (0.8, 1.0, 1.2 x),
spatial with pure sharing (``sis_actions`` "share"), the superset (``sis_actions``
"superset": sharing plus whole-GPU encoder windows) and ``best-temporal`` (the
time-multiplexed configuration tuned per rate over prefill budgets 512, 1024 and 2048,
`sim.tune`), and takes each mode's goodput at
saturation (its best over those rates). Writes sensitivity.json and a heat map of goodput
ratios (sharing / best-temporal, superset / best-temporal) per cell, and prints the table.

    python -m bench.sim.sensitivity --out runs/sensitivity [--quick] [--admission slo]

A GPU run settles it by measuring exactly these: the co-run slowdown of each stage at the
splits SIS uses, the decode step against SMs (where it flattens) and the encoder layer against
SMs (its exponent); `spaceserve profile` writes them into a curves file for `spaceserve sim
--curves`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from spaceserve.runtime.modes import ADMISSIONS
from spaceserve.runtime.policy.analytic.model import PRESETS, analytic_curves, qwen2_vl_7b_config
from spaceserve.runtime.policy.curves import Curve, CurveSet
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.sweep.rates import capacity_rate, run_sweep
from spaceserve.runtime.sim.sweep.tune import BEST

CONTENTION = (0.0, 0.08, 0.20, 0.35)
DECODER_SMS = (44, 66, 99)  # SMs at which decode reaches the HBM bandwidth
ENCODER_ALPHA = (1.0, 0.85, 0.7)  # encoder throughput ~ SMs ** alpha
RATE_FACTORS = (0.8, 1.0, 1.2)
BUDGETS = (512, 1024, 2048)  # the prefill budgets best-temporal tries
QUICK = dict(contention=(0.0, 0.20), decoder_sms=(66,), alpha=(1.0, 0.7), factors=(0.9, 1.2),
             budgets=(512, 2048))
SLO_A = "ttft:2000,tpot:50"


def _scale(values: Any, factor: float) -> Any:
    return [_scale(v, factor) for v in values] if isinstance(values, list) else values * factor


def curves_for(contention: float, decoder_sms: int, alpha: float) -> CurveSet:
    """H200 analytic curves of Qwen2-VL-7B with the three facts set: a flat co-run slowdown,
    decode saturating HBM at `decoder_sms` SMs, the encoder scaling as SMs ** `alpha`."""
    base = PRESETS["H200"]
    preset = dataclasses.replace(base, per_sm_bw=base.hbm_bw / decoder_sms,
                                 contention=contention)
    curves = analytic_curves(qwen2_vl_7b_config(), preset, name="Qwen2-VL-7B")
    if alpha == 1.0:
        return curves
    enc, total = curves.encoder_curve, curves.num_sms
    values = [_scale(row, (n / total) ** (1.0 - alpha)) for n, row in zip(enc.sms, enc.isolated,
                                                                         strict=True)]
    return dataclasses.replace(curves, encoder_curve=Curve(enc.axes, enc.grid, enc.sms, values))


def cell(curves: CurveSet, base: SimConfig, workload: Any, factors: tuple[float, ...],
         seeds: list[int], budgets: tuple[int, ...] = BUDGETS) -> dict[str, Any]:
    """Each mode's goodput at saturation (best over the rates) in one cell."""
    cap = capacity_rate(curves, workload)
    rates = [round(f * cap, 3) for f in factors]
    modes: dict[str, SimConfig] = {}
    modes["share"] = dataclasses.replace(base, sis_actions="share")
    modes["superset"] = dataclasses.replace(base, sis_actions="superset")
    out: dict[str, Any] = {"capacity_rate": cap, "rates": rates}
    for name, cfg in modes.items():
        rows = run_sweep(curves, ["spatial"], rates, workload, cfg, slo=cfg.slo, seeds=seeds,
                         drain_s=10.0)["spatial"]
        out[name] = max(r["goodput"]["rate_per_s"] for r in rows)
    rows = run_sweep(curves, [BEST], rates, workload, base, slo=base.slo, seeds=seeds,
                     drain_s=10.0, tune_budgets=budgets)[BEST]
    best = max(rows, key=lambda r: r["goodput"]["rate_per_s"])
    out[BEST], out["best_knobs"] = best["goodput"]["rate_per_s"], best["knobs"]
    for name in ("share", "superset"):
        if name in out:
            out[f"{name}_x"] = out[name] / out[BEST] if out[BEST] else float("nan")
    return out


def heatmap(cells: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Goodput ratios per (decoder SMs, alpha) row and contention column, one panel per
    spatial variant; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = sorted({(c["decoder_sms"], c["alpha"]) for c in cells}, key=lambda r: (r[0], -r[1]))
    cols = sorted({c["contention"] for c in cells})
    panels = [k for k in ("share_x", "superset_x") if any(k in c for c in cells)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 1.2 + 0.6 * len(rows)),
                             squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        grid = [[next(c[key] for c in cells if (c["decoder_sms"], c["alpha"]) == r
                      and c["contention"] == x) for x in cols] for r in rows]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.7, vmax=1.3, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(cols)), [f"{100 * x:g}%" for x in cols])
        ax.set_yticks(range(len(rows)), [f"dec {n} SMs, enc a={a:g}" for n, a in rows])
        ax.set_xlabel("co-run contention")
        name = "pure sharing" if key == "share_x" else "superset"
        ax.set_title(f"{name} / best-temporal goodput at saturation")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/sensitivity"))
    p.add_argument("--quick", action="store_true",
                   help="2 contentions x 1 decoder saturation x 2 encoder exponents, 2 rates")
    p.add_argument("--duration", type=float, help="seconds of arrivals (default 15, quick 8)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds pooled per point")
    p.add_argument("--slo", default=SLO_A, help="goodput SLO (default SLO A)")
    p.add_argument("--admission", default="queue", choices=ADMISSIONS,
                   help="both sides' admission: queue (admit everything, the default) or slo "
                        "(refuse or end the requests predicted to miss the TTFT bound)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        slo = Slo.parse(args.slo)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"bad argument: {exc}") from None
    duration = args.duration or (8.0 if args.quick else 15.0)
    if not duration > 0 or not seeds:
        raise SystemExit("--duration must be positive and --seeds name at least one seed")
    grid = QUICK if args.quick else dict(contention=CONTENTION, decoder_sms=DECODER_SMS,
                                         alpha=ENCODER_ALPHA, factors=RATE_FACTORS,
                                         budgets=BUDGETS)
    from spaceserve.runtime.sim.workload import Workload

    workload = Workload(0.0, duration, seed=seeds[0])
    base = SimConfig(mode="spatial", slo=slo, admission=args.admission)
    cells = []
    for n in grid["decoder_sms"]:
        for a in grid["alpha"]:
            for x in grid["contention"]:
                got = cell(curves_for(x, n, a), base, workload, grid["factors"], seeds,
                           grid["budgets"])
                cells.append({"contention": x, "decoder_sms": n, "alpha": a, **got})
                ratio = " ".join(f"{k} {got[k]:.3f}x" for k in ("share_x", "superset_x")
                                 if k in got)
                print(f"decoder {n:>3} SMs  encoder a={a:<4g} contention {100 * x:>4g}%  "
                      f"best-temporal {got[BEST]:6.2f}/s  {ratio}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"slo": slo.to_dict(), "admission": args.admission, "duration_s": duration,
            "seeds": seeds, "grid": grid,
            "model": "Qwen2-VL-7B", "device": "H200 (modelled)"}
    (args.out / "sensitivity.json").write_text(json.dumps({"meta": meta, "cells": cells},
                                                          indent=1))
    print(f"results: {args.out / 'sensitivity.json'}")
    if not args.no_plot:
        fig = heatmap(cells, args.out / "sensitivity.png",
                      f"Qwen2-VL-7B, H200 analytic curves (modelled), SLO {args.slo}, "
                      f"admission {args.admission}")
        if fig is not None:
            print(f"heat map: {fig}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
