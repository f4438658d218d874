"""Image-rate sweeps across execution modes, the headline comparison and the figures.

Every sweep point runs each seed and pools them: latency statistics over the pooled requests,
throughputs as the seeds' mean, and goodput (`runtime.policy.slo`) over the image requests
of every seed's arrival window: ``rate_per_s`` = met / (window x seeds), ``attainment`` = met /
arrived.

The headline: find the image rate at which time-multiplexed (temporal) TPOT reaches
``factor`` x its unloaded value, rerun every mode at exactly that rate and report each mode's
TPOT and p99 ITL relative to unloaded (plus TTFT, which a TPOT-first split pays for).

``best-temporal`` (tune.py) is the strongest time-multiplexed configuration found at each rate;
every row's goodput carries the tail beside it: ``image_ttft_p99_ms`` and ``image_ttft_mean_ms``,
the TTFT of the image requests served, ``unfinished_share`` and ``shed_share`` (the arrivals
SLO-aware admission refused or ended, ``--admission slo``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import DEFAULT_SLO, Slo
from spaceserve.runtime.sim.cluster import SimResult, simulate
from spaceserve.runtime.sim.engine import MODES, SimConfig
from spaceserve.runtime.sim.metrics import request_record, summarize
from spaceserve.runtime.sim.sweep.tune import BEST, TUNE_BUDGETS, best_rows
from spaceserve.runtime.sim.workload import Workload

THROUGHPUTS = ("duration_s", "request_throughput", "output_throughput",
               "served_output_throughput")


def capacity_rate(curves: CurveSet, workload: Workload, num_gpus: int = 1,
                  sms: int | None = None, corun: bool = False) -> float:
    """Image requests/s that keep encoder + prefill busy on `sms` SMs (default: the GPU); a
    data-parallel encoder (``encoder_ranks`` in the curves' model) encodes that many at once."""
    mix = workload.image_mix
    total = sum(mix.values())
    n = sms or curves.num_sms
    per_image = 0.0
    ranks = int(curves.model.get("encoder_ranks", 1))
    for res, weight in mix.items():
        tokens = workload.tokens(res)
        t = curves.encoder(4 * tokens, curves.encoder_depth, n, corun) / ranks
        t += curves.prefill(tokens + workload.text_tokens, 0, n, corun)
        per_image += weight / total * t
    return num_gpus / per_image


def default_rates(capacity: float, points: int = 9, top: float = 0.85) -> list[float]:
    """`points` image rates from 0 to `top` x capacity."""
    return [round(capacity * top * i / (points - 1), 4) for i in range(points)]


def _pooled(results: Sequence[SimResult], kinds: tuple[str, ...] | None) -> dict[str, Any]:
    s = summarize([r for res in results for r in res.requests], kinds)
    if len(results) > 1:  # a rate per run, not per pooled span
        per = [summarize(res.requests, kinds) for res in results]
        for key in THROUGHPUTS:
            s[key] = sum(p[key] for p in per) / len(per)
    return s


def pooled_goodput(results: Sequence[SimResult], slo: Slo) -> dict[str, Any]:
    """Goodput over every run's arrival window (module docstring), with each run's rate."""
    per = [res.goodput(slo) for res in results]
    met, counted = sum(g.met for g in per), sum(g.counted for g in per)
    window = sum(g.window_s for g in per)
    return {"slo": slo.to_dict(), "rate_per_s": met / window,
            "attainment": met / counted if counted else 1.0, "met": met, "counted": counted,
            "window_s": per[0].window_s, "runs": len(per),
            "per_seed_rate_per_s": [g.rate_per_s for g in per]}


def _row(rate: float, results: Sequence[SimResult], slo: Slo) -> dict[str, Any]:
    image = _pooled(results, ("image",))
    good = pooled_goodput(results, slo)
    # the tail beside goodput: p99 TTFT of the image requests served, and the share of the
    # arrivals left unfinished when the run ended, and the share SLO-aware admission shed
    # (refused or ended waiting; misses for goodput)
    counted = good["counted"]
    good["image_ttft_p99_ms"] = image["ttft"]["p99_ms"]
    good["image_ttft_mean_ms"] = image["ttft"]["mean_ms"]
    good["unfinished_share"] = image["unfinished"] / counted if counted else 0.0
    good["shed_share"] = image["shed"] / counted if counted else 0.0
    row = {"rate": rate, "seeds": [res.workload.seed for res in results],
           "all": _pooled(results, None), "image": image,
           "background": _pooled(results, ("background",)), "goodput": good}
    actions = sis_actions(results)
    if actions:
        row["sis_actions"] = actions
    return row


def sis_actions(results: Sequence[SimResult]) -> dict[str, int]:
    """How often SIS took each action over `results`' GPUs and seeds (`action_counts`: splits,
    whole-GPU windows, prefill placements); empty where no GPU ran SIS."""
    total: dict[str, int] = {}
    for res in results:
        for gpu in res.gpus:
            if gpu.sis is not None:
                for name, n in gpu.sis.action_counts().items():
                    total[name] = total.get(name, 0) + n
    return dict(sorted(total.items()))


def run_sweep(curves: CurveSet, modes: Sequence[str], rates: Sequence[float],
              workload: Workload, base: SimConfig, *, num_gpus: int = 1,
              router: str = "round_robin", slo: Slo = DEFAULT_SLO,
              seeds: Sequence[int] | None = None, drain_s: float | None = None,
              tune_budgets: Sequence[int] = TUNE_BUDGETS) -> dict[str, list[dict[str, Any]]]:
    """Simulate every (mode, rate, seed); returns one pooled row per mode and rate. `seeds`
    default to the workload's; `drain_s` bounds each run after its arrivals stop;
    `tune_budgets` are the prefill budgets ``best-temporal`` tries."""
    seeds = list(seeds) if seeds else [workload.seed]

    def point(cfg: SimConfig, rate: float) -> dict[str, Any]:
        runs = [simulate(curves, cfg, dataclasses.replace(workload, image_rate=rate, seed=seed),
                         num_gpus=num_gpus, router=router, drain_s=drain_s) for seed in seeds]
        return _row(rate, runs, slo)

    out: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        if mode == BEST:
            out[mode] = best_rows(curves, base, rates, point, tune_budgets)
            continue
        cfg = dataclasses.replace(base, mode=mode)
        out[mode] = [point(cfg, rate) for rate in rates]
    return out


def crossing(rates: Sequence[float], values: Sequence[float], level: float) -> float | None:
    """First rate where `values` reaches `level`, linearly interpolated; None if never."""
    for i in range(1, len(rates)):
        lo, hi = values[i - 1], values[i]
        if lo < level <= hi:
            return rates[i - 1] + (rates[i] - rates[i - 1]) * (level - lo) / (hi - lo)
    return None


def headline(curves: CurveSet, sweep: dict[str, list[dict[str, Any]]], workload: Workload,
             base: SimConfig, *, factor: float = 3.0, num_gpus: int = 1,
             router: str = "round_robin", drain_s: float | None = None
             ) -> tuple[dict[str, Any], dict[str, SimResult]]:
    """Each mode at the rate where temporal TPOT is `factor` x unloaded."""
    if "temporal" not in sweep or sweep["temporal"][0]["rate"] != 0:
        return {"note": "needs a temporal sweep starting at rate 0"}, {}
    rows = sweep["temporal"]
    unloaded_tpot = rows[0]["all"]["tpot"]["mean_ms"]
    unloaded_itl = rows[0]["all"]["itl"]["p99_ms"]
    rate = crossing([r["rate"] for r in rows], [r["all"]["tpot"]["mean_ms"] for r in rows],
                    factor * unloaded_tpot)
    info: dict[str, Any] = {"factor": factor, "unloaded_tpot_ms": unloaded_tpot,
                            "unloaded_p99_itl_ms": unloaded_itl, "rate": rate, "modes": {}}
    if rate is None:
        info["note"] = f"temporal TPOT never reached {factor}x unloaded in the sweep"
        return info, {}
    runs = {}
    for mode in sweep:
        if mode == BEST:  # tuned per rate: its knobs are in the sweep's rows
            continue
        res = simulate(curves, dataclasses.replace(base, mode=mode),
                       dataclasses.replace(workload, image_rate=rate), num_gpus=num_gpus,
                       router=router, drain_s=drain_s)
        s = res.summary()["all"]
        runs[mode] = res
        info["modes"][mode] = {
            "tpot_ms": s["tpot"]["mean_ms"], "tpot_x": s["tpot"]["mean_ms"] / unloaded_tpot,
            "p99_itl_ms": s["itl"]["p99_ms"], "p99_itl_x": s["itl"]["p99_ms"] / unloaded_itl,
            "ttft_mean_ms": s["ttft"]["mean_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"]}
    return info, runs


def table(sweep: dict[str, list[dict[str, Any]]]) -> str:
    """A plain-text table of the sweep: latencies over every request (TTFT over the image
    and text requests), goodput over the image requests."""
    lines = [f"{'mode':<17}{'rate/s':>7}{'TPOT ms':>9}{'p99 ITL':>9}{'TTFT ms':>10}"
             f"{'p99 TTFT':>10}{'img p99':>10}{'served':>7}{'unfin':>6}{'shed':>6}{'good/s':>8}"
             f"{'attain':>8}  knobs"]
    for mode, rows in sweep.items():
        for r in rows:
            a, g = r["all"], r["goodput"]
            k = r.get("knobs")
            knobs = "" if k is None else (
                f"  {k['mode']} budget {k['max_num_batched_tokens']} {k['encoder_policy']}"
                + ("" if k["window_ms"] is None else f" window {k['window_ms']:g} ms")
                + ("" if k.get("async_scheduling", True) else " unpipelined"))
            lines.append(f"{mode:<17}{r['rate']:>7.2f}{a['tpot']['mean_ms']:>9.2f}"
                         f"{a['itl']['p99_ms']:>9.2f}{a['ttft']['mean_ms']:>10.1f}"
                         f"{a['ttft']['p99_ms']:>10.1f}{r['image']['ttft']['p99_ms']:>10.1f}"
                         f"{a['served']:>7d}{r['image']['unfinished']:>6d}"
                         f"{r['image'].get('shed', 0):>6d}"
                         f"{g['rate_per_s']:>8.2f}{100 * g['attainment']:>7.1f}%{knobs}")
    return "\n".join(lines)


def write_outputs(out: Path, meta: dict[str, Any], sweep: dict[str, list[dict[str, Any]]],
                  head: dict[str, Any], runs: dict[str, SimResult], slo: Slo = DEFAULT_SLO
                  ) -> dict[str, Path]:
    """results.json (config, sweep, headline) and requests.json (headline runs, per request)."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps({"meta": meta, "sweep": sweep, "headline": head}, indent=1))
    reqs = out / "requests.json"
    reqs.write_text(json.dumps({mode: [request_record(r, slo) for r in res.requests]
                                for mode, res in runs.items()}))
    return {"results": results, "requests": reqs}


__all__ = ["BEST", "MODES", "capacity_rate", "crossing", "default_rates", "headline",
           "pooled_goodput", "run_sweep", "sis_actions", "table", "write_outputs"]
