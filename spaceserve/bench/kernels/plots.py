"""`spaceserve bench plot-kernels FILE...`: resource-utility curves from kernel-suite JSON.

Reads pytest-benchmark JSON written by the kernel suite (`spaceserve bench kernels --json`,
`pytest bench/kernel_suite --benchmark-json`) and draws, for every (kernel, case, dtype), the
latency and the bandwidth against the SM budget: one line per attention backend, and per file
when several are given, so two machines or two commits compare in one figure. With several
files it also prints each point's median per file and its ratio to the first file.

Every figure names the devices and models its files were measured on (`extra_info`'s `device`
and `model`); where a file ran on a CPU (the Triton interpreter: a smoke test of the plumbing)
it says that the figure proves plumbing, not performance, and that the SM budgets are nominal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from spaceserve.plotting import NOMINAL_SMS, PLUMBING, caption, pyplot


@dataclass(frozen=True)
class Point:
    """One benchmark of the suite: a (kernel, case, dtype, backend) at one budget, in one run."""

    run: str
    kernel: str
    case: str
    dtype: str
    backend: str
    budget: int
    median_s: float
    gbs: float
    tflops: float
    device: str = ""  # "cpu" or the CUDA device's name; "" in files that do not record it
    model: str = ""

    @property
    def group(self) -> tuple[str, str, str]:
        return self.kernel, self.case, self.dtype


def load_points(path: str | Path, run: str) -> list[Point]:
    """The suite's benchmarks in a pytest-benchmark JSON file (other entries are ignored)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read pytest-benchmark JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path}: not pytest-benchmark JSON (no 'benchmarks' list)")
    points = []
    for b in data["benchmarks"]:
        info = b.get("extra_info") or {}
        median = (b.get("stats") or {}).get("median")
        if "kernel" not in info or "budget" not in info or not median:
            continue
        gbs = info.get("gbs")
        if gbs is None and info.get("bytes") is not None:
            gbs = info["bytes"] / median / 1e9
        tflops = info.get("tflops")
        if tflops is None and info.get("flops") is not None:
            tflops = info["flops"] / median / 1e12
        points.append(Point(run, str(info["kernel"]), str(info.get("case", "")),
                            str(info.get("dtype", "")), str(info.get("backend", "")),
                            int(info["budget"]), float(median),
                            float(gbs) if gbs is not None else math.nan,
                            float(tflops) if tflops is not None else math.nan,
                            str(info.get("device") or ""), str(info.get("model") or "")))
    return points


def provenance(points: list[Point]) -> tuple[str, str, bool]:
    """(the devices and models of `points` as one line, the caveat off a GPU, whether the SM
    budgets are nominal: some point ran on a CPU). A point whose file does not record its
    device counts as not shown to be a GPU."""
    devices = list(dict.fromkeys(p.device or "device not recorded" for p in points))
    models = list(dict.fromkeys(p.model for p in points if p.model)) or ["model not recorded"]
    cpu = any(p.device == "cpu" for p in points)
    off_gpu = cpu or any(not p.device for p in points)
    line = f"on {', '.join(devices)}; models {', '.join(models)}"
    caveat = f"{'CPU run (Triton interpreter)' if cpu else 'device not recorded'}: {PLUMBING}" \
        if off_gpu else ""
    if cpu:
        caveat += f"; {NOMINAL_SMS}"
    return line, caveat, cpu


def run_labels(paths: list[str], labels: list[str] | None = None) -> list[str]:
    """A label per file: `labels` when given, else the file names (with their folder when two
    files share a name)."""
    if labels:
        if len(labels) != len(paths):
            raise ValueError(f"--labels has {len(labels)} entries for {len(paths)} files")
        return list(labels)
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{Path(p).parent.name}/{Path(p).stem}" for p in paths]


def plot_curves(points: list[Point], out: str | Path, title: str | None = None) -> Path:
    """One figure: a row per (kernel, case, dtype), latency and GB/s against SMs; a line per
    (run, backend). Raises RuntimeError without matplotlib."""
    plt = pyplot()
    if plt is None:
        raise RuntimeError("matplotlib is not installed (pip install 'spaceserve[plot]')")
    groups = sorted({p.group for p in points})
    runs = list(dict.fromkeys(p.run for p in points))
    # one colour per (run, backend) across the whole figure; line style and marker per run
    pairs = list(dict.fromkeys((p.run, p.backend) for p in points))
    palette = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    styles = ["o-", "s--", "^:", "D-."]
    height = 2.6 * len(groups) + 1.0
    where, caveat, nominal = provenance(points)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, height), squeeze=False)
    for row, group in zip(axes, groups, strict=True):
        mine = [p for p in points if p.group == group]
        for run, backend in dict.fromkeys((p.run, p.backend) for p in mine):
            pts = sorted((p for p in mine if (p.run, p.backend) == (run, backend)),
                         key=lambda p: p.budget)
            label = f"{run} · {backend}" if len(runs) > 1 else backend
            style = styles[runs.index(run) % len(styles)]
            color = palette[pairs.index((run, backend)) % len(palette)]
            xs = [p.budget for p in pts]
            row[0].plot(xs, [p.median_s * 1e3 for p in pts], style, color=color, label=label)
            row[1].plot(xs, [p.gbs for p in pts], style, color=color, label=label)
        row[0].set_title(" · ".join(group), fontsize=9, loc="left")
        row[0].set_ylabel("latency (ms)")
        row[1].set_ylabel("GB/s")
        for ax in row:
            ax.set_xlabel("SM budget (nominal)" if nominal else "SM budget")
            ax.grid(alpha=0.3)
        lat = [p.median_s for p in mine]
        if min(lat) > 0 and max(lat) / min(lat) > 20:
            row[0].set_yscale("log")
        row[1].legend(fontsize=7, loc="best")
    head = title or "kernel resource-utility curves: " + ", ".join(runs)
    fig.tight_layout(rect=caption(fig, f"{head}\n{where}", caveat, fontsize=10))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def comparison(points: list[Point]) -> list[str]:
    """Median per run of every point present in more than one run, and the ratio of each
    later run to the first (>1: slower)."""
    runs = list(dict.fromkeys(p.run for p in points))
    by_key: dict[tuple, dict[str, Point]] = {}
    for p in points:
        by_key.setdefault((*p.group, p.backend, p.budget), {})[p.run] = p
    head = ["kernel / case / dtype / backend / SMs"] + [f"{r} ms" for r in runs] + \
        [f"{r}/{runs[0]}" for r in runs[1:]]
    lines = ["  ".join(head)]
    for key in sorted(by_key):
        have = by_key[key]
        if len(have) < 2:
            continue
        ms = [have[r].median_s * 1e3 if r in have else math.nan for r in runs]
        ratios = [m / ms[0] if ms[0] == ms[0] and ms[0] > 0 else math.nan for m in ms[1:]]
        lines.append("  ".join([" / ".join(map(str, key))] + [f"{m:.4g}" for m in ms] +
                               [f"{x:.3f}" for x in ratios]))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spaceserve bench plot-kernels",
        description="Latency and GB/s against SMs per kernel, from kernel-suite JSON files "
                    "(one line per backend, and per file when several are given).")
    p.add_argument("files", nargs="+", metavar="FILE", help="pytest-benchmark JSON files")
    p.add_argument("--out", default="kernel_curves.png", help="figure path (default %(default)s)")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="a label per file")
    p.add_argument("-k", dest="select", metavar="TEXT",
                   help="only groups whose 'kernel case dtype backend' contains TEXT")
    p.add_argument("--title", help="figure title")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        labels = run_labels(args.files, args.labels)
        points = [p for f, lab in zip(args.files, labels, strict=True)
                  for p in load_points(f, lab)]
    except ValueError as exc:
        print(f"spaceserve bench plot-kernels: {exc}", file=sys.stderr)
        return 2
    if args.select:
        points = [p for p in points
                  if args.select in f"{p.kernel} {p.case} {p.dtype} {p.backend}"]
    if not points:
        print(f"spaceserve bench plot-kernels: no kernel-suite benchmarks in {args.files}"
              + (f" matching {args.select!r}" if args.select else ""), file=sys.stderr)
        return 2
    try:
        out = plot_curves(points, args.out, args.title)
    except RuntimeError as exc:
        print(f"spaceserve bench plot-kernels: {exc}", file=sys.stderr)
        return 2
    groups = len({p.group for p in points})
    print(f"{out}: {groups} kernel groups, {len(points)} points from {len(args.files)} file(s)")
    if len(set(labels)) > 1:
        print("\n".join(comparison(points)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
