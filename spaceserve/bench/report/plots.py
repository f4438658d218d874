"""Figures of the serving benchmark: latency against rate per mode, and the SM split timeline.

Both carry the run's title (model, device, modes) and, off a GPU, the caveat that the run
proves plumbing, not performance (`spaceserve.plotting.caption`); off a GPU the SM counts of
the timeline are the engine's nominal ones and are labelled so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spaceserve.plotting import NOMINAL_SMS, caption, pyplot

PANELS = (("mean_tpot_ms", "TPOT mean (ms)"), ("p99_itl_ms", "ITL p99 (ms)"),
          ("mean_ttft_ms", "TTFT mean (ms)"))


def vs_rate_figure(runs: list[dict[str, Any]], title: str = "", caveat: str = "") -> Any:
    """Mean TPOT, p99 ITL and mean TTFT of the load (solid) and probes (dashed) per mode, and
    the simulator's prediction for the load (dotted) where the runs carry one; `title` names
    the device, model and modes, `caveat` what the numbers are not. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["rate"])
        rates = [r["rate"] for r in mine]
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            line = ax.plot(rates, [r["metrics"]["load"][key] for r in mine], "o-",
                           label=label)[0]
            probes = [r["metrics"]["probe"][key] for r in mine]
            if any(p == p for p in probes):  # not all nan
                ax.plot(rates, probes, "s--", color=line.get_color(), alpha=0.7,
                        label=f"{label} probes")
            sim = [(r.get("sim") or {}).get("load", {}).get(key, float("nan")) for r in mine]
            if any(p == p for p in sim):
                ax.plot(rates, sim, "x:", color=line.get_color(), alpha=0.8,
                        label=f"{label} simulated")
    for ax, (_, panel) in zip(axes, PANELS, strict=True):
        ax.set_title(panel)
        ax.set_xlabel("request rate (req/s)")
    axes[0].legend(fontsize=8)
    fig.tight_layout(rect=caption(fig, title, caveat))
    return fig


def timeline_figure(runs: list[dict[str, Any]], title: str = "", caveat: str = "",
                    nominal_sms: bool = False) -> Any:
    """Encoder and decoder SMs over time, one row per run. Both stages stay visible where
    their lines coincide (temporal: both own the whole device): the encoder is a wide pale
    band, the decoder a thin dashed line drawn over it. `nominal_sms`: the counts are a
    stand-in (off a GPU), said on every axis and in the caveat. None without matplotlib or
    runs."""
    plt = pyplot()
    if plt is None or not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 * len(runs) + 1.2), sharex=True,
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        tl = run.get("timeline") or []
        t = [s["t"] for s in tl]
        ax.step(t, [s["encoder_sms"] for s in tl], where="post", lw=5, alpha=0.35,
                color="tab:orange", label="encoder SMs", zorder=1)
        ax.step(t, [s["decoder_sms"] for s in tl], where="post", lw=1.2, ls="--",
                color="tab:blue", label="decoder SMs", zorder=2)
        top = max([v for s in tl for v in (s["encoder_sms"], s["decoder_sms"]) if v == v] + [1])
        ax.set_ylim(0, 1.15 * top)
        ax.set_ylabel("nominal SMs" if nominal_sms else "SMs")
        ax.set_title(f"{run['label']} @ {run['rate']:g} req/s", fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("time since run start (s)")
    if nominal_sms:
        caveat = "; ".join(filter(None, (caveat, NOMINAL_SMS)))
    fig.tight_layout(rect=caption(fig, title, caveat))
    return fig


def _save(fig: Any, path: Path, dpi: int) -> Path | None:
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_vs_rate(runs: list[dict[str, Any]], path: Path, title: str = "", caveat: str = ""
                 ) -> Path | None:
    """`vs_rate_figure` saved to `path`; None without matplotlib."""
    return _save(vs_rate_figure(runs, title, caveat), path, 120)


def plot_timeline(runs: list[dict[str, Any]], path: Path, title: str = "", caveat: str = "",
                  nominal_sms: bool = False) -> Path | None:
    """`timeline_figure` saved to `path`; None without matplotlib or runs."""
    return _save(timeline_figure(runs, title, caveat, nominal_sms), path, 110)
