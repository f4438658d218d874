"""`spaceserve sim` / `python -m spaceserve.runtime.sim`: sweep image rates, write the figure.

Default: analytic (modelled) curves of Qwen2-VL-7B on an H200 preset, a background batch of 32
decoding requests, modes temporal, temporal-chunked and spatial (SIS maximising goodput; add
best-temporal for the strongest time-multiplexed configuration tuned per rate), image
rates 0, 2, ..., 20 per second, 30 s of Poisson arrivals, seeds 0 and 1 pooled. Every point
reports goodput under --slo (default ttft:2000,tpot:50): image requests per second of the
arrival window that met it, and the fraction that did; a request still unfinished --drain
seconds after arrivals stop counts as a miss. Writes curves, results.json,
requests.json, tpot_vs_rate.png and goodput_vs_rate.png under --out. ``--model`` picks the shapes
of any preset (``qwen3-vl-8b``: Qwen3-VL, its images counted in 32-px tokens).
``--model qwen2-vl-72b --tp 8`` simulates one rank of a tensor-parallel group (per-rank
curves with the collectives' costs over the preset's NVLink figures; the vision encoder
data-parallel or, with ``--mm-encoder-tp-mode weights``, sharded).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from spaceserve.cli_args import HelpFormatter
from spaceserve.models.presets import PRESETS as MODELS
from spaceserve.runtime.engine.args import add_engine_args
from spaceserve.runtime.policy.analytic.model import PRESETS, analytic_curves
from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cluster import ROUTERS
from spaceserve.runtime.sim.config import HOST_S, SIS_HOST_S
from spaceserve.runtime.sim.engine import MODES, PLACEMENTS, SimConfig, sim_policy
from spaceserve.runtime.sim.multiturn import cli as multiturn_cli
from spaceserve.runtime.sim.sweep.plots import plot, plot_goodput
from spaceserve.runtime.sim.sweep.rates import (
    BEST,
    capacity_rate,
    default_rates,
    headline,
    run_sweep,
    table,
    write_outputs,
)
from spaceserve.runtime.sim.workload import (
    DEFAULT_MIX,
    PATCHES_PER_TOKEN,
    Workload,
    resolution_tokens,
)

DEFAULT_MODES = ("temporal", "temporal-chunked", "spatial")
DEFAULT_RATES = "0,2,4,6,8,10,12,14,16,18,20"
DEFAULT_SEEDS = (0, 1)


def _mix(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mix: bad entry {part!r} (want RES=WEIGHT)"
                                             ) from None
    return out


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: want integers like 0,1") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds: no seed given")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spaceserve sim", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--device", default="H200", choices=sorted(PRESETS),
                   help="device preset for analytic curves")
    p.add_argument("--curves", type=Path,
                   help="a curves JSON file (measured) instead (default: analytic curves)")
    p.add_argument("--model", default="qwen2-vl-7b", choices=sorted(MODELS),
                   help="model shapes of the analytic curves (spaceserve.models.presets)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: curves of one rank of the group (analytic)")
    p.add_argument("--mm-encoder-tp-mode", default="data", choices=("data", "weights"),
                   help="with --tp > 1: the vision encoder data-parallel (each rank encodes "
                        "whole images) or sharded like the decoder (vLLM's names)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated modes out of {', '.join(MODES)}, or {BEST} (the "
                        "time-multiplexed configuration with the best goodput at each rate, "
                        "over prefill budget, encoder window and order; each row names it)")
    p.add_argument("--rates", default=DEFAULT_RATES,
                   help="comma-separated image rates/s, or 'auto' (--points from 0 to 85%% of "
                        "the encode+prefill capacity)")
    p.add_argument("--points", type=int, default=9, help="auto rates: how many")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--seed", type=int,
                   help="one workload seed, same as --seeds N (default: --seeds' default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--mix", type=_mix, default=dict(DEFAULT_MIX),
                   help="image mix, e.g. 448x448=0.25,1920x1080=0.75 (default: "
                        + ",".join(f"{k}={v:g}" for k, v in DEFAULT_MIX.items()) + ")")
    p.add_argument("--text-rate", type=float, default=0.0, help="text-only requests/s")
    p.add_argument("--text-tokens", type=int, default=64,
                   help="text prompt tokens of every request")
    p.add_argument("--output-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--batch", type=int, default=32, help="background decode batch per GPU")
    p.add_argument("--context", type=int, default=1024, help="background requests' context")
    p.add_argument("--static-encoder-sms", type=int, default=64,
                   help="encoder SMs of the spatial-static split")
    p.add_argument("--tpot-factor", type=float, default=1.15,
                   help="--sis-objective tpot: the decode step it protects, x the decode step "
                        "on the whole device")
    p.add_argument("--prefill-on", default="auto", choices=PLACEMENTS,
                   help="partition prefill runs on (auto: SIS decides in spatial mode; the "
                        "time-multiplexed modes prefill inside their steps: compute is refused)")
    p.add_argument("--encoder-policy", choices=("twsrft", "fifo"),
                   help="encoder order: default fifo whole passes for temporal (its only "
                        "order, as the engine's), twsrft elsewhere")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="time-multiplexed modes: token budget of one engine step (decodes "
                        "plus prefill chunks of several requests)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="time-multiplexed modes: sequences in one engine step")
    p.add_argument("--kv-blocks", type=int, default=65536,
                   help="time-multiplexed modes: KV blocks of 16 tokens (preemption by "
                        "recompute when they run out)")
    p.add_argument("--max-held", type=int, default=64,
                   help="time-multiplexed modes: requests holding or computing embeddings")
    p.add_argument("--host-ms", type=float, default=1e3 * HOST_S,
                   help="host time of one engine step (scheduling, planning, sampling), "
                        "hidden behind the previous step where the engine pipelines its steps "
                        "(--async-scheduling), added to every other decode step of the "
                        "co-located modes")
    p.add_argument("--sis-host-ms", type=float, default=1e3 * SIS_HOST_S,
                   help="spatial: host time of SIS's decisions, charged with the step's")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's asynchronous scheduling: the time-multiplexed modes' "
                        "steps, and the co-located decode steps while SIS takes turns, are "
                        "planned while the step before computes (what a step frees reaches the "
                        "step after next; read back at once while the encoder has work left); "
                        "--no-async-scheduling runs every step to completion")
    p.add_argument("--shared-decode-share", type=float, default=0.5,
                   help="shared mode: decode's share of SM throughput when both stages run")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (one engine each)")
    p.add_argument("--router", default="round_robin", choices=ROUTERS,
                   help="request router across GPUs")
    p.add_argument("--factor", type=float, default=3.0,
                   help="headline: the rate where temporal TPOT is this x unloaded")
    p.add_argument("--contention", type=float,
                   help="co-running slowdown of both stages, e.g. 0.2 = 20%% slower, replacing "
                        "the curves' contention table (default: the curves' own)")
    # the knobs the engine shares, declared beside its config: --sis-objective, --sis-actions,
    # --slo (the window's default differs: derived from the SLO here)
    add_engine_args(p, ("sis_objective", "sis_actions", "slo", "admission"))
    p.add_argument("--encoder-window-ms", type=float,
                   help="encoder time window: temporal-chunked's chunk between decode steps "
                        "(default: the largest whose step fits the SLO's TPOT / ITL bound "
                        "with the decode margin), TWSRFT's grant elsewhere (default 20 ms; "
                        "temporal runs whole jobs)")
    p.add_argument("--drain", type=float, default=10.0,
                   help="seconds a run goes on after arrivals stop; unfinished requests miss")
    p.add_argument("--seeds", type=_seeds,
                   help="comma-separated seeds pooled per point (default: 0,1)")
    p.add_argument("--out", type=Path, default=Path("runs/sim"), help="output directory")
    p.add_argument("--no-plot", action="store_true", help="skip the figures")
    multiturn_cli.add_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        args.slo = Slo.of(args.slo)
    except ValueError as exc:
        raise SystemExit(f"--slo {args.slo}: {exc}") from None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES and m != BEST]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {[*MODES, BEST]}")
    if args.tp < 1:
        raise SystemExit(f"--tp {args.tp}: must be >= 1")
    for name in ("encoder_window_ms", "drain"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be positive")
    if not (args.host_ms >= 0 and args.sis_host_ms >= 0):
        raise SystemExit("--host-ms, --sis-host-ms: must be >= 0")
    if args.workload == "multiturn":
        return multiturn_cli.main(args, modes)
    if args.curves is not None:
        try:
            curves = CurveSet.load(args.curves)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--curves {args.curves}: {exc}") from None
    else:
        preset = MODELS[args.model]
        if args.tp > 1:
            from spaceserve.runtime.policy.analytic.tp import tensor_parallel_curves

            try:
                curves = tensor_parallel_curves(preset, args.device, tp=args.tp,
                                                mm_encoder_tp_mode=args.mm_encoder_tp_mode)
            except ValueError as exc:
                raise SystemExit(f"--tp {args.tp}: {exc}") from None
        else:
            curves = analytic_curves(preset, args.device)
    if args.contention is not None:
        try:
            curves = curves.with_contention(Contention.flat(args.contention))
        except ValueError as exc:
            raise SystemExit(f"--contention: {exc}") from None
    if args.curves is None or args.contention is not None:
        curves.save(args.out / f"curves_{curves.device}.json")
    seeds = args.seeds or ([args.seed] if args.seed is not None else list(DEFAULT_SEEDS))
    vision = MODELS[args.model].vision  # image sizes -> tokens under --model's preprocessing
    workload = Workload(0.0, args.duration, burstiness=args.burstiness, image_mix=args.mix,
                        text_rate=args.text_rate, text_tokens=args.text_tokens,
                        output_tokens=args.output_tokens, seed=seeds[0],
                        tokens_per_image=resolution_tokens(vision.patch_size, vision.merge,
                                                           vision.min_pixels, vision.max_pixels))
    window = None if args.encoder_window_ms is None else args.encoder_window_ms / 1e3
    try:
        base = SimConfig(static_encoder_sms=args.static_encoder_sms,
                         tpot_factor=args.tpot_factor, sis_objective=args.sis_objective,
                         sis_actions=args.sis_actions,
                         slo=args.slo, prefill_on=args.prefill_on,
                         encoder_policy=args.encoder_policy, background=args.batch,
                         background_context=args.context,
                         shared_decode_share=args.shared_decode_share, window_s=window,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_num_seqs=args.max_num_seqs, kv_blocks=args.kv_blocks,
                         max_held=args.max_held, host_s=args.host_ms / 1e3,
                         sis_host_s=args.sis_host_ms / 1e3, admission=args.admission,
                         async_scheduling=args.async_scheduling)
        for mode in modes:  # a knob a mode refuses (prefill_on, encoder_policy) fails here
            if mode != BEST:
                dataclasses.replace(base, mode=mode)
    except ValueError as exc:
        raise SystemExit(f"bad settings: {exc}") from None
    cap = capacity_rate(curves, workload, args.gpus)
    policy = sim_policy(curves, base)
    sis = SpaceInferenceScheduler(curves, policy.splits, tpot_factor=args.tpot_factor,
                                  objective=policy.objective, slo=policy.slo,
                                  decode_margin=policy.decode_margin,
                                  comfort_factor=policy.comfort_factor)
    age = (args.slo.ttft or 0.0) / 1e3  # a request at its TTFT bound: SIS under pressure
    big = PATCHES_PER_TOKEN * workload.tokens("1920x1080")
    busy = SisState((PendingEncode(big, curves.encoder_depth, age_s=age),), (), args.batch,
                    args.context + base.background_output / 2)
    sis_sms = sis.propose(busy).encoder_sms
    sis_cap = capacity_rate(curves, workload, args.gpus, sis_sms, corun=True)
    if args.rates.strip() != "auto":
        try:
            rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
        except ValueError:
            raise SystemExit(f"--rates {args.rates!r}: want numbers like 0,2,4 or 'auto'"
                             ) from None
    else:
        rates = default_rates(cap, args.points)
    sweep = run_sweep(curves, modes, rates, workload, base, num_gpus=args.gpus,
                      router=args.router, slo=args.slo, seeds=seeds, drain_s=args.drain)
    head, runs = headline(curves, sweep, workload, base, factor=args.factor,
                          num_gpus=args.gpus, router=args.router, drain_s=args.drain)
    table_ = curves.contention
    contention = ("co-running grids (version-1 curves)" if table_ is None else
                  f"{table_.source} contention: {table_.note or 'per SM pair'}")
    meta = {"device": curves.device, "source": curves.source, "model": curves.model.get("name"),
            "tp": curves.model.get("tp", 1),
            "mm_encoder_tp_mode": curves.model.get("mm_encoder_tp_mode"),
            "capacity_rate": cap, "sis_encoder_sms": sis_sms, "sis_capacity_rate": sis_cap,
            "splits": list(policy.splits), "sis_objective": policy.objective,
            "sis_actions": base.sis_actions,
            "workload": dataclasses.asdict(workload),
            "config": dataclasses.asdict(base), "gpus": args.gpus, "router": args.router,
            "slo": args.slo.to_dict(), "seeds": seeds, "drain_s": args.drain,
            "contention": None if table_ is None else table_.to_dict()}
    paths = write_outputs(args.out, meta, sweep, head, runs, args.slo)
    title = (f"{curves.model.get('name')} on {curves.device} ({curves.source}), "
             f"{', '.join(modes)}; {contention}")
    figs = {}
    if not args.no_plot:
        figs = {"figure": plot(sweep, head, runs, args.out / "tpot_vs_rate.png", title),
                "goodput figure": plot_goodput(sweep, args.out / "goodput_vs_rate.png", title)}
    tp = curves.model.get("tp", 1)
    group = f", TP {tp} (one rank; encoder {curves.model.get('mm_encoder_tp_mode')})" \
        if tp > 1 else ""
    print(f"{curves.device} ({curves.source} curves), {curves.model.get('name')}{group}, "
          f"batch {args.batch}, {args.gpus} GPU(s); {contention}\nencode+prefill capacity: "
          f"{cap:.2f} images/s on whole GPUs, {sis_cap:.2f} images/s on SIS's {sis_sms}-SM "
          f"encoder partition (co-running, at this decode load)")
    print(f"goodput: image requests/s meeting SLO {args.slo} (ms) over {args.duration:g} s of "
          f"arrivals x {len(seeds)} seed(s) {seeds}; unfinished {args.drain:g} s after arrivals "
          f"stop = missed")
    print(table(sweep))
    if head.get("modes"):
        print(f"\nat {head['rate']:.2f} images/s temporal TPOT = {args.factor:g}x unloaded "
              f"({head['unloaded_tpot_ms']:.2f} ms TPOT, {head['unloaded_p99_itl_ms']:.2f} ms "
              f"p99 ITL unloaded):")
        for mode, m in head["modes"].items():
            print(f"  {mode:<17}TPOT {m['tpot_x']:5.2f}x  p99 ITL {m['p99_itl_x']:6.2f}x  "
                  f"TTFT mean {m['ttft_mean_ms']:8.1f} ms  p99 {m['ttft_p99_ms']:8.1f} ms")
    elif head.get("note"):
        print(f"\n{head['note']}")
    for name, path in {**paths, **{k: v for k, v in figs.items() if v}}.items():
        print(f"{name}: {path}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
