"""The simulator's prediction for a measured serving run (`spaceserve bench serve --sim`).

The discrete-event simulator (`spaceserve.runtime.sim`) replays the run's own requests - each
at the instant it was sent, with its measured prompt shape (image and text tokens) and output
length - in the engine's mode, on the engine's SM splits and on the resource-utility curves the
engine schedules with, with no background batch (the serving benchmark has none). Its TTFT,
TPOT and ITL for the load and the probes come out under the same vLLM names as the
measurement, with the relative error (simulated - measured) / measured of the three headline
numbers per group. Only requests that completed are replayed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spaceserve.bench.metrics import Result, flatten

# (metric key, short name) of the numbers compared against the measurement.
COMPARED = (("mean_tpot_ms", "tpot"), ("p99_itl_ms", "p99_itl"), ("mean_ttft_ms", "ttft"))
GROUPS = (("load", ("image", "text")), ("probe", ("probe",)))


def sim_config(engine: Any) -> Any:
    """The simulator's settings for `engine`: its mode, splits, SLO and SIS objective."""
    from spaceserve.runtime.policy.slo import Slo
    from spaceserve.runtime.sim import SimConfig

    mode = str(engine.config.mode)
    kw: dict[str, Any] = {"mode": mode, "background": 0,
                          "window_s": float(getattr(engine.config, "encoder_window_s", 0.02))}
    if isinstance(getattr(engine.config, "slo", None), Slo):
        kw["slo"] = engine.config.slo
    if getattr(engine.config, "sis_objective", None) in ("goodput", "tpot"):
        kw["sis_objective"] = engine.config.sis_objective
    spatial = getattr(engine, "spatial", None)
    if spatial is not None:
        pset = spatial.partitions
        if mode == "spatial-static":
            kw["static_encoder_sms"] = int(pset.current.encoder_sms)
        if mode == "spatial":
            kw["allowed_encoder_sms"] = tuple(sorted(int(e) for e in pset.splits))
    return SimConfig(**kw)


def sim_requests(results: list[Result], t0: float) -> list[Any]:
    """The completed requests of a run as simulator requests, in send order."""
    from spaceserve.runtime.sim import Request

    done = sorted((r for r in results if r.ok and r.prompt_tokens > 0), key=lambda r: r.send)
    return [Request(r.idx, max(0.0, r.send - t0), r.image_tokens,
                    max(1, r.prompt_tokens - r.image_tokens), max(1, r.output_tokens), r.kind,
                    r.resolution) for r in done]


def simulate_requests(curves: Any, config: Any, requests: list[Any]) -> dict[str, Any]:
    """Run `requests` through one simulated GPU; load and probe metrics (vLLM names)."""
    from spaceserve.runtime.sim import Simulator, summarize

    horizon = max((r.arrival for r in requests), default=0.0)
    sim = Simulator(curves, config, horizon=horizon)
    for req in requests:
        sim.advance_to(req.arrival)
        sim.add(req)
    sim.drain()
    return {name: flatten(summarize(requests, kinds)) for name, kinds in GROUPS}


def errors(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float]:
    """(simulated - measured) / measured of the compared load metrics that both have."""
    out: dict[str, float] = {}
    for key, short in COMPARED:
        got, want = measured.get(key), predicted.get(key)
        if isinstance(got, (int, float)) and isinstance(want, (int, float)) and got > 0 \
                and want == want:
            out[short] = (want - got) / got
    return out


def predict_run(engine: Any, run: dict[str, Any], curves: Any = None) -> dict[str, Any]:
    """The simulator's prediction for one measured run (`run_one`'s dict) on `engine`, with
    its errors; {"error": why} when the simulation cannot run."""
    try:
        if curves is None:
            from spaceserve.runtime.policy.model_curves import load_curves

            curves = load_curves(engine.config.curves, engine.runner)
        config = sim_config(engine)
        reqs = sim_requests(run["results"], run["t0"])
        pred = simulate_requests(curves, config, reqs)
    except Exception as exc:  # a prediction failing must not lose the measurement
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    errs = {name: errors(run["metrics"][name], pred[name]) for name, _ in GROUPS}
    return pred | {"errors": errs, "requests": len(reqs), "config": dataclasses.asdict(config)}
