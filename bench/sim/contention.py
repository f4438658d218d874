"""Which scheduling conclusions survive co-running contention: the simulator at 0, 8, 20, 35%.

Co-running slowdown is the least known number in the model (the analytic presets guess a flat
8%; `spaceserve profile` measures it on a GPU). This runs `spaceserve sim`'s sweep - H200
analytic curves of Qwen2-VL-7B, 32 background decodes, the default image mix, --duration s of
Poisson arrivals per seed - with the contention table replaced by a flat slowdown of each
level, and counts goodput (image requests/s within the SLO, `runtime.policy.slo`) under two
SLOs, each from runs scheduled for it: A ``ttft:2000,tpot:50`` (the default) and B
``ttft:2000,itl:21``. Modes: temporal (vLLM-like defaults), temporal-chunked, best-temporal
(the strongest time-multiplexed configuration, tuned per SLO, rate and level; `sim.sweep.tune`:
up to 36 candidates, so it costs up to 36x a temporal sweep) and spatial.
It prints a goodput table per level and which conclusions hold at which levels, and writes
both as JSON and markdown under --out.

    python -m bench.sim.contention --out runs/sim-contention
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spaceserve.runtime.policy.slo import Slo

SLOS = {"A": Slo.parse("ttft:2000,tpot:50"), "B": Slo.parse("ttft:2000,itl:21")}
BEST = "best-temporal"
MODES = ("temporal", "temporal-chunked", BEST, "spatial")


def sweep(level: float, rates: list[float], seeds: list[int], duration: float,
          drain: float) -> dict[str, dict[float, dict[str, Any]]]:
    """{mode: {rate: {slo name: goodput per s, "<name>_att": attainment}}} at one level;
    best-temporal's cells also name the knobs it chose (``<name>_knobs``)."""
    from spaceserve.runtime.policy.analytic.model import analytic_curves
    from spaceserve.runtime.policy.contention import Contention
    from spaceserve.runtime.sim import SimConfig, Workload
    from spaceserve.runtime.sim.sweep.rates import run_sweep

    curves = analytic_curves(device="H200").with_contention(Contention.flat(level))
    out: dict[str, dict[float, dict[str, Any]]] = {m: {r: {} for r in rates} for m in MODES}
    for name, slo in SLOS.items():
        # each SLO's runs are scheduled for it (SIS's goodput objective and TWSRFT's deadlines
        # aim at the SLO they are judged by); best-temporal is tuned per SLO and rate
        rows = run_sweep(curves, MODES, rates, Workload(rates[0], duration), SimConfig(slo=slo),
                         slo=slo, seeds=seeds, drain_s=drain)
        for mode, per_rate in rows.items():
            for rate, row in zip(rates, per_rate, strict=True):
                cell = out[mode][rate]
                cell[name], cell[f"{name}_att"] = (row["goodput"]["rate_per_s"],
                                                   row["goodput"]["attainment"])
                if "knobs" in row:
                    cell[f"{name}_knobs"] = row["knobs"]
    return out


def _ratio_holds(r: dict, rates: list[float], slo: str, ratio: float) -> bool:
    return all(r["spatial"][x][slo] >= ratio * r[BEST][x][slo] - 1e-9 for x in rates)


# (statement, test on one level's results) - the claims the README weighs
CONCLUSIONS: list[tuple[str, Callable[[dict, list[float]], bool]]] = [
    ("SLO A: spatial >= 0.99x best-temporal at every rate",
     lambda r, rates: _ratio_holds(r, rates, "A", 0.99)),
    ("SLO B: spatial >= 0.99x best-temporal at every rate",
     lambda r, rates: _ratio_holds(r, rates, "B", 0.99)),
    ("SLO A: spatial >= 0.95x best-temporal at every rate",
     lambda r, rates: _ratio_holds(r, rates, "A", 0.95)),
    ("SLO B: spatial >= 0.95x best-temporal at every rate",
     lambda r, rates: _ratio_holds(r, rates, "B", 0.95)),
    ("SLO B: spatial >= 5x temporal at every rate >= 8 img/s",
     lambda r, rates: all(r["spatial"][x]["B"] >= 5 * r["temporal"][x]["B"]
                          for x in rates if x >= 8)),
    ("SLO A: temporal-chunked >= temporal at every rate",
     lambda r, rates: all(r["temporal-chunked"][x]["A"] >= r["temporal"][x]["A"] - 1e-9
                          for x in rates)),
    ("SLO B: temporal-chunked >= temporal at every rate",
     lambda r, rates: all(r["temporal-chunked"][x]["B"] >= r["temporal"][x]["B"] - 1e-9
                          for x in rates)),
    ("spatial serves >= 90% within SLO A at 8 img/s",
     lambda r, rates: 8.0 in r["spatial"] and r["spatial"][8.0]["A_att"] >= 0.9),
]


def markdown(results: dict[float, dict], rates: list[float]) -> str:
    """Goodput tables (one row per level and rate) and the conclusions' verdicts."""
    lines = ["| contention | img/s | " + " | ".join(
        f"{m} A / B" for m in MODES) + " |", "|---|---|" + "---|" * len(MODES)]
    for level, res in results.items():
        for rate in rates:
            cells = [f"{res[m][rate]['A']:.2f} / {res[m][rate]['B']:.2f}" for m in MODES]
            lines.append(f"| {100 * level:g}% | {rate:g} | " + " | ".join(cells) + " |")
    lines += ["", "| conclusion | " + " | ".join(f"{100 * lv:g}%" for lv in results) + " |",
              "|---|" + "---|" * len(results)]
    for text, test in CONCLUSIONS:
        lines.append(f"| {text} | " + " | ".join("holds" if test(res, rates) else "fails"
                                                 for res in results.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim.contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="0,0.08,0.2,0.35", help="co-running slowdowns")
    p.add_argument("--rates", default="2,4,6,8,10,12,14,16,18,20", help="image requests/s")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--drain", type=float, default=10.0, help="seconds after arrivals stop")
    p.add_argument("--out", type=Path, default=Path("runs/sim-contention"))
    args = p.parse_args(argv)
    levels = [float(x) for x in args.levels.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    results = {}
    for level in levels:
        results[level] = sweep(level, rates, seeds, args.duration, args.drain)
        print(f"contention {100 * level:g}% done ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    md = markdown(results, rates)
    print(f"\ngoodput (image requests/s within SLO A ttft:2000,tpot:50 / B ttft:2000,itl:21), "
          f"H200 modelled, Qwen2-VL-7B, batch 32, {args.duration:g} s x seeds {seeds}:\n")
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "contention.md").write_text(md + "\n")
    (args.out / "contention.json").write_text(json.dumps(
        {"config": vars(args) | {"out": str(args.out)},
         "slos": {k: v.to_dict() for k, v in SLOS.items()},
         "results": {str(lv): {m: {str(r): c for r, c in rows.items()}
                               for m, rows in res.items()} for lv, res in results.items()}},
        indent=1))
    print(f"\nwrote {args.out / 'contention.md'} ({time.perf_counter() - t0:.0f} s)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
