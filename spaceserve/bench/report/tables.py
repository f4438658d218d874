"""What `spaceserve bench serve` prints and writes: the header naming where it ran, the table,
the CPU caveat, sample outputs, results.json and the figures."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from spaceserve.bench.metrics import result_latency
from spaceserve.bench.report.plots import plot_timeline, plot_vs_rate
from spaceserve.plotting import PLUMBING
from spaceserve.runtime.policy.slo import Slo

CPU_NOTE = (
    "note: this ran on a CPU. It proves correctness and plumbing - every mode serves every\n"
    "request through the real scheduler, with the same tokens - not performance: a CPU runs\n"
    "one kernel at a time and has no SMs to partition, so the co-located modes (spatial,\n"
    "spatial-static, shared) cannot overlap the encoder with the decoder here and only pay for\n"
    "trying; their latencies against temporal say nothing about a GPU. What a GPU would do is\n"
    "modelled below.")


def is_cpu(label: str | None) -> bool:
    return bool(label) and label.upper().startswith("CPU")


def on_gpu(label: str | None) -> bool:
    """Whether `label` names a CUDA device: ``"NVIDIA H200 (132 SMs)"`` (`device_label`), or
    ``"cuda"`` / ``"cuda:1"`` as a torch device string."""
    return bool(label) and (re.search(r"\(\d+ SMs\)\s*$", label) is not None or
                            label.lower().startswith("cuda"))


def figure_caveat(device: str | None) -> str:
    """What a figure of a run on `device` must say about its numbers: nothing on a GPU; off
    one (a CPU, or a device nobody named), that it proves plumbing, not performance."""
    if on_gpu(device):
        return ""
    where = "ran on a CPU" if is_cpu(device) else \
        f"ran on {device or 'a device nobody named'}, not shown to be a GPU"
    return f"{where}: {PLUMBING}"


def title(backend: str, model: str, device: str | None, modes: list[str]) -> str:
    """One line naming what ran where, for the header and every figure."""
    how = "in-process" if backend == "inprocess" else "over HTTP"
    return f"{model} on {device or 'an unknown device'}, {how}, modes {', '.join(modes)}"


def _fmt(x: Any, width: int = 8, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return f"{x:{width}.{digits}f}"


HEADER = (f"{'mode':<28}{'rate':>6}{'done':>6}{'fail':>5}{'req/s':>7}{'tok/s':>8}"
          f"{'TTFT':>8}{'p99':>8}{'TPOT':>8}{'p99':>8}{'ITLp99':>8}{'E2EL':>8}{'good':>7}"
          f"{'att%':>6} |{'probe TTFT':>11}{'TPOT':>7}")


def _cells(label: str, rate: float, failed: Any, m: dict[str, Any], p: dict[str, Any],
           g: dict[str, Any] | None) -> str:
    g = g or {}
    att = 100 * g["attainment"] if g.get("counted") else None
    return (f"{label:<28}{rate:>6g}{m['completed']:>6}{failed:>5}"
            f"{_fmt(m['request_throughput'], 7, 2)}{_fmt(m['output_throughput'], 8)}"
            f"{_fmt(m['mean_ttft_ms'])}{_fmt(m['p99_ttft_ms'])}{_fmt(m['mean_tpot_ms'])}"
            f"{_fmt(m['p99_tpot_ms'])}{_fmt(m['p99_itl_ms'])}{_fmt(m['mean_e2el_ms'])}"
            f"{_fmt(g.get('rate_per_s'), 7, 2)}{_fmt(att, 6, 0)} |"
            f"{_fmt(p['mean_ttft_ms'], 11)}{_fmt(p['mean_tpot_ms'], 7)}")


def table_row(run: dict[str, Any]) -> str:
    m = run["metrics"]
    return _cells(run["label"], run["rate"], m["failed"], m["load"], m["probe"],
                  m.get("goodput"))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def sim_row(run: dict[str, Any]) -> str:
    """The simulator's prediction of a run in the table's columns, then its errors."""
    sim = run.get("sim") or {}
    if "load" not in sim:
        return f"{'  sim':<28}failed: {sim.get('error', 'no prediction')}"
    err = sim["errors"]["load"]
    return (_cells("  sim", run["rate"], "", sim["load"], sim["probe"], None) +
            f"  err TPOT {_pct(err.get('tpot'))} ITLp99 {_pct(err.get('p99_itl'))} "
            f"TTFT {_pct(err.get('ttft'))}")


def show(run: dict[str, Any], n: int) -> None:
    """A few of a run's outputs."""
    for r in [r for r in run["results"] if r.ok][:n]:
        what = f"{r.kind} {r.resolution}".strip()
        print(f"  [{run['label']} #{r.idx} {what}, {r.prompt_tokens} prompt tokens] "
              f"{r.text[:70]!r}")


def modelled_table(pred: dict[str, Any]) -> str:
    """The simulator's goodput per mode and rate for the target GPU (`modelled.predict`)."""
    if "error" in pred:
        return f"modelled prediction failed: {pred['error']}"
    lines = [f"MODELLED (not measured): {pred['model']} on {pred['device']} "
             f"({pred['curves']} curves, {pred['contention']}), the same requests, SLO "
             f"{pred['slo']} ms:",
             f"  {'mode':<18}{'rate':>6}{'TTFT':>9}{'TPOT':>8}{'ITLp99':>8}{'good':>7}"
             f"{'att%':>6}"]
    for row in pred["rows"]:
        g, m = row["goodput"], row["load"]
        att = 100 * g["attainment"] if g["counted"] else None
        lines.append(f"  {row['mode']:<18}{row['rate']:>6g}{_fmt(m['mean_ttft_ms'], 9)}"
                     f"{_fmt(m['mean_tpot_ms'])}{_fmt(m['p99_itl_ms'])}"
                     f"{_fmt(g['rate_per_s'], 7, 2)}{_fmt(att, 6, 0)}")
    return "\n".join(lines)


def _request_rows(run: dict[str, Any], slo: Slo | None) -> list[dict[str, Any]]:
    t0 = run["t0"]
    rows = []
    for r in run["results"]:
        row = {"idx": r.idx, "kind": r.kind, "resolution": r.resolution, "send": r.send - t0,
               "prompt_tokens": r.prompt_tokens, "image_tokens": r.image_tokens,
               "output_tokens": r.output_tokens, "error": r.error}
        if r.ok:
            row["ttft"] = r.first_token - r.send
            row["e2el"] = r.finish - r.send
            row["tpot"] = (r.finish - r.first_token) / (r.output_tokens - 1) \
                if r.output_tokens > 1 else None
        if slo is not None:
            row["slo_met"] = slo.meets(result_latency(r))
        rows.append(row)
    return rows


def results_doc(config: dict[str, Any], runs: list[dict[str, Any]],
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a benchmark: its settings, every run and every request."""
    slo = config.get("slo")
    slo = Slo.of(slo) if isinstance(slo, (str, Slo)) else None
    return {"config": {k: (str(v) if isinstance(v, (Path, Slo)) else v)
                       for k, v in config.items()},
            "runs": [{k: v for k, v in r.items() if k not in ("results", "t0")}
                     | {"requests": _request_rows(r, slo)} for r in runs]} | (extra or {})


def write_outputs(runs: list[dict[str, Any]], out: Path, config: dict[str, Any], *,
                  plots: bool = True, prefix: str = "", title: str = "",
                  device: str | None = None, extra: dict[str, Any] | None = None
                  ) -> list[Path]:
    """results.json and (matplotlib present) the two figures under `out`; paths written.
    `title` names the device, model and modes on every figure (default: the model and device
    of `config`); `device` (default: `extra`'s or `config`'s) decides the figures' caveat and
    whether their SM counts are nominal; `extra` joins the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}results.json"
    path.write_text(json.dumps(results_doc(config, runs, extra), indent=1, default=str))
    written = [path]
    if plots:
        device = device or (extra or {}).get("device") or config.get("device")
        title = title or f"{config.get('model') or 'model not recorded'} on " \
                         f"{device or 'an unknown device'}"
        caveat = figure_caveat(device)
        figs = (plot_vs_rate(runs, out / f"{prefix}latency_vs_rate.png", title, caveat),
                plot_timeline(runs, out / f"{prefix}sm_split_timeline.png", title, caveat,
                              nominal_sms=not on_gpu(device)))
        if None in figs:
            print("note: matplotlib is not installed (or nothing to plot); no plots")
        written += [f for f in figs if f is not None]
    return written
