"""Discrete-event simulation of SpaceServe's schedulers on resource-utility curves.

The simulator drives the real `TwsrftScheduler` and `SpaceInferenceScheduler`, so the figure
"decode TPOT against image request rate" exists before the engine does.
"""

from spaceserve.runtime.sim.cluster import ROUTERS, SimResult, simulate
from spaceserve.runtime.sim.engine import MODES, SimConfig, Simulator, default_allowed
from spaceserve.runtime.sim.metrics import summarize
from spaceserve.runtime.sim.workload import RESOLUTIONS, Request, Workload, generate

__all__ = ["MODES", "RESOLUTIONS", "ROUTERS", "Request", "SimConfig", "SimResult", "Simulator",
           "Workload", "default_allowed", "generate", "simulate", "summarize"]
