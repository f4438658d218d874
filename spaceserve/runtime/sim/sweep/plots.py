"""Figures of `spaceserve sim`: latency and goodput against the image request rate per mode.

Every figure is the simulator's answer, so each carries the MODELLED caveat beside its title
(the modelled model and device), whatever curves it was given (`spaceserve.plotting.caption`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spaceserve.plotting import MODELLED, caption, pyplot
from spaceserve.runtime.sim.cluster import SimResult


def _pyplot() -> Any:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: skipping the figure (pip install matplotlib)")
    return plt


def plot(sweep: dict[str, list[dict[str, Any]]], head: dict[str, Any],
         runs: dict[str, SimResult], path: Path, title: str = "") -> Path | None:
    """TPOT, p99 ITL and TTFT against image rate per mode, and SIS's split over time."""
    plt = _pyplot()
    if plt is None:
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
        ax.set_ylabel(f"encoder SMs (of {g.total}, modelled)")
        ax.set_ylim(0, g.total)
        ax.set_title(f"spatial (SIS) at {head['rate']:.2f} images/s, GPU 0")
        ax.legend(loc="upper right")
    else:
        ax.set_axis_off()
    fig.tight_layout(rect=caption(fig, "Decode latency against image request rate" +
                                  (f"\n{title}" if title else ""), MODELLED, fontsize=10))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_goodput(sweep: dict[str, list[dict[str, Any]]], path: Path, title: str = ""
                 ) -> Path | None:
    """Goodput (image requests/s within the SLO) and SLO attainment against image rate."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_rate, ax_att) = plt.subplots(1, 2, figsize=(12, 4.5))
    slo = ""
    for mode, rows in sweep.items():
        rates = [r["rate"] for r in rows]
        g = [r["goodput"] for r in rows]
        slo = ",".join(f"{k}:{v:g}" for k, v in g[0]["slo"].items()) if g else slo
        ax_rate.plot(rates, [x["rate_per_s"] for x in g], marker="o", label=mode)
        seen = [(r, 100 * x["attainment"]) for r, x in zip(rates, g, strict=True) if x["counted"]]
        ax_att.plot([p[0] for p in seen], [p[1] for p in seen], marker="o", label=mode)
    top = max((r["rate"] for rows in sweep.values() for r in rows), default=1.0)
    ax_rate.plot([0, top], [0, top], color="grey", ls=":", lw=1, label="offered")
    ax_rate.set_ylabel("goodput (image requests / s within SLO)")
    ax_att.set_ylabel("SLO attainment (%)")
    ax_att.set_ylim(0, 105)
    for ax in (ax_rate, ax_att):
        ax.set_xlabel("image requests / s")
        ax.grid(alpha=0.3)
    ax_rate.legend()
    fig.tight_layout(rect=caption(fig, f"Goodput under SLO {slo} (ms)" +
                                  (f"\n{title}" if title else ""), MODELLED, fontsize=10))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
