"""The co-located step's compute stream in the simulator (`spatial_loop.SpatialLoop`'s side
of it), as the engine's `SpatialRuntime` and `SpatialEncoderStage` run it: one stream, first in
first out, of compute-partition prefill chunks and encoder launches (TWSRFT layer chunks, each
request's layers priced on their own, as the engine launches them) on the partition's encoder
SMs; the cooperative driver's launches beside each decode step (``layer_launch_s`` of host time
each, at most `MAX_INFLIGHT` launches incomplete); the hand-off of finished embeddings and
first tokens at the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.sim.op import Op

MAX_INFLIGHT = 2  # the encoder stage's launches incomplete at once

@dataclass
class Launch:
    """Work queued on the compute stream: a prefill batch or an encoder launch (the requests
    whose last layer it runs)."""

    kind: str
    sms: int
    fn: Any
    payload: Any
    done: bool = False


@dataclass
class _Grant:  # the TWSRFT grant being launched: its live requests, layers launched
    grant: Any
    live: list[int]
    done: int = 0


@dataclass
class _Lane:
    """The compute stream: launched work not finished, and what the host has not seen yet."""

    stream: deque = field(default_factory=deque)
    flights: deque = field(default_factory=deque)  # encoder launches not yet polled
    prefills: deque = field(default_factory=deque)  # compute prefills not yet collected


class ComputeLane:
    """The compute stream of one simulated GPU's co-located step (module docstring); a base of
    `SpatialLoop`, which sets the attributes annotated here."""

    sim: Any
    sched: Any
    curves: Any
    total: int
    depth: int
    current: int
    paused: bool
    pc: float
    lane: _Lane
    open: _Grant | None
    twsrft: Any  # the stage's RankedTwsrft
    active: dict[int, int]
    held: set[int]
    encoded: set[int]
    busy: set[int]
    backlog: deque
    blocked: Any
    num_compute_prefills: int
    account: Callable[[Any], None]  # StepLoop's
    step_seconds: Callable[..., float]  # stepped.batch_seconds (kept out of this module's imports)

    def _sms(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs) of the current partition (the full one: both all)."""
        e = self.current
        return (e, self.total - e) if e else (self.total, self.total)

    def _launch_prefill(self, pre: Any) -> None:
        curves = self.curves
        item = Launch("prefill", self._sms()[0],
                      lambda n, o: self.step_seconds(curves, pre, n, o, "encoder"), pre)
        self.lane.prefills.append(item)
        self._enqueue(item)
        self.busy.update(r.seq_no for r in pre.reqs)
        self.num_compute_prefills += 1

    def _wait(self) -> bool:
        """Nothing to run: wait for the oldest compute prefill, else the oldest incomplete
        encoder launch; False when nothing is in flight."""
        lane = self.lane
        waiting = lane.prefills[0] if lane.prefills else \
            next((f for f in lane.flights if not f.done), None)
        self.blocked = waiting
        return waiting is not None

    # -- the compute stream -----------------------------------------------------------------
    def _enqueue(self, item: Launch) -> None:
        self.lane.stream.append(item)
        if "compute" not in self.sim.ops:
            self._run_next()

    def _run_next(self) -> None:
        item = self.lane.stream[0]
        self.sim.ops["compute"] = Op("compute", item.kind, item.sms, item.fn, item)

    def _complete_compute(self, op: Op) -> None:
        """A compute launch ended now: done (seen by the host at its next step)."""
        item = self.lane.stream.popleft()
        assert item is op.payload
        item.done = True
        if self.lane.stream:
            self._run_next()

    def _poll(self) -> None:
        """Attach the embeddings of finished encoder launches (oldest first)."""
        flights = self.lane.flights
        while flights and flights[0].done:
            for rid in flights.popleft().payload:
                if self.active.pop(rid, None) is not None:
                    self.held.add(rid)
                    self.encoded.add(rid)
                    self.sim.requests[rid].encoded_at = self.sim.now

    def _collect(self) -> None:
        """Account finished compute-partition prefills: their first tokens come out now."""
        prefills = self.lane.prefills
        while prefills and prefills[0].done:
            batch = prefills.popleft().payload
            for r in batch.reqs:
                self.busy.discard(r.seq_no)
            self.account(batch)

    # -- the encoder's launches (the cooperative driver) ------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self.backlog) + len(self.active)

    def _incomplete(self) -> int:  # encoder launches not finished
        return sum(1 for f in self.lane.flights if not f.done)

    def _launch(self, budget_s: float | None = None) -> int:
        """Launch encoder layers for about `budget_s` of host time (the driver's default
        budget without one; at least one layer); returns the launches made."""
        c = self.sim.config
        deadline = self.pc + (c.launch_budget_s if budget_s is None else budget_s)
        n = 0
        while self.current and not self.paused \
                and self._incomplete() < MAX_INFLIGHT and self._launch_layers(deadline, False):
            n += 1
            if self.pc >= deadline:
                break
        return n

    def _open_grant(self) -> _Grant | None:
        if self.open is not None and not any(r in self.active for r in self.open.live):
            self.twsrft.report(self.open.grant.job_id, self.open.grant.layers, 0)  # all ended
            self.open = None
        while self.open is None:
            grant = self.twsrft.next_grant(0)
            if grant is None:
                return None
            live = [r for r in grant.request_ids if r in self.active]
            if live:
                self.open = _Grant(grant, live)
            else:
                self.twsrft.report(grant.job_id, grant.layers, 0)
        return self.open

    def _launch_layers(self, deadline: float, whole: bool) -> Launch | None:
        """Layers of the open grant, one at a time for each of its requests, until the grant
        ends or the host budget is spent (at least one), as one launch (None: nothing)."""
        g = self._open_grant()
        if g is None:
            return None
        step_s = self.sim.config.layer_launch_s
        ran: dict[int, int] = {}
        finished: list[int] = []
        while True:
            g.live = [r for r in g.live if r in self.active]
            for rid in list(g.live):
                self.active[rid] += 1
                ran[rid] = ran.get(rid, 0) + 1
                self.pc += step_s
                if self.active[rid] >= self.depth:
                    finished.append(rid)
                    g.live.remove(rid)
            g.done += 1
            if g.done >= g.grant.layers or not g.live or self.pc >= deadline:
                break
        curves, reqs = self.curves, self.sim.requests
        work = [(reqs[r].patches, k) for r, k in ran.items()]
        sms = self.total if (whole or not self.current) else self.current
        item = Launch("encode", sms, lambda n, o: sum(curves.encoder(p, k, n, o)
                                                      for p, k in work), finished)
        self.lane.flights.append(item)
        self._enqueue(item)
        if g.done >= g.grant.layers or not g.live:
            self.twsrft.report(g.grant.job_id, g.grant.layers, 0)
            self.open = None
        return item
