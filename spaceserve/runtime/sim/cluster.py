"""Run a workload on one GPU or on many behind a request router.

All GPUs advance in lockstep to each arrival, so a least-loaded router sees every GPU's state at
the instant it routes. ``media_aware`` is SpaceServe's router (router.py: the routing code Ray
Serve runs, on what a front end sees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import Goodput, Slo
from spaceserve.runtime.sim.engine import SimConfig, Simulator
from spaceserve.runtime.sim.metrics import image_goodput, summarize
from spaceserve.runtime.sim.router import MediaAwareRouter
from spaceserve.runtime.sim.workload import Request, Workload, generate

ROUTERS = ("round_robin", "least_loaded", "media_aware")


@dataclass
class SimResult:
    """Everything one run produced."""

    config: SimConfig
    workload: Workload
    requests: list[Request]
    gpus: list[Simulator]
    drain_s: float | None = None  # how long the run went on after arrivals stopped (None: all)

    def goodput(self, slo: Slo) -> Goodput:
        """Image requests of the arrival window meeting `slo` (unfinished ones miss)."""
        return image_goodput(self.requests, slo, self.workload.duration_s)

    def summary(self) -> dict[str, Any]:
        return {"all": summarize(self.requests),
                "image": summarize(self.requests, ("image",)),
                "text": summarize(self.requests, ("text",)),
                "background": summarize(self.requests, ("background",))}


def route(gpus: list[Simulator], router: str, index: int) -> Simulator:
    """The GPU the `index`-th request goes to."""
    if router == "round_robin":
        return gpus[index % len(gpus)]
    return min(gpus, key=lambda g: (g.outstanding(), g.gpu))


def simulate(curves: CurveSet, config: SimConfig, workload: Workload, *, num_gpus: int = 1,
             router: str = "round_robin", drain_s: float | None = None) -> SimResult:
    """Simulate `workload` on `num_gpus` GPUs, each with its own background decode batch.

    Arrivals stop at ``workload.duration_s``; each GPU's background batch keeps decoding until
    then and until its last request has finished, so the decode load stays steady. `drain_s`
    bounds how long the run goes on after arrivals stop (requests unfinished then stay
    unfinished: misses for goodput); None runs until every request has finished.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    arrivals = generate(workload)
    gpus = [Simulator(curves, config, gpu=i, horizon=workload.duration_s)
            for i in range(num_gpus)]
    media = MediaAwareRouter(curves, gpus) if router == "media_aware" else None
    for i, req in enumerate(arrivals):
        for g in gpus:
            g.advance_to(req.arrival)
        (media.route(req) if media else route(gpus, router, i)).add(req)
    for g in gpus:
        g.advance_to(workload.duration_s)
        g.drain(drain_s)
    requests = arrivals + [r for g in gpus for r in g.requests.values() if r.kind == "background"]
    return SimResult(config, workload, requests, gpus, drain_s)
