"""The "serving" section: TPOT, p99 ITL and TTFT against image request rate, per engine mode,
measured by the serving benchmark in-process beside the simulator's prediction.

On the GPU (`run`): random-weight Qwen2-VL-7B shapes in bf16 (`--model qwen2-vl-7b-random` of
`spaceserve bench serve`), the LLM cut to `LLM_LAYERS` layers so four engines fit the budget
(recorded in every row), the vision tower whole. Per mode (spatial, temporal-chunked, temporal,
shared: spatial against the strongest time-multiplexed baseline first), image requests (448x448,
1024x1024, 1920x1080) arrive as a Poisson stream at each of `RATES`, beside small text "probe"
requests that show head-of-line blocking directly; the simulator replays the same requests on
the engine's splits. ``temporal-chunked`` runs with the encoder window the SLO allows
(`slo_window`: no helper in the runtime sizes it, so it is computed here from the curves).
Each mode gets an equal share of the time left when it starts; a rate that cannot start in its
share is left out and a run still going at its end is cut (its unfinished requests count as
failed), so the section ends in time and keeps what it measured. Rows, results JSON (every
request) and the figures (latency against rate with the simulator dotted; SM split timeline) go
to the results directory, rewritten after each mode.

Every row says which of its figures are graph-timed (``graph_timed``: the decode figures when
the mode's decode-only steps replayed CUDA graphs, ``graph_step_fraction`` of them did; TTFT,
prefill and the simulator's figures never are). A co-located engine adds a "graph-memory" row:
its decode graphs' bytes per capture and in total for the split set in use, and the KV blocks
they cost (`bench.common.graph_memory`). `dry_run` runs all of it on CPU with a tiny model.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BENCH_GRAPH_RESERVE_BYTES,
    format_table,
    graph_memory,
    section_rows,
    write_json,
)

SECTION = "serving"
MODES = ("spatial", "temporal-chunked", "temporal", "shared")  # the deciding pair first
DECODE_MARGIN = 0.8  # of the decode bound, as SIS's default decode_margin
DECODE_FIGURES = ("mean_tpot_ms", "p99_itl_ms", "probe_p99_itl_ms")  # decode-step figures
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
    modes: tuple[str, ...] = MODES
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
    encoder_window_s: float | None = None  # temporal-chunked's window; None: `slo_window`
    plots: bool = True


def slo_window(curves: Any, slo: Any, vision: Any, image_mix: dict[str, float],
               load: tuple[int, int], margin: float = DECODE_MARGIN) -> dict[str, Any]:
    """``temporal-chunked``'s encoder window from the SLO: the largest window whose step - the
    window of encoder layers, the one layer it may overshoot by (the largest image of the mix)
    and the decode step at `load` (batch, mean context; the engine's ``sis_load``, the load
    ``spatial``'s split set is chosen for), all on the whole device by the curves - stays
    within `margin` x the decode bound (the tighter of ``tpot`` and ``itl``), as SIS keeps
    ``spatial``'s decode step. At least 1 ms (the stage runs one layer per step regardless).
    ValueError when the SLO bounds neither."""
    from spaceserve.bench.prompts import image_grid
    from spaceserve.runtime.policy.scheduling import decode_bound_s

    bound = decode_bound_s(slo)
    if bound is None:
        raise ValueError(f"slo={slo}: temporal-chunked's window needs a tpot or itl bound")
    sms = curves.num_sms
    patches = max((math.prod(image_grid(r, vision)) for r in image_mix if r != "text"),
                  default=0)
    layer = curves.encoder(patches, 1, sms)
    step = curves.decode(load[0], load[1], sms)
    window = max(1e-3, margin * bound - step - layer)
    return {"encoder_window_ms": window * 1e3, "window_bound_ms": bound * 1e3,
            "window_margin": margin, "window_decode_ms": step * 1e3,
            "window_layer_ms": layer * 1e3,
            "window_from": f"SLO {slo}: {margin:g} x {bound * 1e3:g} ms - decode step at batch "
                           f"{load[0]}, context {load[1]} - one layer of {patches} patches"}


class GraphSteps:
    """Counts a runner's decode-only steps and those that replayed a CUDA graph
    (`prepare_step`'s answer), to say which figures are graph-timed."""

    def __init__(self, runner: Any) -> None:
        self.decode_only = self.replayed = 0
        prepare = getattr(runner, "prepare_step", None)
        if prepare is None:  # a runner without the split step: nothing is graph-timed
            return

        def counted(batch: Any, *a: Any, **k: Any) -> Any:
            step = prepare(batch, *a, **k)
            if step.stage == "decoder" and batch.num_decodes == batch.num_seqs:
                self.decode_only += 1
                self.replayed += step.graph is not None
            return step

        runner.prepare_step = counted

    def fields(self) -> dict[str, Any]:
        frac = self.replayed / self.decode_only if self.decode_only else 0.0
        return {"graph_timed": list(DECODE_FIGURES) if self.replayed else [],
                "graph_step_fraction": frac}


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
    first = mode_rows[0]
    window = (f" (window {first['encoder_window_ms']:.1f} ms)"
              if "encoder_window_ms" in first else "")
    timed = (f"decode steps {first.get('graph_step_fraction', 0.0):.0%} graph-replayed"
             if first.get("graph_timed") else "eager decode")
    return (f"{first['mode']}{window} @ {rates} img/s: " + ", ".join(parts) +
            f" ms; probe p99 ITL {probe} ms; {timed}")


def graph_headline(row: dict[str, Any]) -> str:
    """A co-located engine's decode graphs: bytes per capture, total, KV blocks."""
    per = ", ".join(f"{k}: {v / 2 ** 20:.0f}" for k, v in row["graph_bytes"].items())
    return (f"{row['mode']} decode graphs: {row['graph_bytes_total'] / 2 ** 20:.0f} MiB over "
            f"{row['graph_captures']} captures ({per or 'none: no CUDA'}; MiB per encoder "
            f"split, 0 = whole device) = {row['graph_kv_blocks_total']} KV blocks")


def _skipped(mode: str, rates: Any, why: str) -> list[dict[str, Any]]:
    return [{"section": SECTION, "mode": mode, "rate": r, "skipped": why, "graph_timed": []}
            for r in rates]


def _save(out: Path, rows: list[dict[str, Any]], runs: list[dict[str, Any]],
          config: dict[str, Any], plots: bool) -> None:
    from spaceserve.bench.serve import write_outputs

    write_json(out / f"{SECTION}_rows.json", rows)
    write_outputs(runs, out, config, plots=plots and bool(runs), prefix=f"{SECTION}_")


def _engine_config(plan: Plan, mode: str, window: dict[str, Any] | None) -> dict[str, Any]:
    cfg = dict(plan.engine)
    if mode == "temporal-chunked" and window is not None:
        cfg["encoder_window_s"] = window["encoder_window_ms"] / 1e3
    return cfg


def run_plan(plan: Plan, results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """Measure `plan` within `time_budget_s` seconds; rows (headline on each mode's last)."""
    from spaceserve.bench.random_model import RandomModels, default_backend
    from spaceserve.bench.serve import _free_device, bench_engine
    from spaceserve.bench.workload import ServeWorkload
    from spaceserve.runtime.engine.config import EngineConfig
    from spaceserve.runtime.policy.model_curves import model_curves
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
    window = None
    if "temporal-chunked" in plan.modes:
        if plan.encoder_window_s is not None:
            window = {"encoder_window_ms": plan.encoder_window_s * 1e3, "window_from": "plan"}
        else:
            load = plan.engine.get("sis_load", EngineConfig.sis_load)
            window = slo_window(model_curves(plan.engine.get("curves"), models.config), slos,
                                models.config.vision_config, plan.image_mix, load)
        print(f"temporal-chunked: encoder window {window['encoder_window_ms']:.1f} ms "
              f"({window['window_from']})", flush=True)
    config = asdict(plan) | {"llm_layers": models.llm_layers, "device": str(device),
                             "built_s": time.monotonic() - start, "window": window}
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
        counted = None
        extra = window if mode == "temporal-chunked" and window is not None else {}
        try:
            engine, prompts, note = models.engine(mode, **_engine_config(plan, mode, window))
            counted = GraphSteps(engine.runner)
            if engine.spatial is not None:
                mem = {"section": SECTION, "mode": mode, "row": "graph-memory",
                       "splits": sorted(engine.spatial.partitions.splits),
                       "graph_timed": []} | graph_memory(engine)
                rows.append(mem | {"headline": graph_headline(mem)})
            mode_runs = asyncio.run(bench_engine(
                engine, workloads, slos, mode=mode, model=plan.model, note=note,
                prompts=prompts, sim=True, deadline=share,
                extra={"llm_layers": models.llm_layers}))
            del engine
        except Exception as exc:  # one mode failing must not lose the others
            mode_runs = []
            rows.append({"section": SECTION, "mode": mode, "graph_timed": [],
                         "error": f"{type(exc).__name__}: {exc}"[:400]})
        _free_device()
        mine = [run_row(r) | extra | (counted.fields() if counted else {"graph_timed": []})
                for r in mode_runs]
        if mine:
            mine[-1]["headline"] = headline(mine)
        done = {r["rate"] for r in mine}
        rows += mine + _skipped(mode, [r for r in plan.rates if r not in done],
                                "time budget spent")
        runs += mode_runs
        _save(out, rows, runs, config, plots=False)  # kept should the process be killed
    _save(out, rows, runs, config, plots=plan.plots)
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


def dry_plan() -> Plan:
    """The section on CPU in seconds: a tiny random model, every mode, one short rate."""
    from bench.common import register_dry_model

    return Plan(model=register_dry_model(), llm_layers=None, rates=(8.0,), duration_s=0.25,
                image_mix={"112x112": 0.6, "224x224": 0.4}, probe_rate=5.0, output_len=4,
                probe_output_len=3, engine=dict(num_kv_blocks=256, max_num_seqs=16,
                                                max_model_len=1024),
                device="cpu", min_mode_s=0.3, reserve_s=0.3, plots=False)


def dry_run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The section's control flow on CPU (`dry_plan`): the window from the SLO, the
    graph-memory row (nothing captured without CUDA), every mode's rows."""
    torch.set_num_threads(1)
    return run_plan(dry_plan(), results_dir, time_budget_s)
