"""PNG of a `CurveSet`: latency against SM count for each stage and workload point."""

from __future__ import annotations

from pathlib import Path

from spaceserve.plotting import pyplot
from spaceserve.runtime.policy.curves import CurveSet

TITLES = {"encoder": "encoder (per layer)", "prefill": "prefill chunk", "decode": "decode step"}


def _series(curve, corun: bool, scale: list[float] | None = None) -> dict[str, list[float]]:
    """{"axis=value, ...": latencies over curve.sms} from the raw (not enveloped) grid; the
    co-running grid (version-1 curves) or the isolated one times `scale` per SM count."""
    raw = curve.corun if corun and curve.corun is not None else curve.isolated
    scale = scale or [1.0] * len(curve.sms)
    names = list(curve.axes)
    out: dict[str, list[float]] = {}

    def walk(values, prefix: list[str], depth: int, k: float) -> None:
        if depth == len(names):
            out.setdefault(", ".join(prefix), []).append(values * k)
            return
        for v, sub in zip(curve.grid[names[depth]], values, strict=True):
            walk(sub, [*prefix, f"{names[depth]}={v:g}"], depth + 1, k)

    for row, k in zip(raw, scale, strict=True):  # one row per SM count, in order
        walk(row, [], 0, k)
    return out


def _corun_scale(curves: CurveSet, stage: str, sms: list[float]) -> list[float] | None:
    """1 + the contention table's slowdown beside the other stage on the rest of the device."""
    if curves.contention is None:
        return None
    side = "encoder" if stage == "encoder" else "decoder"
    out = []
    for n in sms:
        other = max(1.0, curves.num_sms - n)
        pair = (n, other) if side == "encoder" else (other, n)
        out.append(1.0 + curves.slowdown(side, *pair))
    return out


def plot_curves(curves: CurveSet, path: str | Path) -> Path | None:
    """Three panels (encoder, prefill, decode); isolated solid, co-running dashed; returns the
    path, or None when matplotlib is missing. The PNG is a function of the curves alone."""
    plt = pyplot()
    if plt is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    stages = {"encoder": curves.encoder_curve, "prefill": curves.prefill_curve,
              "decode": curves.decode_curve}
    for ax, (stage, curve) in zip(axes, stages.items(), strict=True):
        iso = _series(curve, False)
        cor = _series(curve, True, _corun_scale(curves, stage, curve.sms))
        cmap = plt.get_cmap("viridis", max(2, len(iso)))
        for i, label in enumerate(iso):
            color = cmap(i)
            ax.plot(curve.sms, [t * 1e3 for t in iso[label]], "-o", color=color, ms=3,
                    label=label)
            ax.plot(curve.sms, [t * 1e3 for t in cor[label]], "--", color=color, lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("SMs")
        ax.set_ylabel("ms")
        ax.set_title(TITLES[stage])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2 if len(iso) > 8 else 1)
    how = "contention table" if curves.contention is not None else "co-running grids"
    fig.suptitle(f"{curves.model.get('name', 'model')} on {curves.device} ({curves.dtype}, "
                 f"{curves.source}); dashed: co-running beside the other stage on the rest of "
                 f"the device ({how})")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path
