"""The spatial encoder stage's launches: TWSRFT grants issued layer by layer, one event each.

`SpatialEncoderStage` (spatial.py) owns the requests, their jobs and the hand-off of embeddings;
this side, `EncoderLaunches`, turns the open TWSRFT grant into launches on the current
partition's encoder stream under its encoder budget, records one event after each launch (a
`Flight`) and keeps at most `max_inflight` of them incomplete on the device.

Drivers (who issues the launches; a grant is launched layer by layer either way):
- ``cooperative`` (default): the engine thread, right after launching a decode step and before
  reading its tokens, for at most `launch_budget_s` of host time (at least one layer). Launches
  are asynchronous on a GPU, so this overlaps the decode step's device time; nothing competes
  for the GIL. The encoder's launch rate is bounded by that budget per decode step.
- ``thread``: a worker launches whole grants and waits on their events, yielding the GIL
  between layers; the engine thread still waits for it when it needs the GIL mid-layer.
Measured on CPU, host side only (`bench/serving/colocation_driver.py` ``driver_experiment``: a model
whose device is a virtual clock with a queue per partition; launches burn host time holding the
GIL, reading tokens sleeps until the step's device time passed): with 12 x 20 us launches per
4 ms vision layer, 6 ms decode steps (0.5 ms host) at batch 32 and a 32-layer image every
120 ms, decode step gaps were p50 6.65 ms everywhere, p99 6.7-7.1 ms without images, 7.0-7.1
cooperative, 7.1-7.4 thread. With 12 x 100 us launches (2 ms layers, 8 ms decode, an image
every 60 ms): p50 / p99 8.7 / 8.8-9.0 without images, 8.7 / 9.1-9.3 cooperative, 9.0 /
10.3-10.9 thread (its bursts hold the GIL when decode wants it), but the thread launched all
1536 layers and the cooperative driver, held to 3 ms per step, about 1025. Hence cooperative by
default (decode launches on time); thread, or a larger budget, when encoder throughput matters
more than decode jitter. On CPU proper launches are synchronous: both drivers just interleave.

Data-parallel encoder (a tensor-parallel runner with ``encoder_ranks`` > 1): each rank has its
own TWSRFT queue (`encoder_dp.RankedTwsrft`) and its own open grant, at most `max_inflight`
launches incomplete per rank. A grant of another rank is sent whole (a few pipe writes, so
those ranks are served first each round); its flight's event is the runner's
`encoder_event` (the worker's progress counter), and flights of different ranks complete in any
order.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spaceserve.runtime.core.request import Request
from spaceserve.runtime.encoder.data_parallel import RankedTwsrft
from spaceserve.runtime.spatial.partition import PartitionSet


@dataclass
class Encoding:
    """One encoder job of a request: the media `items` it computes (`mm`, their patches)."""

    key: int
    req: Request
    patches: int
    state: str = "backlog"  # backlog -> active -> held | failed; released at the end
    job: Any = None
    layers_done: int = 0
    embeds: torch.Tensor | None = None
    items: list[int] = field(default_factory=list)
    mm: Any = None

    @property
    def released(self) -> bool:
        return self.state == "released"


@dataclass
class Flight:
    """One launched grant: its completion event, the jobs it finished and those that failed,
    and the rank it ran on."""

    event: Any
    done: list[Encoding] = field(default_factory=list)
    failed: list[tuple[Encoding, str]] = field(default_factory=list)
    rank: int = 0


@dataclass
class Grant:
    """A TWSRFT grant being launched: its live requests, how many layers were issued, and the
    rank whose queue it came from."""

    grant: Any
    live: list[Encoding]
    done: int = 0
    rank: int = 0


def event_complete(event: Any) -> bool:
    """Whether a launch's event has completed (None: nothing to wait for)."""
    return event is None or bool(event.query())


class EncoderLaunches:
    """The launch side of the spatial encoder stage (its base class; module docstring).

    The stage sets the attributes annotated below, then calls `_init_launches` and, once fully
    built, `_start_driver`.
    """

    runner: Any
    partitions: PartitionSet
    sched: RankedTwsrft
    ranks: int
    preemptible: bool
    num_layers: int
    _encodings: dict[int, Encoding]
    _lock: threading.RLock
    _cond: threading.Condition
    window_cost: Callable[[int, int], float]

    def _init_launches(self, driver: str, max_inflight: int, launch_budget_s: float,
                       event_factory: Callable[[], Any] | None) -> None:
        self.driver = driver
        self.max_inflight = max_inflight
        self.launch_budget_s = launch_budget_s
        self.event_factory = event_factory
        self._flights: deque[Flight] = deque()
        self._open: dict[int, Grant] = {}  # per rank, the grant whose layers are being launched
        self._paused = False
        self.whole_device = False  # SIS's whole-GPU window: launch on the full partition too
        self._launching = False
        self._stop = False
        self.num_grants = 0
        self.num_layers_run = 0
        self._thread: threading.Thread | None = None

    def _start_driver(self) -> None:
        if self.driver == "thread":
            self._thread = threading.Thread(target=self._worker, name="spaceserve-encoder",
                                            daemon=True)
            self._thread.start()

    def launch(self, budget_s: float | None = None) -> int:
        """Cooperative driver: launch encoder layers for about `budget_s` (default
        `launch_budget_s`) of host time (at least one layer; at most `max_inflight` launches
        incomplete on the device); returns how many launches (one event each). The thread
        driver returns 0."""
        if self.driver != "cooperative":
            return 0
        deadline = time.perf_counter() + (self.launch_budget_s if budget_s is None
                                          else budget_s)
        n = 0
        for rank in range(1, self.ranks):  # another rank's grant goes out whole, at once
            while self._can_launch(rank) and self._launch_layers(deadline, rank):
                n += 1
        while self._can_launch() and self._launch_layers(deadline):
            n += 1
            if time.perf_counter() >= deadline:
                break
        return n

    def launch_window(self, window_s: float) -> int:
        """SIS's whole-GPU window, as temporal-chunked runs it: TWSRFT grants sized to what is
        left of `window_s`, on every SM, until their predicted time (`window_cost`) fills it (at
        least one launch; the in-flight cap does not apply: the decoder is paused and the
        caller waits for them, `wait_all`). Returns the launches made."""
        scheds = self.sched.scheds
        old = [s.window_s for s in scheds]
        spent, n = 0.0, 0
        self.whole_device = True
        try:
            while (spent < window_s or n == 0) and not self._paused:
                for s in scheds:
                    s.window_s = max(window_s - spent, 1e-9)
                with self._lock:
                    g = self._open_grant(0)
                    before = [] if g is None else [(e, e.layers_done) for e in g.live]
                if g is None or not self._launch_layers(math.inf):
                    break
                spent += sum(self.window_cost(e.patches, e.layers_done - k) for e, k in before)
                n += 1
        finally:
            self.whole_device = False
            for s, v in zip(scheds, old, strict=True):
                s.window_s = v
        return n

    def window_end(self, n: int) -> tuple[Flight, Flight | None]:
        """The last of the `n` launches just made (`launch_window`) and the last of them that
        finishes (or fails) a request's embeddings (None if none does)."""
        with self._lock:
            new = list(self._flights)[-n:]
        ends = [f for f in new if f.done or f.failed]
        return new[-1], (ends[-1] if ends else None)

    def wait_all(self) -> None:
        """Block until every launch has finished (one stream: its last event)."""
        with self._lock:
            pending = [f.event for f in self._flights if not event_complete(f.event)]
        if pending and hasattr(pending[-1], "synchronize"):
            pending[-1].synchronize()

    def _can_launch(self, rank: int = 0) -> bool:
        part = self.partitions.current
        on_compute = bool(part.requested) or self.partitions.shared or self.whole_device
        return on_compute and not self._paused and self.incomplete(rank) < self.max_inflight

    def incomplete(self, rank: int | None = None) -> int:
        """Launches (of `rank`, or of every rank) whose work has not finished."""
        with self._lock:
            return sum(1 for f in self._flights if (rank is None or f.rank == rank)
                       and not event_complete(f.event))

    def _open_grant(self, rank: int) -> Grant | None:
        """`rank`'s grant being launched, or its TWSRFT queue's next one with a live request
        (lock held)."""
        while rank not in self._open:
            grant = self.sched.next_grant(rank)
            if grant is None:
                return None
            live = [e for k in grant.request_ids
                    if (e := self._encodings.get(k)) is not None and e.state == "active"]
            if live:
                self._open[rank] = Grant(grant, live, rank=rank)
            else:  # only aborted requests left
                self.sched.report(grant.job_id, grant.layers, rank)
        return self._open[rank]

    def _launch_layers(self, deadline: float, rank: int = 0) -> bool:
        """Launch layers of `rank`'s open grant - here one at a time until it ends or
        `deadline` passes (at least one), on another rank all at once - and record one event
        after them. False when there is nothing to launch."""
        with self._lock:
            g = self._open_grant(rank)
            if g is None:
                return False
            part = self.partitions.current
            self._launching = True
        flight = Flight(None, rank=rank)
        last = None  # another rank's: the job whose command was sent last
        try:
            with part.encoder_scope():
                while True:
                    g.live = [e for e in g.live if e.state == "active"]
                    step = 1 if rank == 0 else g.grant.layers - g.done
                    for enc in list(g.live):
                        last = enc.job if enc.job is not None else last
                        self._run_layer(enc, part.encoder_sms, flight, g, step)
                    g.done += step
                    if g.done >= g.grant.layers or not g.live or \
                            time.perf_counter() >= deadline:
                        break
                    if self._thread is not None:
                        time.sleep(0)  # let the engine thread take the GIL between layers
                if rank == 0:
                    flight.event = self.record_event()
                elif last is not None:  # its owner's commands run in the order sent
                    flight.event = self.runner.encoder_event(last)
        finally:
            with self._lock:
                self._flights.append(flight)
                self._launching = False
                if g.done >= g.grant.layers or not g.live:
                    self.sched.report(g.grant.job_id, g.grant.layers, rank)
                    del self._open[rank]
                    self.num_grants += 1
                self._cond.notify_all()
        return True

    def _run_layer(self, enc: Encoding, budget: int, flight: Flight, g: Grant,
                   layers: int = 1) -> None:
        """`layers` layers of one request's job (and its merger after the last layer)."""
        try:
            if self.preemptible:
                ran = self.runner.advance_encode(enc.job, layers, num_sms=budget)
                enc.layers_done += ran
                self.num_layers_run += ran
                if enc.layers_done >= self.num_layers:
                    enc.embeds = self.runner.finish_encode(enc.job, num_sms=budget)
                    if self.ranks == 1:  # data-parallel: the job is shared at hand-off
                        enc.job = None
                    flight.done.append(enc)
                    g.live.remove(enc)
            else:
                enc.embeds = self.runner.encode([enc.mm], num_sms=budget)[0]
                enc.layers_done = 1
                flight.done.append(enc)
                g.live.remove(enc)
        except Exception as exc:  # reported on the request; the others go on
            enc.job = enc.embeds = None
            flight.failed.append((enc, f"image encoding failed: {type(exc).__name__}: {exc}"))
            g.live.remove(enc)

    def record_event(self) -> Any:
        """An event on the current stream (recorded after each launch)."""
        if self.event_factory is not None:
            return self.event_factory()
        if self.partitions.cuda:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    # -- partition switches and shutdown ---------------------------------------------------
    def pause(self) -> None:
        """Stop launching new grants (a partition switch waits for the compute side)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._cond.notify_all()

    def idle(self) -> bool:
        """No grant being launched and none incomplete on the device."""
        with self._lock:
            return not self._launching and self.incomplete() == 0

    def drain(self) -> None:
        """Wait for every launched grant (failure paths and shutdown)."""
        with self._lock:
            events = [f.event for f in self._flights]
        for ev in events:
            if ev is not None and hasattr(ev, "synchronize"):
                ev.synchronize()

    def close(self) -> None:
        """Stop the worker thread (thread driver) and wait for the launched work."""
        with self._lock:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.drain()

    # -- the thread driver --------------------------------------------------------------
    def _has_work(self, rank: int) -> bool:
        return rank in self._open or self.sched.ready(rank)

    def _launchable(self) -> list[int]:
        """Ranks with work and room to launch it, others before this one."""
        return [r for r in (*range(1, self.ranks), 0)
                if self._has_work(r) and self._can_launch(r)]

    def _worker(self) -> None:
        """Thread driver: launch grants while there is work and room, then wait on events."""
        if self.partitions.cuda and self.partitions.device.index is not None:
            torch.cuda.set_device(self.partitions.device)
        while True:
            with self._cond:
                while not self._stop and not self._launchable():
                    self._cond.wait(0.002)
                if self._stop:
                    return
            for rank in self._launchable():
                self._launch_layers(math.inf, rank)
            with self._lock:
                pending = [f.event for f in self._flights
                           if f.rank == 0 and not event_complete(f.event)]
            if len(pending) >= self.max_inflight and hasattr(pending[0], "synchronize"):
                pending[0].synchronize()
