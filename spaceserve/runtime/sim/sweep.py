"""Image-rate sweeps across execution modes, the headline comparison and the figure.

The headline: find the image rate at which time-multiplexed (temporal) TPOT reaches
``factor`` x its unloaded value, rerun every mode at exactly that rate and report each mode's
TPOT and p99 ITL relative to unloaded (plus TTFT, which a TPOT-first split pays for).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..curves import CurveSet
from .cluster import SimResult, simulate
from .engine import MODES, SimConfig
from .metrics import DEFAULT_SLOS_MS, goodput, request_record
from .workload import RESOLUTIONS, Workload


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
        tokens = RESOLUTIONS[res]
        t = curves.encoder(4 * tokens, curves.encoder_depth, n, corun) / ranks
        t += curves.prefill(tokens + workload.text_tokens, 0, n, corun)
        per_image += weight / total * t
    return num_gpus / per_image


def default_rates(capacity: float, points: int = 9, top: float = 0.85) -> list[float]:
    """`points` image rates from 0 to `top` x capacity."""
    return [round(capacity * top * i / (points - 1), 4) for i in range(points)]


def _row(rate: float, res: SimResult, slos: dict[str, float] | None = None) -> dict[str, Any]:
    s = res.summary()
    slos = DEFAULT_SLOS_MS if slos is None else slos
    return {"rate": rate, "all": s["all"], "image": s["image"], "background": s["background"],
            "slos_ms": dict(slos),
            "goodput": goodput(res.requests, slos, res.workload.duration_s)}


def run_sweep(curves: CurveSet, modes: Sequence[str], rates: Sequence[float],
              workload: Workload, base: SimConfig, *, num_gpus: int = 1,
              router: str = "round_robin", slos: dict[str, float] | None = None
              ) -> dict[str, list[dict[str, Any]]]:
    """Simulate every (mode, rate) pair; returns rows of summaries per mode (with goodput
    under `slos`, default `DEFAULT_SLOS_MS`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        cfg = dataclasses.replace(base, mode=mode)
        out[mode] = [_row(rate, simulate(curves, cfg, dataclasses.replace(workload,
                                                                          image_rate=rate),
                                         num_gpus=num_gpus, router=router), slos)
                     for rate in rates]
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
             router: str = "round_robin") -> tuple[dict[str, Any], dict[str, SimResult]]:
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
        res = simulate(curves, dataclasses.replace(base, mode=mode),
                       dataclasses.replace(workload, image_rate=rate), num_gpus=num_gpus,
                       router=router)
        s = res.summary()["all"]
        runs[mode] = res
        info["modes"][mode] = {
            "tpot_ms": s["tpot"]["mean_ms"], "tpot_x": s["tpot"]["mean_ms"] / unloaded_tpot,
            "p99_itl_ms": s["itl"]["p99_ms"], "p99_itl_x": s["itl"]["p99_ms"] / unloaded_itl,
            "ttft_mean_ms": s["ttft"]["mean_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"]}
    return info, runs


def table(sweep: dict[str, list[dict[str, Any]]]) -> str:
    """A plain-text table of the sweep."""
    lines = [f"{'mode':<15}{'rate/s':>8}{'TPOT ms':>9}{'p99 ITL':>9}{'TTFT ms':>10}"
             f"{'p99 TTFT':>10}{'served':>8}{'goodput':>9}"]
    for mode, rows in sweep.items():
        for r in rows:
            a = r["all"]
            lines.append(f"{mode:<15}{r['rate']:>8.2f}{a['tpot']['mean_ms']:>9.2f}"
                         f"{a['itl']['p99_ms']:>9.2f}{a['ttft']['mean_ms']:>10.1f}"
                         f"{a['ttft']['p99_ms']:>10.1f}{a['served']:>8d}"
                         f"{r.get('goodput', float('nan')):>9.2f}")
    return "\n".join(lines)


def plot(sweep: dict[str, list[dict[str, Any]]], head: dict[str, Any],
         runs: dict[str, SimResult], path: Path) -> Path | None:
    """TPOT, p99 ITL and TTFT against image rate per mode, and SIS's split over time."""
    from spaceserve.plotting import pyplot

    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: skipping the figure (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = [("tpot", "mean_ms", "mean TPOT (ms)"), ("itl", "p99_ms", "p99 ITL (ms)"),
              ("ttft", "mean_ms", "mean TTFT (ms)")]
    for ax, (metric, stat, label) in zip(axes.flat, panels, strict=False):
        for mode, rows in sweep.items():
            pts = [(r["rate"], r["all"][metric][stat]) for r in rows
                   if r["all"][metric][stat] == r["all"][metric][stat]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        if head.get("rate") is not None:
            ax.axvline(head["rate"], color="grey", ls=":", lw=1)
        ax.set_xlabel("image requests / s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0, 0].axhline(head.get("unloaded_tpot_ms", 0), color="k", ls="--", lw=0.8)
    axes[0, 0].legend()
    axes[1, 0].set_yscale("log")
    ax = axes[1, 1]
    res = runs.get("spatial")
    if res is not None:
        g = res.gpus[0]
        tl = g.timeline
        ax.fill_between([t for t, _, _ in tl], [e for _, e, _ in tl], step="post", alpha=0.5,
                        lw=0, label="encoder SMs in use")
        if g.splits:
            end = tl[-1][0]
            ax.step([t for t, _ in g.splits] + [end], [e for _, e in g.splits] +
                    [g.splits[-1][1]], where="post", color="k", lw=0.8,
                    label="SIS encoder split")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"encoder SMs (of {g.total})")
        ax.set_ylim(0, g.total)
        ax.set_title(f"spatial (SIS) at {head['rate']:.2f} images/s, GPU 0")
        ax.legend(loc="upper right")
    else:
        ax.set_axis_off()
    fig.suptitle("Decode latency against image request rate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(out: Path, meta: dict[str, Any], sweep: dict[str, list[dict[str, Any]]],
                  head: dict[str, Any], runs: dict[str, SimResult]) -> dict[str, Path]:
    """results.json (config, sweep, headline) and requests.json (headline runs, per request)."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps({"meta": meta, "sweep": sweep, "headline": head}, indent=1))
    reqs = out / "requests.json"
    reqs.write_text(json.dumps({mode: [request_record(r) for r in res.requests]
                                for mode, res in runs.items()}))
    return {"results": results, "requests": reqs}


__all__ = ["MODES", "capacity_rate", "crossing", "default_rates", "headline", "plot",
           "run_sweep", "table", "write_outputs"]
