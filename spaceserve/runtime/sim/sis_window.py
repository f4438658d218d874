"""The simulator's execution of SIS's whole-GPU window (``sis_actions`` superset, spatial mode).

Once the running decode step ends, encoder layers (TWSRFT's grants, cut to what is left of the
window) run alone on every SM until the window SIS sized for the current state
(`SpaceInferenceScheduler.window`) is spent; then one decode step runs on the whole device,
carrying a prompt's prefill chunk (the window's placement is "decode", as in the engine), and
SIS decides again. This is what ``temporal-chunked`` does between its decode steps,
chosen per round by SIS's goodput prediction instead of always.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spaceserve.runtime.sim.op import Op


def dispatch_sis_window(sim: Any) -> bool:
    """If SIS's split on `sim` (a `Simulator`) is a whole-GPU window, start the window's next op
    once the lanes are free and return True; else forget any window and return False. The
    simulator's SIS counts its actions: ``sim.sis.action_counts()``."""
    if sim.split is None or sim.split.encoder_sms < sim.total:
        sim._sis_window_at = None
        return False
    _next_op(sim)
    return True


def _next_op(sim: Any) -> None:
    if sim.ops:
        return  # the decode step in flight hands its SMs back first
    window = sim.sis.window(sim.sis_state())
    if getattr(sim, "_sis_window_at", None) is None:
        sim._sis_window_at = sim.now  # when the window began
    left = window - (sim.now - sim._sis_window_at)
    c, n = sim.curves, sim.total
    if left > 0 and sim._encoder_waiting():
        g = sim.sched.next_grant()
        per_layer = c.encoder(g.patches, 1, n)
        layers = max(1, min(g.layers, math.ceil(left / per_layer - 1e-9)))
        g = dataclasses.replace(g, layers=layers)
        sim.ops["compute"] = Op("compute", "encode", n,
                                lambda k, o: c.encoder(g.patches, g.layers, k, o), g)
    elif sim.decoding or sim.prefill_q:
        sim._sis_window_at = None
        sim._start_decode(n)
    else:  # nothing decodes or prefills: a spent window is followed at once by the next
        sim._sis_window_at = None
        if window > 0 and left <= 0 and sim._encoder_waiting():
            _next_op(sim)
        return
    sim._last_kind = "compute" if "compute" in sim.ops else "decode"
