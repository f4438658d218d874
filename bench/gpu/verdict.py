"""The "verdict" section: spatial against the strongest time-multiplexing under the measured curves.

The autotune section profiles Qwen2-VL-7B on this GPU (encoder pass, prefill chunk and decode
step against SMs, alone and co-running) and writes the curves file ``autotune/curves.json``: the
measured SM scaling of each stage and a contention table from the co-running points. This
section copies it to ``measured_curves.json`` at the top of the results folder, reads off the
hardware facts the simulator's sensitivity study says decide whether sharing pays
(docs/results/sim-sensitivity.md: the co-running slowdown, the SMs decode needs for most of its
speed, how close to linear the encoder scales), and runs the simulator on those curves, small
and fast: at 0.9x the encode + prefill capacity, `spatial` (SIS, the default actions) against
`best-temporal` (tuned over all its candidates, `sim.sweep.tune`), under SLO A
``ttft:2000,tpot:50`` and SLO B ``ttft:2000,itl:21``. Rows: one of facts, one per SLO with the
goodput ratio; the summary's headline states it. Without a complete profile (the autotune
section ran out of time) it says so and states nothing. Modelled on measured curves: a
prediction, not a serving measurement (the serving section measures the engine).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

SECTION = "verdict"
SLOS = {"A": "ttft:2000,tpot:50", "B": "ttft:2000,itl:21"}
LOAD = 0.9  # of the encode + prefill capacity on whole GPUs
DURATION_S = 4.0  # seconds of arrivals per run: about 7 CPU-s for both SLOs


def hardware_facts(curves: Any, batch: int = 32, context: float = 1152.0) -> dict[str, float]:
    """The facts that decide the question, read off `curves`: the co-running slowdown of each
    side at an even split, the fewest SMs (in 8s) whose decode step is within 10% of the whole
    GPU's, and the encoder's SM-scaling exponent between half and all SMs (1: linear)."""
    import math

    n = curves.num_sms
    half = n // 2
    full = curves.decode(batch, context, n)
    need = next((s for s in range(8, n + 1, 8) if curves.decode(batch, context, s) <= 1.1 * full),
                n)
    t_half, t_full = curves.encoder(4096, 1, half), curves.encoder(4096, 1, n)
    return {"num_sms": n, "decode_sms_for_90pct": need,
            "encoder_scaling_exponent": round(math.log(t_half / t_full) / math.log(n / half), 3),
            "slowdown_encoder": round(curves.slowdown("encoder", half, n - half), 4),
            "slowdown_decoder": round(curves.slowdown("decoder", half, n - half), 4)}


def verdict(curves: Any, duration_s: float = DURATION_S) -> list[dict[str, Any]]:
    """One row per SLO: spatial's and best-temporal's goodput at 0.9x capacity, their ratio and
    the knobs best-temporal chose."""
    from spaceserve.runtime.policy.slo import Slo
    from spaceserve.runtime.sim import SimConfig, Workload
    from spaceserve.runtime.sim.sweep.rates import capacity_rate, run_sweep

    base = Workload(1.0, duration_s)
    rate = round(LOAD * capacity_rate(curves, base), 2)
    rows = []
    for name, text in SLOS.items():
        slo = Slo.parse(text)
        t0 = time.perf_counter()
        res = run_sweep(curves, ("spatial", "best-temporal"), [rate], base, SimConfig(slo=slo),
                        slo=slo, seeds=[0], drain_s=duration_s)
        spatial, best = (res[m][0]["goodput"]["rate_per_s"] for m in ("spatial", "best-temporal"))
        ratio = spatial / best if best > 0 else float("inf")
        rows.append({"section": SECTION, "slo": name, "slo_text": text, "rate": rate,
                     "spatial_goodput": spatial, "best_temporal_goodput": best,
                     "ratio": ratio, "best_temporal_knobs": res["best-temporal"][0]["knobs"],
                     "seconds": time.perf_counter() - t0,
                     "figures": {f"spatial_over_best_temporal_{name}": round(ratio, 4)},
                     "headline": f"SLO {name} ({text}) at {rate:g} img/s on the "
                     f"{curves.source} curves: spatial {spatial:.2f} vs best-temporal "
                     f"{best:.2f} img/s within SLO ({ratio:.3f}x; modelled)"})
    return rows


def judge(curves_path: Path, results_dir: Path, duration_s: float = DURATION_S
          ) -> list[dict[str, Any]]:
    """Copy the curves file up, state its facts and the verdict; write ``verdict.json``."""
    from bench.common import write_json
    from spaceserve.runtime.policy.curves import CurveSet

    curves = CurveSet.load(curves_path)
    shutil.copyfile(curves_path, results_dir / "measured_curves.json")
    facts = hardware_facts(curves)
    rows = [{"section": SECTION, "curves": str(curves_path), "source": curves.source,
             "contention_source": curves.contention.source if curves.contention else None,
             **facts, "figures": facts,
             "headline": f"{curves.source} curves: decode within 10% of the whole GPU from "
             f"{facts['decode_sms_for_90pct']} SMs, encoder scaling exponent "
             f"{facts['encoder_scaling_exponent']:g}, co-running slowdown "
             f"{100 * facts['slowdown_encoder']:.1f}% / {100 * facts['slowdown_decoder']:.1f}% "
             "(encoder / decoder, even split)"}]
    rows += verdict(curves, duration_s)
    out = results_dir / SECTION
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "verdict.json", rows)
    return rows


def run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The GPU harness entry point: the autotune section's measured curves, if complete."""
    results_dir = Path(results_dir)
    measured = results_dir / "autotune" / "curves.json"
    if not measured.is_file():
        return [{"section": SECTION, "skipped": "no measured curves",
                 "headline": "no verdict: the autotune profile did not complete, so no measured "
                 "curves file (autotune/curves.json) exists; rerun with --only autotune verdict "
                 "--budget autotune=120 to resume it"}]
    return judge(measured, results_dir)


def dry_run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The same control flow on CPU: the analytic H200 curves stand in for measured ones (the
    dry run profiles nothing), a short simulation."""
    from spaceserve.runtime.policy.analytic.model import analytic_curves

    results_dir = Path(results_dir)
    stand_in = results_dir / SECTION / "dry_curves.json"
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    analytic_curves(device="H200").save(stand_in)
    return judge(stand_in, results_dir, duration_s=1.5)
