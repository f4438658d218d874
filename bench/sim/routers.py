"""Request routers across many simulated GPUs: round_robin vs least_loaded vs media_aware.

    python -m bench.sim.routers [--gpus 16] [--mode spatial] [--rates R,...] [--seeds 0,1]

Every router sees the same arrivals (per seed) at each image rate: the default image mix
(448x448 to 1920x1080), a background decode batch per GPU, analytic H200 curves of Qwen2-VL-7B.
Default rates: 50%, 70% and 90% of the cluster's image capacity under SIS's split. Prints a
markdown table (TTFT mean / p99 over image requests, pooled over the seeds; TPOT over every
decoding request, the background batch included, as ``spaceserve sim`` reports it; goodput:
image requests per second meeting both SLOs) and writes it to ``--out``.
Each run is what ``spaceserve sim --gpus G --modes MODE --rates RATE --seed S --router R`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim import ROUTERS, SimConfig, Workload, simulate, summarize
from spaceserve.runtime.sim.engine import default_allowed
from spaceserve.runtime.sim.sweep.rates import capacity_rate


def sis_capacity(curves: Any, workload: Workload, cfg: SimConfig, gpus: int) -> float:
    """Image requests/s the cluster encodes + prefills on the encoder partition the TPOT-first
    SIS gives a busy encoder (the rate scale of this study, kept across SIS objectives)."""
    sis = SpaceInferenceScheduler(curves, default_allowed(curves.num_sms),
                                  tpot_factor=cfg.tpot_factor, objective="tpot")
    busy = SisState((PendingEncode(4 * 2691, curves.encoder_depth),), (), cfg.background,
                    cfg.background_context + cfg.background_output / 2)
    return capacity_rate(curves, workload, gpus, sis.propose(busy).encoder_sms, corun=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    curves = analytic_curves(device=args.device)
    slo = Slo(ttft=args.slo_ttft_ms, tpot=args.slo_tpot_ms)  # what SIS and TWSRFT aim at
    cfg = SimConfig(mode=args.mode, background=args.batch, slo=slo)
    base = Workload(0.0, args.duration, text_rate=0.0, output_tokens=args.output_tokens)
    cap = sis_capacity(curves, base, cfg, args.gpus)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else \
        [round(cap * f, 1) for f in (0.5, 0.7, 0.9)]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for rate in rates:
        for router in args.routers.split(","):
            t0 = time.perf_counter()
            everything = []
            for seed in seeds:
                w = dataclasses.replace(base, image_rate=rate, seed=seed)
                everything += simulate(curves, cfg, w, num_gpus=args.gpus,
                                       router=router).requests
            s = summarize(everything)  # TTFT over image requests, TPOT over every decode
            reqs = [r for r in everything if r.kind == "image"]
            ok = [r for r in reqs if r.first_token - r.arrival <= args.slo_ttft_ms / 1e3 and
                  (r.generated < 2 or (r.finish - r.first_token) / (r.generated - 1)
                   <= args.slo_tpot_ms / 1e3)]
            rows.append({"rate": rate, "router": router, "requests": len(reqs),
                         "ttft_mean_ms": s["ttft"]["mean_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"],
                         "tpot_mean_ms": s["tpot"]["mean_ms"], "tpot_p99_ms": s["tpot"]["p99_ms"],
                         "goodput": len(ok) / (args.duration * len(seeds)),
                         "seconds": time.perf_counter() - t0})
            print(f"rate {rate:g} {router}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {"gpus": args.gpus, "mode": args.mode, "device": args.device, "seeds": seeds,
            "duration_s": args.duration, "sis_capacity_rate": cap,
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| images/s | router | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | "
             "TPOT p99 (ms) | goodput (img/s) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['rate']:g} | {r['router']} | {r['ttft_mean_ms']:.0f} | "
                     f"{r['ttft_p99_ms']:.0f} | {r['tpot_mean_ms']:.2f} | {r['tpot_p99_ms']:.2f} | "
                     f"{r['goodput']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--mode", default="spatial")
    p.add_argument("--device", default="H200")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--rates", help="image requests/s, comma-separated (default: 50/70/90%% of "
                                   "SIS capacity)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--batch", type=int, default=32, help="background decode batch per GPU")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=Path("runs/sim-routers"))
    args = p.parse_args(argv)
    result = run(args)
    text = table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    print(f"{args.gpus} GPUs, {args.mode} mode, {args.device} analytic curves, seeds "
          f"{args.seeds}, SIS capacity {result['sis_capacity_rate']:.1f} images/s; SLO TTFT <= "
          f"{args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
