"""The simulator's ``media_aware`` router: SpaceServe's routing function on a `ReplicaTracker`.

The same code Ray Serve's request router runs (`spaceserve.runtime.routing.router`), fed with the
events a serving front end sees: a request routed, its first token, its end. Every simulated
request is treated as a streaming one (its first token is reported). Simulated images have no
pixels: each gets a hash of its own, so they bring encoder work but no affinity; prompts have no
token ids, so no prefix affinity either.
"""

from __future__ import annotations

from typing import Any, Protocol

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.routing.router import RouterConfig, RouteRequest, WorkModel
from spaceserve.runtime.routing.tracker import ReplicaTracker
from spaceserve.runtime.sim.workload import PATCHES_PER_TOKEN, Request


class SimulatedGpu(Protocol):
    """What the router needs of a simulated GPU (a `sim.engine.Simulator`)."""

    gpu: Any
    now: float


class MediaAwareRouter:
    """Routes simulated requests across `gpus` with the media-aware policy."""

    def __init__(self, curves: CurveSet, gpus: list[SimulatedGpu],
                 config: RouterConfig | None = None) -> None:
        self.gpus = {str(g.gpu): g for g in gpus}
        self.tracker = ReplicaTracker(WorkModel(curves, patches_per_token=PATCHES_PER_TOKEN),
                                      config, clock=lambda: gpus[0].now)
        for key in self.gpus:
            self.tracker.add(key)
        self.open: dict[int, Request] = {}

    def route(self, req: Request) -> SimulatedGpu:
        """The GPU `req` goes to (all GPUs stand at its arrival time)."""
        self._report()
        images = (req.image_tokens,) if req.image_tokens > 0 else ()
        key = self.tracker.choose(RouteRequest(
            str(req.rid), req.prompt_tokens, images, tuple(f"image-{req.rid}" for _ in images),
            output_tokens=req.output_tokens))
        self.open[req.rid] = req
        return self.gpus[key]

    def _report(self) -> None:
        """First tokens and ends since the last arrival, as the front end would see them."""
        for rid, r in list(self.open.items()):
            if r.first_token is not None:
                self.tracker.on_first_token(str(rid))
            if r.finish is not None:
                self.tracker.on_finished(str(rid))
                del self.open[rid]
