"""Qwen2-VL-72B at TP 8 in the simulator: goodput per mode, and the vision encoder data-parallel
(every rank encodes whole images) against sharded like the decoder (vLLM's "weights").

    python -m bench.sim.tp [--rates R,...] [--seeds 0,1,2] [--modes temporal,spatial,...] [--slo S]

Analytic H200 curves of one rank of the TP group (`policy/analytic_tp.py`: the decoder's share
of each layer plus its all-reduces over the HGX H200 NVLink preset), the default image mix
(448x448 to 1920x1080), a background batch of 32 decoding requests, the same arrivals per seed
for every configuration. Goodput: image requests per second of the arrival window meeting
``--slo`` (default: the project's, ``ttft:2000,tpot:50``; `policy/slo.py`; a request unfinished
``--drain`` seconds after arrivals stop misses), pooled over the seeds; TTFT over image requests
and TPOT over every decoding request (the background batch included), pooled over the seeds.
Also prints one image's ViT time per resolution in each encoder mode.
Each run is what ``spaceserve sim --model qwen2-vl-72b --tp 8 --mm-encoder-tp-mode M --modes
MODE --rates RATE --seed S`` runs. Writes results.json and table.md under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from spaceserve.runtime.policy.analytic.tp import tensor_parallel_curves
from spaceserve.runtime.policy.slo import DEFAULT_SLO_TEXT, Slo
from spaceserve.runtime.sim import SimConfig, Workload, simulate, summarize
from spaceserve.runtime.sim.sweep.rates import capacity_rate, pooled_goodput
from spaceserve.runtime.sim.workload import RESOLUTIONS

ENCODER_MODES = ("data", "weights")


def vit_rows(curves: dict[str, Any], tp: int) -> list[dict[str, Any]]:
    """One image's ViT pass on a whole rank per resolution and encoder mode, and the group's
    encoder throughput (data-parallel: `tp` images at once)."""
    rows = []
    for res, tokens in RESOLUTIONS.items():
        row: dict[str, Any] = {"resolution": res, "tokens": tokens}
        for mode, c in curves.items():
            s = c.encoder(4 * tokens, c.encoder_depth, c.num_sms)
            row[f"{mode}_ms"] = 1e3 * s
            row[f"{mode}_img_s"] = int(c.model.get("encoder_ranks", 1)) / s
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    curves = {m: tensor_parallel_curves(device=args.device, tp=args.tp, mm_encoder_tp_mode=m)
              for m in ENCODER_MODES}
    base = Workload(0.0, args.duration, text_rate=0.0, output_tokens=args.output_tokens)
    cap = {m: capacity_rate(c, base) for m, c in curves.items()}
    rates = [float(r) for r in args.rates.split(",")] if args.rates else \
        [round(cap["data"] * f, 1) for f in (0.25, 0.5, 0.75, 1.0)]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for enc, c in curves.items():
        for mode in args.modes.split(","):
            cfg = SimConfig(mode=mode, background=args.batch)
            for rate in rates:
                t0 = time.perf_counter()
                runs = [simulate(c, cfg, dataclasses.replace(base, image_rate=rate, seed=seed),
                                 drain_s=args.drain) for seed in seeds]
                s = summarize([r for res in runs for r in res.requests])
                good = pooled_goodput(runs, args.slo)
                rows.append({"encoder": enc, "mode": mode, "rate": rate,
                             "goodput": good["rate_per_s"], "attainment": good["attainment"],
                             "requests": s["served"],
                             "ttft_mean_ms": s["ttft"]["mean_ms"],
                             "ttft_p99_ms": s["ttft"]["p99_ms"],
                             "tpot_mean_ms": s["tpot"]["mean_ms"],
                             "tpot_p99_ms": s["tpot"]["p99_ms"],
                             "seconds": time.perf_counter() - t0})
                print(f"{enc} {mode} {rate:g}: {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
    return {"model": "Qwen2-VL-72B", "tp": args.tp, "device": args.device, "seeds": seeds,
            "duration_s": args.duration, "batch": args.batch, "capacity_rate": cap,
            "slo_ms": args.slo.to_dict(), "drain_s": args.drain,
            "link": curves["data"].model["link"],
            "vit": vit_rows(curves, args.tp), "rows": rows}


def tables(result: dict[str, Any]) -> str:
    by = {(r["encoder"], r["mode"], r["rate"]): r for r in result["rows"]}
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    rates = list(dict.fromkeys(r["rate"] for r in result["rows"]))
    out = ["| images/s | mode | goodput (img/s) | attained | TTFT mean (ms) | TTFT p99 (ms) | "
           "TPOT mean (ms) | TPOT p99 (ms) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for rate in rates:
        for mode in modes:
            r = by[("data", mode, rate)]
            out.append(f"| {rate:g} | {mode} | {r['goodput']:.2f} | "
                       f"{100 * r['attainment']:.0f}% | {r['ttft_mean_ms']:.0f} | "
                       f"{r['ttft_p99_ms']:.0f} | {r['tpot_mean_ms']:.2f} | "
                       f"{r['tpot_p99_ms']:.2f} |")
    out += ["", "| images/s | mode | goodput data / weights | TTFT mean data / weights (ms) | "
            "TTFT p99 data / weights (ms) |", "|---:|---|---:|---:|---:|"]
    for rate in rates:
        for mode in modes:
            d, w = by[("data", mode, rate)], by[("weights", mode, rate)]
            out.append(f"| {rate:g} | {mode} | {d['goodput']:.2f} / {w['goodput']:.2f} | "
                       f"{d['ttft_mean_ms']:.0f} / {w['ttft_mean_ms']:.0f} | "
                       f"{d['ttft_p99_ms']:.0f} / {w['ttft_p99_ms']:.0f} |")
    out += ["", "| image | tokens | ViT, one rank (data) ms | ViT sharded (weights) ms | "
            "group img/s data / weights |", "|---|---:|---:|---:|---:|"]
    for v in result["vit"]:
        out.append(f"| {v['resolution']} | {v['tokens']} | {v['data_ms']:.1f} | "
                   f"{v['weights_ms']:.1f} | {v['data_img_s']:.1f} / {v['weights_img_s']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--device", default="H200")
    p.add_argument("--modes", default="temporal,temporal-chunked,spatial-static,spatial")
    p.add_argument("--rates", help="image requests/s, comma-separated (default: 25/50/75/100%% "
                                   "of the data-parallel encode+prefill capacity)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--batch", type=int, default=32, help="background decode batch")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--slo", type=Slo.parse, default=Slo.parse(DEFAULT_SLO_TEXT),
                   help=f"goodput SLO in ms (default {DEFAULT_SLO_TEXT})")
    p.add_argument("--drain", type=float, default=10.0,
                   help="seconds a run goes on after arrivals stop (spaceserve sim's default)")
    p.add_argument("--out", type=Path, default=Path("runs/sim-tp"))
    args = p.parse_args(argv)
    result = run(args)
    text = tables(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    cap = result["capacity_rate"]
    print(f"Qwen2-VL-72B, TP {args.tp}, {args.device} analytic curves (one rank), "
          f"{result['link']['name']}, seeds {args.seeds}; encode+prefill capacity "
          f"{cap['data']:.1f} images/s (data) / {cap['weights']:.1f} (weights); SLO {args.slo} "
          f"(ms), drain {args.drain:g} s")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
