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
  decoder SMs, plus the step's host time (a pipelined step's runs on the host lane instead);
- the compute lane: one stream, first in first out: prefill chunks and encoder launches (TWSRFT
  layer chunks, each request's layers priced on their own, as the engine launches them) on the
  partition's encoder SMs.
Co-running ops take their co-running latency (`engine.Simulator`). SIS's whole-GPU windows
(``sis_actions`` superset) run as the engine's step runs them (`sis_window.window_launch`).
While SIS takes turns, with ``async_scheduling``, decode steps are pipelined as the engine's
(`SpatialRuntime.pipelining`): the step's host time runs on a ``host`` lane (the host is busy,
the device is not), its decode step queues on the decode lane behind the one in flight and not
before that host time has passed, and the step then reads back the one launched before (waiting
for it if it draws tokens); a step that must settle it (encoder work waiting, a split change,
leaving turns, nothing to decode) waits for it and ends there, so the next step drains the
arrivals, embeddings and freed slots of that wait before it plans (as temporal-chunked's does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spaceserve.runtime.encoder.data_parallel import RankedTwsrft
from spaceserve.runtime.policy.sis_goodput import order_encoder
from spaceserve.runtime.policy.sis_state import PendingEncode, SisState
from spaceserve.runtime.sim.loops.compute_lane import ComputeLane, _Grant, _Lane
from spaceserve.runtime.sim.loops.sis_window import window_launch
from spaceserve.runtime.sim.loops.stepped import StepLoop, batch_seconds
from spaceserve.runtime.sim.op import Op
from spaceserve.runtime.sim.workload import Request

MAX_COMPUTE_PREFILLS = 2  # spatial.step's: compute-partition prefills in flight at once


@dataclass
class Piped:
    """A decode step on the decode lane (which runs them in launch order): `seconds` on `sms`,
    not before `start` (its host time); `sync`: the host waits for it and reads it back at once,
    else it is left in flight (pipelined) and read back by a later step."""

    batch: Any
    sms: int
    seconds: Callable[[int, int | bool], float]
    start: float
    sync: bool = False
    done: bool = False
    after: Any = None  # a window's last launch it is ordered behind on the device

    @property
    def waits(self) -> bool:
        """Whether reading it back waits for the device: it is running and draws tokens (a
        step of prefill chunks alone has nothing to read back)."""
        return not self.done and bool(self.batch.drawn_reqs)
CONTEXT_BUCKET = 64  # spatial.step's: SIS sees the mean decode context rounded to this


class SpatialLoop(ComputeLane, StepLoop):
    """The engine's co-located step for one simulated GPU (module docstring)."""

    step_seconds = staticmethod(batch_seconds)

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
        self.blocked: Any = None  # what the host waits for (a compute launch)
        self.pc = 0.0  # host seconds spent launching encoder layers (the driver's budget)
        self.window = self.encoder_turn = False
        self.num_windows = self.num_compute_prefills = 0
        self.last_split: Any = None
        # pipelined decode steps while taking turns (`SpatialRuntime.pipelining`)
        self.inflight: Piped | None = None  # the engine's `_inflight`: launched, not read back
        self.reading: Piped | None = None  # the step this one reads back once its host time ran
        self.queued: deque[Piped] = deque()  # steps launched behind the running one
        self.resume: str | None = None  # where a step the host waited in goes on
        self.num_pipelined = 0
        self.after: Any = None  # the last window the host did not wait for (`window_launch`)
        self.parked: Piped | None = None  # a decode step waiting for that window to end
        self.num_hidden = 0

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
            req = self.twsrft.take(self.backlog, lambda r: (self.arrived.get(r.rid), r.patches))
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
            if "host" in sim.ops or (self.blocked is not None and not self.blocked.done):
                return  # the host is busy, or waits for a step's tokens or a launch
            self.blocked = None
            if not self._step():
                return
        raise RuntimeError(f"the simulated engine spun at t={sim.now} without waiting")

    def _step(self) -> bool:
        """One engine step now; False when it did nothing (the host idles until an arrival)."""
        resume, self.resume = self.resume, None
        if resume == "read":  # the end of a step: read back the step it left in flight
            return self._read(self.reading)
        if resume == "tail":  # the step waited for the step in flight: it ends on reading it
            self._settle()
            return True
        self._drain()
        self._admit()
        self._poll()
        self._admit()
        self._collect()
        if self.inflight is not None and not self._may_pipeline():
            if self.inflight.waits:
                self.blocked, self.resume = self.inflight, "tail"
            else:
                self._settle()
            return True  # the next step sees what arrived, finished and freed meanwhile
        if not self._choose():  # the step in flight is read back first; the step ends there
            self.reading, self.inflight = self.inflight, None
            return self._read(self.reading)
        if self.window and self._window_step():
            return True
        with self.turn_budget(self.sched, self.sim.sis, self.window, self.current > 0):
            batch = self._schedule()
        if self.window and not batch and self._window_ready():  # nothing decodes: encode
            self.encoder_turn = True
            return window_launch(self)
        on_compute = self.placement == "compute" and self.current > 0 \
            and len(self.lane.prefills) < MAX_COMPUTE_PREFILLS
        dec, pre = self.split_batch(batch) if on_compute else ((batch or None), None)
        if pre is not None:
            self._launch_prefill(pre)
        if dec is None and self.inflight is not None:  # nothing to plan beside it
            self.reading, self.inflight = self.inflight, None
            return self._read(self.reading)
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

    def _launch_decode(self, dec: Any) -> None:
        c, curves = self.sim.config, self.curves
        host = c.host_s + (c.sis_host_s if self.spatial else 0.0)
        if self.pipelining:
            self._pipeline(dec, host)
            return
        rec = Piped(dec, self._sms()[1], lambda n, o: batch_seconds(curves, dec, n, o) + host,
                    self.sim.now, sync=True, after=self.after)
        self._queue(rec)
        self.blocked = rec  # the host waits for its tokens

    # -- pipelined decode steps while taking turns (`SpatialRuntime.pipelining`) -------------
    @property
    def pipelining(self) -> bool:
        c, sis = self.sim.config, self.sim.sis
        return c.async_scheduling and sis is not None and sis.turns and self.current == 0

    def _may_pipeline(self) -> bool:
        return self.pipelining and not self.num_pending and not self.lane.prefills

    def _pipeline(self, dec: Any, host: float) -> None:
        """The engine's host spends `host` seconds planning and launching `dec` (left in flight),
        which runs once the decode lane is free and that time has passed; then it reads back
        the step launched before, if any."""
        curves = self.curves
        rec = Piped(dec, self.total, lambda n, o: batch_seconds(curves, dec, n, o),
                    self.sim.now + host, after=self.after)
        self.num_pipelined += 1
        previous, self.inflight = self.inflight, rec
        self._queue(rec)
        if host > 0:
            self.sim.ops["host"] = Op("host", "host", 0, lambda n, o: host, None)
        if previous is not None:
            self.reading, self.resume = previous, "read"

    def _queue(self, rec: Piped) -> None:
        """Launch `rec` on the decode lane: it runs after the steps launched before it and
        the window it is ordered behind."""
        if "decode" in self.sim.ops or self.parked is not None:
            self.queued.append(rec)
            return
        if rec.after is not None and not rec.after.done:
            self.parked = rec
            return
        delay = max(0.0, rec.start - self.sim.now)
        self.sim.ops["decode"] = Op("decode", "decode", rec.sms,
                                    lambda n, o: delay + rec.seconds(n, o), rec)

    def _read(self, rec: Piped | None) -> bool:
        """Read back `rec` (wait for it first); its tokens come out now."""
        assert rec is not None
        if rec.waits:
            self.blocked, self.resume = rec, "read"
            return True
        self.reading = None
        self._account_piped(rec)
        return True

    def _settle(self) -> None:
        rec, self.inflight = self.inflight, None
        assert rec is not None and not rec.waits
        self._account_piped(rec)

    def _account_piped(self, rec: Piped) -> None:
        self.num_steps += 1
        self.account(rec.batch)
        sis = self.sim.sis  # SIS measures the turns' intervals (`SpatialRuntime._read_back`)
        if sis is not None and rec.batch.drawn_reqs:
            sis.spread.read(self.sim.now, sis.turns and self.current == 0)

    def complete(self, op: Op) -> None:
        """An op ended now: the decode step's tokens are read back; a compute launch is done
        (seen by the host at its next step)."""
        if op.lane == "host":  # the host's planning of a pipelined step is done
            return
        if op.lane == "decode":
            rec: Piped = op.payload  # type: ignore[assignment]
            rec.done = True
            if self.queued:
                self._queue(self.queued.popleft())
            if rec.sync:  # the host waited for its tokens; a pipelined one is read back later
                self._account_piped(rec)
            return
        self._complete_compute(op)
        if self.parked is not None and self.parked.after.done:
            rec, self.parked = self.parked, None
            self._queue(rec)

    def _window_ready(self) -> bool:
        return self.current == 0 and not self.paused and self.num_pending > 0

    def _window_step(self) -> bool:  # SIS's whole-GPU window: every other step the encoder's
        if not self._window_ready() or self.sim.sis.hold:  # passed: `hold_encoder`
            self.encoder_turn = False  # a decode step runs: the next window comes first
            return False
        self.encoder_turn = not self.encoder_turn
        return self.encoder_turn and window_launch(self, hide=True)

    # -- splits and placement ---------------------------------------------------------------
    def _choose(self) -> bool:
        """SIS's split and placement (`SpatialRuntime._choose`); False when the decode step in
        flight must be read back first."""
        sim, c = self.sim, self.sim.config
        if self.spatial:
            split = sim.sis.decide(self.sis_state())
            sim.split = self.last_split = split
            order_encoder(self.twsrft.scheds, sim.sis.turns, self.plan.deadline_s,
                          sim.sis.turns_order)
            self.window = split.encoder_sms >= self.total
            target = 0 if self.window else split.encoder_sms
            auto = split.prefill_on
        else:
            target, auto = c.static_encoder_sms, "compute"
        self.placement = auto if c.prefill_on == "auto" else c.prefill_on
        if self.inflight is not None and (target != self.current or not self.pipelining):
            return False
        if target == self.current:
            self.paused = False
            return True
        self.paused = True  # the switch waits until the compute side is idle
        if not self._incomplete() and not self.lane.prefills:
            self.current = target
            sim.splits.append((sim.now, target))
            self.paused = False
        return True

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
                "windows": self.num_windows, "pipelined": self.num_pipelined,
                "hidden_windows": self.num_hidden}
