"""`spaceserve sim --workload multiturn`: multi-turn image chat with caching on and off.

Sweeps conversation rates for each mode; every point runs twice on the same conversations,
with SpaceServe's caches (encoder output cache, prefix caching) and without, and reports TTFT
(all turns and follow-up turns), TPOT and goodput under `--slo`, over the `--seeds` pooled.
Writes multiturn.json and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from spaceserve.models.presets import PRESETS as MODELS
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.multiturn.workload import MultiTurn, sweep_multiturn, table
from spaceserve.runtime.sim.sweep.rates import capacity_rate
from spaceserve.runtime.sim.workload import Workload, resolution_tokens


def add_args(p: argparse.ArgumentParser) -> None:
    """The multi-turn workload's options (the rest of `spaceserve sim`'s apply too: --rates
    are conversations/s, --duration the window conversations start in)."""
    g = p.add_argument_group("multi-turn workload (--workload multiturn)")
    g.add_argument("--workload", default="images", choices=("images", "multiturn"),
                   help="images: independent image requests; multiturn: image chats, caching "
                        "on and off")
    g.add_argument("--turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--think", type=float, default=5.0,
                   help="mean think time (s) between an answer and the next turn")
    g.add_argument("--image-reuse", type=float, default=0.75,
                   help="chance a follow-up turn brings no new image (asks about the earlier)")


def main(args: argparse.Namespace, modes: list[str]) -> int:
    t0 = time.perf_counter()
    if args.gpus != 1:
        raise SystemExit("--workload multiturn simulates one GPU (--gpus 1)")
    try:
        curves = CurveSet.load(args.curves) if args.curves is not None else \
            analytic_curves(MODELS[args.model], device=args.device)
        if args.contention is not None:
            curves = curves.with_contention(Contention.flat(args.contention))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"spaceserve sim: {exc}") from None
    vision = MODELS[args.model].vision  # image sizes -> tokens under --model's preprocessing
    per_image = resolution_tokens(vision.patch_size, vision.merge, vision.min_pixels,
                                  vision.max_pixels)
    mt = MultiTurn(0.0, args.duration, turns=args.turns, think_s=args.think,
                   image_reuse=args.image_reuse, image_mix=args.mix,
                   text_tokens=args.text_tokens, output_tokens=args.output_tokens,
                   burstiness=args.burstiness, tokens_per_image=per_image)
    base = SimConfig(static_encoder_sms=args.static_encoder_sms, tpot_factor=args.tpot_factor,
                     prefill_on=args.prefill_on, encoder_policy=args.encoder_policy,
                     background=args.batch, background_context=args.context,
                     shared_decode_share=args.shared_decode_share,
                     window_s=None if args.encoder_window_ms is None
                     else args.encoder_window_ms / 1e3,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs, kv_blocks=args.kv_blocks,
                     max_held=args.max_held, host_s=args.host_ms / 1e3,
                     sis_host_s=args.sis_host_ms / 1e3)
    cap = capacity_rate(curves, Workload(0.0, args.duration, image_mix=args.mix,
                                         text_tokens=args.text_tokens,
                                         tokens_per_image=per_image))
    if args.rates:
        rates = sorted(float(r) for r in args.rates.split(","))
    else:  # around the rate whose first turns alone keep encode + prefill busy
        rates = [round(cap / args.turns * f, 2) for f in (0.25, 0.5, 1.0, 1.5)]
    seeds = args.seeds or [args.seed]
    rows = sweep_multiturn(curves, modes, rates, mt, base, slo=args.slo, seeds=seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "multiturn.json"
    path.write_text(json.dumps({"device": curves.device, "source": curves.source,
                                "model": curves.model.get("name"), "seeds": seeds,
                                "slo": args.slo.to_dict(),
                                "workload": dataclasses.asdict(mt),
                                "config": dataclasses.asdict(base), "rows": rows}, indent=1))
    print(f"{curves.device} ({curves.source} curves), {curves.model.get('name')}, batch "
          f"{args.batch}; {args.turns} turns, think {args.think:g} s, image reuse "
          f"{args.image_reuse:g}; SLO {args.slo} (ms); seeds {seeds}")
    print(table(rows))
    print(f"results: {path}\n({time.perf_counter() - t0:.1f} s)")
    return 0
