"""The "serving" section: TPOT, p99 ITL and TTFT against image request rate, per engine mode,
measured by the serving benchmark in-process beside the simulator's prediction.

On the GPU (`run`): random-weight Qwen2-VL-7B shapes in bf16 (`--model qwen2-vl-7b-random` of
`spaceserve bench serve`), the LLM cut to `LLM_LAYERS` layers so three engines fit the budget
(recorded in every row), the vision tower whole. Per mode (spatial, temporal, shared; the
spatial-temporal comparison first), image requests (448x448, 1024x1024, 1920x1080) arrive as a
Poisson stream at each of `RATES`, beside small text "probe" requests that show head-of-line
blocking directly; the simulator replays the same requests on the engine's splits. Each mode
gets an equal share of the time left when it starts; a rate that cannot start in its share is
left out and a run still going at its end is cut (its unfinished requests count as failed), so
the section ends in time and keeps what it measured. Rows, results JSON (every request) and the
figures (latency against rate with the simulator dotted; SM split timeline) go to the results
directory, rewritten after each mode.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import BENCH_GRAPH_RESERVE_BYTES, format_table, section_rows, write_json

SECTION = "serving"
LLM_LAYERS = 8  # of Qwen2-VL-7B's 28, as the colocation section: the numbers compare
RATES = (2.0, 6.0)  # image requests per second
IMAGE_MIX = {"448x448": 0.3, "1024x1024": 0.4, "1920x1080": 0.3}
# max_model_len: the longest request is a 1920x1080 image (2691 tokens) + a few words + 32
# output tokens (tests/bench/test_bench_figures.py checks it covers the plan's requests).
ENGINE = dict(num_kv_blocks=8192, block_size=16, max_num_seqs=64, max_num_batched_tokens=4096,
              max_encoder_tokens_per_step=2816, graph_batch_sizes=(8, 32), max_model_len=4096,
              graph_reserve_bytes=BENCH_GRAPH_RESERVE_BYTES)


@dataclass(frozen=True)
class Plan:
    """What the section measures; `engine` holds EngineConfig fields."""

    model: str = "qwen2-vl-7b-random"
    llm_layers: int | None = LLM_LAYERS
    modes: tuple[str, ...] = ("spatial", "temporal", "shared")
    rates: tuple[float, ...] = RATES
    duration_s: float = 1.5
    image_mix: dict[str, float] = field(default_factory=lambda: dict(IMAGE_MIX))
    probe_rate: float = 4.0
    input_words: int = 12
    output_len: int = 32
    probe_output_len: int = 16
    slo: str = "ttft:2000,tpot:50"
    engine: dict[str, Any] = field(default_factory=lambda: dict(ENGINE))
    device: str | None = None
    min_mode_s: float = 4.0  # a mode is not started with less time than this left
    reserve_s: float = 1.5  # kept for the figures at the end
    seed: int = 0


def _metric_cells(prefix: str, m: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}mean_ttft_ms": m.get("mean_ttft_ms"), f"{prefix}p99_ttft_ms":
            m.get("p99_ttft_ms"), f"{prefix}mean_tpot_ms": m.get("mean_tpot_ms"),
            f"{prefix}p99_itl_ms": m.get("p99_itl_ms")}


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """One measured run as a flat row: load and probe latencies, prediction and its error."""
    from spaceserve.bench.serve import CUT

    met = run["metrics"]
    row: dict[str, Any] = {"section": SECTION, "mode": run["mode"], "ran_as": run["ran_as"],
                           "rate": run["rate"], "llm_layers": run.get("llm_layers"),
                           "requests": run["num_requests"],
                           "completed": met["load"]["completed"] + met["probe"]["completed"],
                           "failed": met["failed"]}
    row |= _metric_cells("", met["load"])
    row |= {"probe_mean_ttft_ms": met["probe"]["mean_ttft_ms"],
            "probe_p99_itl_ms": met["probe"]["p99_itl_ms"]}
    sim = run.get("sim") or {}
    if "load" in sim:
        row |= {f"sim_{k}": sim["load"][k] for k in ("mean_tpot_ms", "p99_itl_ms",
                                                     "mean_ttft_ms")}
        row |= {f"sim_err_{k}": v for k, v in sim["errors"]["load"].items()}
    elif sim:
        row["sim_error"] = sim.get("error")
    splits = sorted({int(s["encoder_sms"]) for s in run["timeline"]
                     if s["encoder_sms"] == s["encoder_sms"]})
    if splits:
        row["encoder_sms_used"] = splits
    if run.get("unsent") or CUT in met["errors"]:
        row["cut"] = f"time limit: {run.get('unsent', 0)} unsent, unfinished aborted"
    if met["errors"]:
        row["errors"] = met["errors"]
    return row


def _series(rows: list[dict[str, Any]], key: str) -> str:
    return "/".join("-" if not isinstance(r.get(key), float) or math.isnan(r[key])
                    else f"{r[key]:.0f}" if r[key] >= 100 else f"{r[key]:.1f}" for r in rows)


def headline(mode_rows: list[dict[str, Any]]) -> str:
    """One mode across rates: measured (simulated) TPOT, p99 ITL and TTFT."""
    rates = "/".join(f"{r['rate']:g}" for r in mode_rows)
    parts = [f"{name} {_series(mode_rows, key)} (sim {_series(mode_rows, 'sim_' + key)})"
             for name, key in (("TPOT", "mean_tpot_ms"), ("p99 ITL", "p99_itl_ms"),
                               ("TTFT", "mean_ttft_ms"))]
    probe = _series(mode_rows, "probe_p99_itl_ms")
    return (f"{mode_rows[0]['mode']} @ {rates} img/s: " + ", ".join(parts) +
            f" ms; probe p99 ITL {probe} ms")


def _skipped(mode: str, rates: Any, why: str) -> list[dict[str, Any]]:
    return [{"section": SECTION, "mode": mode, "rate": r, "skipped": why} for r in rates]


def _save(out: Path, rows: list[dict[str, Any]], runs: list[dict[str, Any]],
          config: dict[str, Any], plots: bool) -> None:
    from spaceserve.bench.serve import write_outputs

    write_json(out / f"{SECTION}_rows.json", rows)
    write_outputs(runs, out, config, plots=plots and bool(runs), prefix=f"{SECTION}_")


def run_plan(plan: Plan, results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """Measure `plan` within `time_budget_s` seconds; rows (headline on each mode's last)."""
    from spaceserve.bench.random_model import RandomModels, default_backend
    from spaceserve.bench.serve import _free_device, bench_engine
    from spaceserve.bench.workload import ServeWorkload
    from spaceserve.runtime.policy.slo import Slo
    from spaceserve.server.engine_client import resolve_mode

    start = time.monotonic()
    deadline = start + time_budget_s - plan.reserve_s
    out = Path(results_dir)
    slos = Slo.parse(plan.slo)
    workloads = [ServeWorkload(request_rate=r, duration_s=plan.duration_s,
                               image_mix=dict(plan.image_mix), probe_rate=plan.probe_rate,
                               input_words=plan.input_words, output_len=plan.output_len,
                               probe_output_len=plan.probe_output_len, seed=plan.seed)
                 for r in plan.rates]
    device = torch.device(plan.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = [default_backend(resolve_mode(m)[0], device) for m in plan.modes]
    models = RandomModels(plan.model, llm_layers=plan.llm_layers, backends=backends,
                          device=device, seed=plan.seed)
    config = asdict(plan) | {"llm_layers": models.llm_layers, "device": str(device),
                             "built_s": time.monotonic() - start}
    print(f"{plan.model}: LLM {models.llm_layers} layers, vision tower whole, "
          f"{models.dtype}; built in {config['built_s']:.1f} s", flush=True)
    rows = section_rows()  # saved after every row
    runs: list[dict[str, Any]] = []
    for i, mode in enumerate(plan.modes):
        now = time.monotonic()
        if deadline - now < plan.min_mode_s:
            rows += _skipped(mode, plan.rates, "time budget spent")
            continue
        share = now + (deadline - now) / (len(plan.modes) - i)
        try:
            engine, prompts, note = models.engine(mode, **plan.engine)
            mode_runs = asyncio.run(bench_engine(
                engine, workloads, slos, mode=mode, model=plan.model, note=note,
                prompts=prompts, sim=True, deadline=share,
                extra={"llm_layers": models.llm_layers}))
            del engine
        except Exception as exc:  # one mode failing must not lose the others
            mode_runs = []
            rows.append({"section": SECTION, "mode": mode,
                         "error": f"{type(exc).__name__}: {exc}"[:400]})
        _free_device()
        mine = [run_row(r) for r in mode_runs]
        if mine:
            mine[-1]["headline"] = headline(mine)
        done = {r["rate"] for r in mine}
        rows += mine + _skipped(mode, [r for r in plan.rates if r not in done],
                                "time budget spent")
        runs += mode_runs
        _save(out, rows, runs, config, plots=False)  # kept should the process be killed
    _save(out, rows, runs, config, plots=True)
    print(format_table([r for r in rows if "mean_tpot_ms" in r],
                       ["mode", "rate", "completed", "failed", "mean_tpot_ms", "sim_mean_tpot_ms",
                        "p99_itl_ms", "sim_p99_itl_ms", "mean_ttft_ms", "sim_mean_ttft_ms",
                        "probe_p99_itl_ms"]))
    return list(rows)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """GPU harness entry point (bf16 Qwen2-VL-7B shapes, LLM cut to `LLM_LAYERS` layers)."""
    if not torch.cuda.is_available():
        return [{"section": SECTION, "skipped": "needs a CUDA device"}]
    return run_plan(Plan(), results_dir, time_budget_s)
