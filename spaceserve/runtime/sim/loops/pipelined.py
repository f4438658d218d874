"""The time-multiplexed modes' step loop pipelined, as the engine runs it with asynchronous
scheduling (``async_scheduling``, the default; `engine.Engine.step`).

The engine's host runs one step ahead of the device: step n+1 is planned - arrivals drained,
encoder jobs admitted into the held slots, the encoder's window (or ``temporal``'s passes)
launched, the continuous batch scheduled with a placeholder for every draw of step n - and
launched before step n's tokens are read back; then the host waits for them. So what the host
learns from step n (requests finished, their held-embedding slots freed) reaches step n+2, and
a request that arrives while step n runs is drained when step n's tokens are read back, into the
step planned then (n+2): it waits one more interval than in the unpipelined loop, where every
step is planned once the one before has finished. In exchange the host's time (``host_s``) runs
while the device computes: a decode step starts no earlier than its host time after its
planning began. While the encoder stage has work left (a job, or a request waiting for a held
slot) the engine reads a step back at once instead - the next window runs after it anyway, and
the host plans the next step while that window runs. A request is ready to prefill once its
encoder work is launched (the device runs the window before the step that prefills it); its
``encoded_at`` is when the window ends.

A host step that launches encoder work and no batch does not wait (nothing is read back): the
next is planned at once, as the engine's loop calls `step` again. The device runs the launches
in order, one at a time, each on the whole GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.sim.loops.stepped import StepLoop, batch_seconds
from spaceserve.runtime.sim.op import Op
from spaceserve.runtime.sim.workload import Request


@dataclass
class _Launch:
    """Work the host launched, in device order: an encoder op (`done`: the requests whose
    embeddings it finishes) or a decode step (`batch`, not before `ready_at`)."""

    seconds: float
    batch: Any = None
    done: list[Request] = field(default_factory=list)
    ready_at: float = 0.0
    finished: bool = False


class PipelinedStepLoop(StepLoop):
    """`StepLoop` with the engine's asynchronous scheduling (module docstring)."""

    def __init__(self, sim: Any, policy: str, deadline_s: float | None, engine: Any) -> None:
        super().__init__(sim, policy, deadline_s, engine)
        self.device: deque[_Launch] = deque()  # launched, not yet started on the device
        self.inflight: _Launch | None = None  # the last decode step launched, not read back
        self.reads: deque[_Launch] = deque()  # steps the host reads back, in order
        self.waiting: _Launch | None = None  # the one it waits for
        self.host_t = 0.0  # the host's clock: each step's planning takes ``host_s``
        self.num_pipelined = 0

    # -- the host ---------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Run host steps while the host is free, then start the next launch on a free GPU."""
        if self.waiting is None:
            self._host()
        self._start()

    def _host(self) -> None:
        for _ in range(100_000):
            while self.reads:  # steps the host reads back before it plans the next
                rec = self.reads[0]
                if not rec.finished:
                    self.waiting = rec
                    return
                self.reads.popleft()
                self._read(rec)
            previous, planned = self.inflight, self._plan()
            self.inflight = planned
            if previous is not None:
                self.reads.append(previous)
            if planned is not None and self._pending():  # the engine reads it back at once
                self.reads.append(planned)
                self.inflight = None
            if self.reads:
                continue
            if planned is None and not self._encoding():
                return  # idle, or only launched encoder work runs: the next event goes on
        raise RuntimeError(f"the simulated engine spun at t={self.sim.now} without waiting")

    def _pending(self) -> bool:
        """Whether the encoder stage has work left (waiting for a window or a held slot)."""
        return bool(self.backlog or (self.chunked and self.twsrft.jobs()))

    def _encoding(self) -> bool:
        """Whether encoder work could launch now (the host then plans another step at once)."""
        room = len(self.held) + len(self.jobs) < self.sim.config.max_held
        if self.chunked:
            return any(not j.running for j in self.twsrft.jobs()) or bool(self.backlog and room)
        return bool(self.backlog and room)

    def _plan(self) -> _Launch | None:
        """One host step: drain, admit, launch the encoder's work and the step's batch; returns
        the decode step launched (None: no batch)."""
        self._drain()
        self._admit()
        done, t = self._window() if self.chunked else self._passes()
        if t > 0.0:
            for req in done:  # ready to prefill: the window runs before the step that does
                self.jobs.discard(req.rid)
                if req.finish is None and not req.shed:
                    self.encoded.add(req.rid)
                    self.held.add(req.rid)
            self.device.append(_Launch(t, done=done))
        self._admit()
        batch = self.sched.schedule()
        if not batch:
            return None
        self.num_preemptions += len(batch.preempted)
        self.host_t = max(self.host_t, self.sim.now) + self.sim.config.host_s
        launch = _Launch(batch_seconds(self.curves, batch, self.total), batch,
                         ready_at=self.host_t)
        self.device.append(launch)
        self.num_pipelined += 1
        return launch

    def _read(self, launch: _Launch) -> None:
        """Step `launch`'s tokens are read back now."""
        self.num_steps += 1
        self.account(launch.batch)

    # -- the device -------------------------------------------------------------------------
    def _start(self) -> None:
        sim = self.sim
        if sim.ops or not self.device:
            return
        launch = self.device.popleft()
        if launch.batch is None:
            sim.ops["compute"] = Op("compute", "encode", self.total,
                                    lambda n, o, t=launch.seconds: t, launch)
            return
        t = max(0.0, launch.ready_at - sim.now) + launch.seconds
        sim.ops["decode"] = Op("decode", "decode", self.total, lambda n, o, t=t: t, launch)

    def complete(self, op: Op) -> None:
        """A launch ended now: an encoder op's requests are encoded; a decode step's tokens are
        read back if the host waits for them (else by the host step that reads it back)."""
        launch: _Launch = op.payload  # type: ignore[assignment]
        launch.finished = True
        if launch.batch is None:
            for req in launch.done:
                req.encoded_at = self.sim.now
            return
        if self.waiting is launch:
            self.waiting = None
            self.reads.popleft()
            self._read(launch)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pipelined": self.num_pipelined}
