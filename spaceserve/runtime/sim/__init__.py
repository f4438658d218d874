"""Discrete-event simulation of SpaceServe's schedulers on resource-utility curves.

The simulator drives the real `TwsrftScheduler` and `SpaceInferenceScheduler`, and in the
time-multiplexed and co-located modes the engine's own `Scheduler` and `BlockManager`, so its
figures are the engine's schedule on the curves (`tests/runtime/sim/test_fidelity.py`).

engine.py (`Simulator`: the event loop, co-located lanes), loops/ (the engine's step loops:
stepped.py for the time-multiplexed modes, spatial_loop.py and compute_lane.py for the
co-located modes' step on two lanes, sis_window.py for SIS's whole-GPU window), config.py
(`SimConfig`, host-time charges), op.py (lane latencies), workload.py (arrivals), metrics.py,
cluster.py and router.py (several GPUs behind a router), sweep/ (rate sweeps, best-temporal,
figures), multiturn/ (the multi-turn workload), cli.py (`spaceserve sim`).
"""

from spaceserve.runtime.sim.cluster import ROUTERS, SimResult, simulate
from spaceserve.runtime.sim.engine import MODES, SimConfig, Simulator, default_allowed
from spaceserve.runtime.sim.metrics import summarize
from spaceserve.runtime.sim.workload import RESOLUTIONS, Request, Workload, generate

__all__ = ["MODES", "RESOLUTIONS", "ROUTERS", "Request", "SimConfig", "SimResult", "Simulator",
           "Workload", "default_allowed", "generate", "simulate", "summarize"]
