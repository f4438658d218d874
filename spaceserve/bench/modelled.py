"""The simulator's goodput prediction for the target GPU, printed beside a CPU run.

A CPU cannot co-locate anything, so `spaceserve bench serve` on a CPU shows only that the
plumbing works. Beside it, this module replays the *same* request stream (the benchmark's
workload: arrivals, image sizes, prompt and output lengths, probes) through the discrete-event
simulator on analytic curves of the target GPU (an H200 preset by default) for the model the
run stands for - the checkpoint's own config, the random-weight model's full config, or, for
``--model tiny``, Qwen2-VL-7B (the model the tiny one stands in for) - in each benchmarked mode,
with the same SLO, arrival window and bounded drain. Everything here is modelled, never
measured, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spaceserve.bench.metrics import flatten
from spaceserve.bench.prompts import TEMPLATE_TOKENS, image_grid
from spaceserve.bench.workload import ServeWorkload, build_requests
from spaceserve.runtime.policy.slo import Slo

GROUPS = (("load", ("image", "text")), ("probe", ("probe",)))


def target_config(model: str) -> tuple[Any, str]:
    """(transformers config, name) of the model a benchmark run stands for."""
    from spaceserve.bench.random_model import is_random_model, random_config

    if is_random_model(model):
        return random_config(model), model.removesuffix("-random")
    path = Path(model).expanduser()
    if model.startswith("tiny-qwen3-vl"):
        from spaceserve.runtime.policy.analytic.model import qwen3_vl_8b_config

        return qwen3_vl_8b_config(), "Qwen3-VL-8B (what the tiny model stands in for)"
    if model != "tiny" and (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, local_files_only=True), path.name
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config

    return qwen2_vl_7b_config(), "Qwen2-VL-7B (what the tiny model stands in for)"


def sim_requests(w: ServeWorkload, vision_config: Any) -> list[Any]:
    """The workload's requests as the simulator's: image tokens from the target model's
    preprocessing of each resolution, text tokens as the token-id prompts count them."""
    from spaceserve.runtime.sim import Request

    merge = int(vision_config.spatial_merge_size)
    grids: dict[str, int] = {}
    out = []
    for r in build_requests(w):
        image = 0
        if r.kind == "image":
            if r.resolution not in grids:
                t, h, wd = image_grid(r.resolution, vision_config)
                grids[r.resolution] = t * h * wd // merge ** 2
            image = grids[r.resolution]
        out.append(Request(r.idx, r.arrival, image, TEMPLATE_TOKENS + len(r.prompt.split()),
                           r.max_tokens, r.kind, r.resolution))
    return out


def sim_config(mode: str, num_sms: int, window_s: float, curves: Any = None,
               slo: Slo | None = None) -> Any:
    """The simulator's settings for an engine mode at its defaults (no background batch): the
    static split of `spatial-static`, and SIS's split set (chosen from `curves` and `slo` at
    the engine's reference decode load, `EngineConfig.sis_load`) and objective."""
    from spaceserve.runtime.engine.config import EngineConfig
    from spaceserve.runtime.policy.scheduling import scheduling_policy
    from spaceserve.runtime.sim import SimConfig
    from spaceserve.runtime.spatial.partition import default_splits

    static = default_splits(num_sms)
    splits = tuple(static)
    if curves is not None:
        eng = EngineConfig(mode="spatial", slo=slo) if slo is not None else EngineConfig()
        batch, context = eng.sis_load
        splits = scheduling_policy(curves, eng.slo, objective=eng.sis_objective,
                                   total_sms=num_sms, batch=batch, context=context).splits
    return SimConfig(mode=mode, background=0, window_s=window_s, slo=slo,
                     static_encoder_sms=static[len(static) // 2], allowed_encoder_sms=splits)


def predict(workloads: list[ServeWorkload], modes: list[str], model: str, slo: Slo, *,
            device: str = "H200", window_s: float = 0.02, drain_s: float = 30.0
            ) -> dict[str, Any]:
    """Modelled metrics and goodput per mode and rate; {"error": why} when it cannot run."""
    try:
        from spaceserve.runtime.policy.analytic.model import analytic_curves
        from spaceserve.runtime.sim import Simulator, summarize
        from spaceserve.runtime.sim.metrics import image_goodput

        config, name = target_config(model)
        curves = analytic_curves(config, device, name=name)
        rows = []
        for mode in modes:
            cfg = sim_config(mode, curves.num_sms, window_s, curves, slo)
            for w in workloads:
                reqs = sim_requests(w, config.vision_config)
                sim = Simulator(curves, cfg, horizon=w.duration_s)
                for r in reqs:
                    sim.advance_to(r.arrival)
                    sim.add(r)
                sim.advance_to(w.duration_s)
                sim.drain(drain_s)
                row = {"mode": mode, "rate": w.request_rate,
                       "goodput": image_goodput(reqs, slo, w.duration_s).to_dict()}
                row |= {g: flatten(summarize(reqs, kinds)) for g, kinds in GROUPS}
                rows.append(row)
    except Exception as exc:  # a prediction failing must not lose the measurement
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    table = curves.contention
    return {"model": name, "device": curves.device, "curves": curves.source,
            "contention": table.note if table is not None else "co-running grids",
            "slo": str(slo), "drain_s": drain_s, "rows": rows}
