"""The co-located modes in the simulator: the engine's spatial step (`spatial.step`), priced by
curves.

``spatial`` and ``spatial-static`` run what `SpatialRuntime.step` runs, on two lanes:
- the host: each step drains arrivals into the engine's `core.Scheduler` and the encoder stage
  (at most ``max_held`` requests holding or computing embeddings), attaches finished encoder
  launches' embeddings, collects finished compute-partition prefills (first tokens), lets SIS
  choose the split and prefill's place (a split change waits for an idle compute side),
  schedules one continuous batch and cuts it (prefill chunks to the compute stream, at most
  two in flight, with prefill on the compute partition); launches the decode step, then
  encoder layers for the step's host budget (``layer_launch_s`` each, at most two launches
  incomplete), and waits for the decode's tokens. A step without decodes launches encoder
  layers or, with nothing launched, waits for the compute stream's oldest item;
- the decode lane: the step's decodes (and the prefill chunks kept there) on the partition's
  decoder SMs, plus the step's host time;
- the compute lane: one stream, first in first out: prefill chunks and encoder launches (TWSRFT
  layer chunks, each request's layers priced on their own, as the engine launches them) on the
  partition's encoder SMs.
Co-running ops take their co-running latency (`engine.Simulator`). SIS's whole-GPU windows
(``sis_actions`` superset) run as the engine's step runs them (`sis_window.window_launch`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.encoder.data_parallel import RankedTwsrft
from spaceserve.runtime.policy.sis_state import PendingEncode, SisState
from spaceserve.runtime.sim.op import Op
from spaceserve.runtime.sim.sis_window import window_launch
from spaceserve.runtime.sim.stepped import StepLoop, batch_seconds
from spaceserve.runtime.sim.workload import Request

MAX_COMPUTE_PREFILLS = 2  # spatial.step's: compute-partition prefills in flight at once
MAX_INFLIGHT = 2  # the encoder stage's launches incomplete at once
CONTEXT_BUCKET = 64  # spatial.step's: SIS sees the mean decode context rounded to this


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


class SpatialLoop(StepLoop):
    """The engine's co-located step for one simulated GPU (module docstring)."""

    def __init__(self, sim: Any, engine: Any) -> None:
        super().__init__(sim, "twsrft", None, engine)
        self.split_batch, self.turn_budget = engine.split_batch, engine.turn_budget
        c, curves = sim.config, sim.curves
        self.spatial = c.mode == "spatial"
        plan = sim.policy if self.spatial else None
        self.plan = plan
        self.depth = curves.encoder_depth
        self.current = 0 if self.spatial else c.static_encoder_sms  # 0: the full partition

        def cost(patches: int, layers: int) -> float:  # the stage's TWSRFT cost
            return curves.encoder(patches, layers, self.current or self.total, True)

        self.twsrft = RankedTwsrft(
            1, self.depth, cost, policy="twsrft", window_s=c.window_s or 0.02,
            max_wait_s=plan.max_wait_s if plan else c.max_wait_s,
            token_budget=plan.token_budget if plan else 1,
            deadline_s=plan.deadline_s if plan else None,
            overdue_s=plan.overdue_s if plan else None, clock=lambda: sim.now)
        self.lane = _Lane()
        self.active: dict[int, int] = {}  # rid -> layers run, while its embeddings compute
        self.arrived: dict[int, float] = {}  # rid -> when the encoder stage took it
        self.busy: set[int] = set()  # seq_no of requests whose prefill is on the compute side
        self.open: _Grant | None = None
        self.paused = False
        self.placement = "compute"
        self.blocked: Launch | None = None  # what the host waits for (a compute launch)
        self.pc = 0.0  # host seconds spent launching encoder layers (the driver's budget)
        self.window = self.encoder_turn = False
        self.num_windows = self.num_compute_prefills = 0
        self.last_split: Any = None

    # -- requests ---------------------------------------------------------------------------
    def _drain(self) -> None:
        sim = self.sim
        while self.inbox:
            req = self.inbox.popleft()
            if req.patches > 0:  # the encoder stage's submit, then the scheduler's add
                self.backlog.append(req)
                self.arrived[req.rid] = sim.now
                sim.arrivals.add(sim.now, max(1, req.patches), req.prompt_tokens)
                self._admit()
            core = self._core(req, req.prompt_tokens, req.output_tokens)
            core.num_computed = req.cached_tokens
            self.sched.add(core)

    def _admit(self) -> None:
        while self.backlog and len(self.held) + len(self.active) < self.sim.config.max_held:
            req = self.backlog.popleft()
            self.active[req.rid] = 0
            self.twsrft.submit(req.rid, max(1, req.patches), self.twsrft.pick(),
                               arrival=self.arrived.get(req.rid))

    def release(self, req: Request) -> None:
        super().release(req)
        self.arrived.pop(req.rid, None)
        self.active.pop(req.rid, None)  # ended while encoding: its grants skip it from now on

    # -- the host ---------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Start queued compute work on a free compute lane, then run engine steps while the
        host is not waiting for the device."""
        sim = self.sim
        if "compute" not in sim.ops and self.lane.stream:
            self._run_next()
        for _ in range(10_000):
            if "decode" in sim.ops or (self.blocked is not None and not self.blocked.done):
                return
            self.blocked = None
            if not self._step():
                return
        raise RuntimeError(f"the simulated engine spun at t={sim.now} without waiting")

    def _step(self) -> bool:
        """One engine step now; False when it did nothing (the host idles until an arrival)."""
        self._drain()
        self._admit()
        self._poll()
        self._admit()
        self._collect()
        self._choose()
        if self.window and self._window_step():
            return True
        with self.turn_budget(self.sched, self.sim.sis, self.window and not self.current):
            batch = self._schedule()
        if self.window and not batch and self._window_ready():  # nothing decodes: encode
            self.encoder_turn = True
            return window_launch(self)
        on_compute = self.placement == "compute" and self.current > 0 \
            and len(self.lane.prefills) < MAX_COMPUTE_PREFILLS
        dec, pre = self.split_batch(batch) if on_compute else ((batch or None), None)
        if pre is not None:
            self._launch_prefill(pre)
        if dec is None:
            if not self._launch() and pre is None:
                return self._wait()
            return True
        self._launch_decode(dec)
        budget = None
        if self.plan is not None and self.last_split is not None:
            budget = self.plan.launch_budget(self.last_split.predicted_tpot_s)
        self._launch(budget)
        return True

    def _schedule(self) -> Any:
        sched = self.sched
        if not self.busy:
            return sched.schedule()
        hidden = [r for r in sched.running if r.seq_no in self.busy]
        sched.running = [r for r in sched.running if r.seq_no not in self.busy]
        try:
            return sched.schedule()
        finally:
            sched.running = hidden + sched.running

    def _sms(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs) of the current partition (the full one: both all)."""
        e = self.current
        return (e, self.total - e) if e else (self.total, self.total)

    def _launch_decode(self, dec: Any) -> None:
        c, curves = self.sim.config, self.curves
        host = c.host_s + (c.sis_host_s if self.spatial else 0.0)
        self.sim.ops["decode"] = Op("decode", "decode", self._sms()[1],
                                    lambda n, o: batch_seconds(curves, dec, n, o) + host, dec)

    def _launch_prefill(self, pre: Any) -> None:
        curves = self.curves
        item = Launch("prefill", self._sms()[0],
                      lambda n, o: batch_seconds(curves, pre, n, o, "encoder"), pre)
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

    def complete(self, op: Op) -> None:
        """An op ended now: the decode step's tokens are read back; a compute launch is done
        (seen by the host at its next step)."""
        if op.lane == "decode":
            self.num_steps += 1
            self.account(op.payload)
            return
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

    def _window_ready(self) -> bool:
        return self.current == 0 and not self.paused and self.num_pending > 0

    def _window_step(self) -> bool:  # SIS's whole-GPU window: every other step the encoder's
        if not self._window_ready():
            return False
        self.encoder_turn = not self.encoder_turn
        return self.encoder_turn and window_launch(self)

    # -- splits and placement ---------------------------------------------------------------
    def _choose(self) -> None:
        sim, c = self.sim, self.sim.config
        if self.spatial:
            split = sim.sis.decide(self.sis_state())
            sim.split = self.last_split = split
            self.window = split.encoder_sms >= self.total
            target = 0 if self.window else split.encoder_sms
            auto = split.prefill_on
        else:
            target, auto = c.static_encoder_sms, "compute"
        self.placement = auto if c.prefill_on == "auto" else c.prefill_on
        if target == self.current:
            self.paused = False
            return
        self.paused = True  # the switch waits until the compute side is idle
        if not self._incomplete() and not self.lane.prefills:
            self.current = target
            sim.splits.append((sim.now, target))
            self.paused = False

    def sis_state(self) -> SisState:
        """What the engine's SIS sees (`SpatialRuntime.sis_state`)."""
        now, sched = self.sim.now, self.sched

        def left(core: Any) -> int:
            return len(core.token_ids) + core.num_placeholders - max(core.num_computed,
                                                                     core.prefix_hint)

        encode = []
        for job in self.twsrft.jobs():
            prompt = sum(left(self.core[r]) for r in job.request_ids if r in self.core)
            encode.append(PendingEncode(job.patches, max(1, job.layers_left), prompt,
                                        max(0.0, now - job.arrival), len(job.request_ids)))
        for req in self.backlog:
            encode.append(PendingEncode(max(1, req.patches), self.depth,
                                        left(self.core[req.rid]),
                                        max(0.0, now - self.arrived.get(req.rid, now))))
        prefill, ages = [], []
        for core in sched.waiting:
            req = self.sim_of[core.seq_no]
            if req.patches <= 0 or req.rid in self.encoded:
                prefill.append(left(core))
                ages.append(self._age(req))
        decoding = context = 0
        for core in sched.running:
            n = len(core.token_ids) + core.num_placeholders - core.num_computed
            if n > 1:
                prefill.append(n)
                ages.append(self._age(self.sim_of[core.seq_no]))
            else:
                decoding += 1
                context += len(core.token_ids)
        mean = context / decoding if decoding else 0.0
        rate, patches, prompt = self.sim.arrivals.estimate(now)
        return SisState(tuple(encode), tuple(prefill), decoding,
                        round(mean / CONTEXT_BUCKET) * CONTEXT_BUCKET, tuple(ages), rate,
                        patches, prompt)

    def _age(self, req: Request) -> float:
        return max(0.0, self.sim.now - self.arrived.get(req.rid, self.sim.now))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "compute_prefills": self.num_compute_prefills,
                "windows": self.num_windows}
