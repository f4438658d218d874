"""The simulator's execution of SIS's whole-GPU window (``sis_actions`` superset, spatial mode).

`window_launch`: the co-located step's encoder step in a window (`spatial_loop`), what the
engine's `SpatialEncoderStage.launch_window` runs. `dispatch_sis_window`: a data-parallel
encoder's window on the event loop:

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


def window_launch(loop: Any, hide: bool = False) -> bool:
    """One window on `loop` (a `SpatialLoop`), as temporal-chunked runs it: TWSRFT grants sized
    to what is left of SIS's window, on every SM, until their predicted time fills it (at least
    one launch). The host then waits for the last (the decoder is paused) - with `hide`, only
    for the last launch that finishes a request's embeddings, if any, and the decode steps
    launched next start no earlier than the window's end (`loop.after`), as the engine's
    `SpatialRuntime._window_launch`. False when nothing could launch."""
    w, scheds = loop.sim.sis.last_window_s, loop.twsrft.scheds
    old = [s.window_s for s in scheds]
    spent, last, finish = 0.0, None, None
    try:
        while spent < w or last is None:
            for s in scheds:
                s.window_s = max(w - spent, 1e-9)
            item = loop._launch_layers(math.inf, True)
            if item is None:
                break
            spent += item.fn(loop.total, False)
            last = item
            finish = item if item.payload else finish
    finally:
        for s, v in zip(scheds, old, strict=True):
            s.window_s = v
    if last is None:
        return False
    loop.num_windows += 1
    if not hide:
        loop.blocked = last
        return True
    loop.after = last
    if finish is not last:
        loop.num_hidden += 1
    loop.blocked = finish
    return True
