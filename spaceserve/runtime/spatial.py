"""The spatial encoder stage: images encoded on the encoder's own stream and SMs, TWSRFT-ordered.

A request's images become one encoder job (`PreemptibleEncoder.start_encode`) at submission;
its pixels are pinned and copied non-blocking on the encoder side's upload stream, which the
encoder streams wait for by event (`_start` says why). TWSRFT picks which job advances next and
for how many layers (about one time window), so a small image behind a huge one is not blocked
by it. With a `SchedulingPolicy` (`plan`, ``spatial`` mode) TWSRFT runs the policy's deadline,
aging and batching rule, exactly as the simulator does (a merge happens only where the curves say it
cannot delay the chosen job; each request's layers are still launched on their own, so its
embeddings never depend on which others arrived with it); without one batching is off. Arrival
times (on the stage's clock) give SIS each request's age and the arrival-rate estimate. Every
launch goes on the current partition's encoder stream under its encoder budget, followed by an
event. Hand-off: embeddings are attached to the request (admitting it to prefill) only once that
event has completed - `event.query()`, never a wait - and are marked with ``record_stream`` on
every decoder stream; they stay with the request (recompute needs them) until `release`.

Drivers (who issues the launches; a grant is launched layer by layer either way):
- ``cooperative`` (default): the engine thread, right after launching a decode step and before
  reading its tokens, for at most `launch_budget_s` of host time (at least one layer). Launches
  are asynchronous on a GPU, so this overlaps the decode step's device time; nothing competes
  for the GIL. The encoder's launch rate is bounded by that budget per decode step.
- ``thread``: a worker launches whole grants and waits on their events, yielding the GIL
  between layers; the engine thread still waits for it when it needs the GIL mid-layer.
Measured on CPU, host side only (`bench/bench_colocation.py` ``driver_experiment``: a model
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

from .curves import CurveSet
from .partition import PartitionSet
from .policy import RateEstimator, SchedulingPolicy
from .request import Request
from .runner import ModelRunner
from .sis import PendingEncode
from .twsrft import TwsrftScheduler

DRIVERS = ("cooperative", "thread")


@dataclass
class _Encoding:
    """One request's images inside the stage."""

    key: int
    req: Request
    patches: int
    state: str = "backlog"  # backlog -> active -> held | failed; released at the end
    job: Any = None
    layers_done: int = 0
    embeds: torch.Tensor | None = None

    @property
    def released(self) -> bool:
        return self.state == "released"


@dataclass
class _Flight:
    """One launched grant: its completion event, the jobs it finished and those that failed."""

    event: Any
    done: list[_Encoding] = field(default_factory=list)
    failed: list[tuple[_Encoding, str]] = field(default_factory=list)


@dataclass
class _Grant:
    """A TWSRFT grant being launched: its live requests and how many layers were issued."""

    grant: Any
    live: list[_Encoding]
    done: int = 0


def _complete(event: Any) -> bool:
    return event is None or bool(event.query())


class SpatialEncoderStage:
    """Encoder stage on its own stream and SM partition, ordered by TWSRFT (module docstring).

    `curves` give TWSRFT its cost model (scaled from the curves' encoder depth to the runner's);
    `event_factory` replaces CUDA events (tests and the host-side experiment model an
    asynchronous device with it). `max_held` bounds the requests holding or computing
    embeddings; `max_inflight` the launches (each a few layers and one event) not complete.
    """

    def __init__(self, runner: ModelRunner, partitions: PartitionSet, curves: CurveSet, *,
                 driver: str = "cooperative", window_s: float = 0.02, max_wait_s: float = 0.5,
                 policy: str = "twsrft", max_held: int = 64,
                 max_inflight: int = 2, launch_budget_s: float = 0.003,
                 clock: Callable[[], float] = time.monotonic,
                 event_factory: Callable[[], Any] | None = None,
                 plan: SchedulingPolicy | None = None) -> None:
        if driver not in DRIVERS:
            raise ValueError(f"driver={driver!r} is not one of {', '.join(DRIVERS)}")
        if not launch_budget_s >= 0:
            raise ValueError(f"launch_budget_s={launch_budget_s} must be >= 0")
        for name, value in (("max_held", max_held), ("max_inflight", max_inflight)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.runner = runner
        self.partitions = partitions
        self.driver = driver
        self.max_held, self.max_inflight = max_held, max_inflight
        self.launch_budget_s = launch_budget_s
        self.preemptible = all(hasattr(runner, m) for m in (
            "encoder_layers", "start_encode", "advance_encode", "finish_encode"))
        self.num_layers = int(runner.encoder_layers) if self.preemptible else 1
        scale = curves.encoder_depth / self.num_layers

        def cost(patches: int, layers: int) -> float:
            part = self.partitions.current
            sms = part.encoder_sms if part.requested or partitions.shared else \
                max(p.encoder_sms for p in partitions.partitions())
            return curves.encoder(patches, layers * scale, sms, True)

        self.plan = plan
        self.sched = TwsrftScheduler(
            self.num_layers, cost, policy=policy, window_s=window_s,
            max_wait_s=plan.max_wait_s if plan else max_wait_s,
            token_budget=plan.token_budget if plan else 1,
            deadline_s=plan.deadline_s if plan else None, clock=clock)
        self.clock = clock
        self.arrivals = RateEstimator()
        self._arrived: dict[int, float] = {}  # request seq_no -> arrival on `clock`
        self.event_factory = event_factory
        self._encodings: dict[int, _Encoding] = {}  # request seq_no -> encoding, until release
        self._backlog: deque[_Encoding] = deque()  # waiting for a max_held slot
        self._active = 0  # encodings set up (or being set up) and not finished
        self._held: set[int] = set()
        self._flights: deque[_Flight] = deque()
        self._open: _Grant | None = None  # the grant whose layers are being launched
        self._failures: list[tuple[Request, str]] = []
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._paused = False
        self._launching = False
        self._stop = False
        self.num_grants = 0
        self.num_layers_run = 0
        self._thread: threading.Thread | None = None
        if driver == "thread":
            self._thread = threading.Thread(target=self._worker, name="spaceserve-encoder",
                                            daemon=True)
            self._thread.start()

    # -- the EncoderStage protocol ------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._backlog) + self._active

    def submit(self, req: Request) -> None:
        if req.mm is None or req.mm.embeds is not None:
            return
        enc = _Encoding(req.seq_no, req, int(req.mm.pixel_values.shape[0]))
        now = self.clock()
        with self._lock:
            self._encodings[enc.key] = enc
            self._backlog.append(enc)
            self._arrived[enc.key] = now
            self.arrivals.add(now, max(1, enc.patches), len(req.token_ids))
        self._admit()

    def ready(self, req: Request) -> bool:
        return req.mm is None or req.mm.embeds is not None

    def step(self) -> list[tuple[Request, str]]:
        """Attach the embeddings of completed grants, start backlogged jobs; returns failures."""
        self.poll()
        self._admit()
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def release(self, req: Request) -> None:
        with self._lock:
            enc = self._encodings.pop(req.seq_no, None)
            if enc is not None:
                if enc.state == "backlog":
                    self._backlog.remove(enc)
                elif enc.state == "active":
                    self._active -= 1
                enc.state = "released"
                enc.embeds = enc.job = None
            self._held.discard(req.seq_no)
            self._arrived.pop(req.seq_no, None)
            self._cond.notify_all()
        if req.mm is not None:
            req.mm.embeds = None

    # -- the encoder's launches ------------------------------------------------------------
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
        while self._can_launch() and self._launch_layers(deadline):
            n += 1
            if time.perf_counter() >= deadline:
                break
        return n

    def _can_launch(self) -> bool:
        part = self.partitions.current
        on_compute = bool(part.requested) or self.partitions.shared
        return on_compute and not self._paused and self.incomplete() < self.max_inflight

    def incomplete(self) -> int:
        """Launches whose work has not finished on the device."""
        with self._lock:
            return sum(1 for f in self._flights if not _complete(f.event))

    def _open_grant(self) -> _Grant | None:
        """The grant being launched, or TWSRFT's next one with a live request (lock held)."""
        while self._open is None:
            grant = self.sched.next_grant()
            if grant is None:
                return None
            live = [e for k in grant.request_ids
                    if (e := self._encodings.get(k)) is not None and e.state == "active"]
            if live:
                self._open = _Grant(grant, live)
            else:
                self.sched.report(grant.job_id, grant.layers)  # only aborted requests left
        return self._open

    def _launch_layers(self, deadline: float) -> bool:
        """Launch layers of the open grant, one at a time, until it ends or `deadline` passes
        (at least one); record one event after them. False when there is nothing to launch."""
        with self._lock:
            g = self._open_grant()
            if g is None:
                return False
            part = self.partitions.current
            self._launching = True
        flight = _Flight(None)
        try:
            with part.encoder_scope():
                while True:
                    g.live = [e for e in g.live if e.state == "active"]
                    for enc in list(g.live):
                        self._run_layer(enc, part.encoder_sms, flight, g)
                    g.done += 1
                    if g.done >= g.grant.layers or not g.live or \
                            time.perf_counter() >= deadline:
                        break
                    if self._thread is not None:
                        time.sleep(0)  # let the engine thread take the GIL between layers
                flight.event = self.record_event()
        finally:
            with self._lock:
                self._flights.append(flight)
                self._launching = False
                if g.done >= g.grant.layers or not g.live:
                    self.sched.report(g.grant.job_id, g.grant.layers)
                    self._open = None
                    self.num_grants += 1
                self._cond.notify_all()
        return True

    def _run_layer(self, enc: _Encoding, budget: int, flight: _Flight, g: _Grant) -> None:
        """One layer of one request's job (and its merger after the last layer)."""
        try:
            if self.preemptible:
                ran = self.runner.advance_encode(enc.job, 1, num_sms=budget)
                enc.layers_done += ran
                self.num_layers_run += ran
                if enc.layers_done >= self.num_layers:
                    enc.embeds = self.runner.finish_encode(enc.job, num_sms=budget)
                    enc.job = None
                    flight.done.append(enc)
                    g.live.remove(enc)
            else:
                enc.embeds = self.runner.encode([enc.req.mm])[0]
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

    # -- completion and hand-off --------------------------------------------------------------
    def poll(self) -> int:
        """Attach the embeddings of every completed grant (event query, no wait); returns how
        many requests became ready."""
        ready = 0
        while True:
            with self._lock:
                if not self._flights or not _complete(self._flights[0].event):
                    return ready
                flight = self._flights.popleft()
                for enc, msg in flight.failed:
                    if enc.state == "active":
                        self._fail(enc, msg)
                for enc in flight.done:
                    if enc.state == "active" and self._attach(enc):
                        ready += 1
                self._cond.notify_all()

    def _fail(self, enc: _Encoding, msg: str) -> None:
        self._active -= 1
        enc.state = "failed"
        enc.job = enc.embeds = None
        self._failures.append((enc.req, msg))

    def _attach(self, enc: _Encoding) -> bool:
        mm, emb = enc.req.mm, enc.embeds
        enc.embeds = None
        if emb is None or emb.dim() != 2 or emb.shape[0] != mm.num_tokens:
            shape = None if emb is None else tuple(emb.shape)
            self._fail(enc, f"encoder returned shape {shape} for {mm.num_tokens} image tokens")
            return False
        if emb.is_cuda:
            for stream in self.partitions.decoder_streams():
                emb.record_stream(stream)
        mm.embeds = emb
        self._active -= 1
        enc.state = "held"
        self._held.add(enc.key)
        return True

    def _admit(self) -> None:
        """Start backlogged jobs while fewer than `max_held` requests hold or compute
        embeddings: pin and upload the pixels on the encoder stream, set up the job."""
        while True:
            with self._lock:
                if not self._backlog or len(self._held) + self._active >= self.max_held:
                    return
                enc = self._backlog.popleft()
                enc.state = "active"
                self._active += 1
            try:
                job = self._start(enc) if self.preemptible else None
            except Exception as exc:
                with self._lock:
                    if enc.state == "active":
                        self._fail(enc, f"image encoding failed: {type(exc).__name__}: {exc}")
                continue
            with self._lock:
                if enc.state == "active":
                    enc.job = job
                    self.sched.submit(enc.key, max(1, enc.patches), self._arrived.get(enc.key))
                self._cond.notify_all()

    def _start(self, enc: _Encoding) -> Any:
        """Set up a job; on CUDA on the upload stream (`PartitionSet.staged`): the pixels are
        pinned and copied non-blocking, and the job's small blocking uploads (rotary tables,
        attention plan) synchronise only that idle stream, never the encoder's queue."""
        mm, pset = enc.req.mm, self.partitions
        if not pset.cuda:
            return self.runner.start_encode(mm)
        with pset.staged() as done:
            pv = mm.pixel_values
            if pv.device.type == "cpu":
                pv = pv.pin_memory().to(pset.device, non_blocking=True)
            job = done(self.runner.start_encode(mm, pixel_values=pv))
        return job

    # -- for SIS, partition switches and shutdown ----------------------------------------------
    def age(self, req: Request) -> float:
        """Seconds since `req` reached the stage (0 for a request without images)."""
        arrived = self._arrived.get(req.seq_no)
        return 0.0 if arrived is None else max(0.0, self.clock() - arrived)

    def pending_work(self, curve_depth: int) -> list[PendingEncode]:
        """Waiting encoder jobs as SIS sees them (layers scaled to the curves' depth), with
        their oldest request's age."""
        scale = curve_depth / self.num_layers
        now = self.clock()
        out = []
        with self._lock:
            for job in self.sched.jobs():
                prompt = sum(len(e.req.token_ids) for k in job.request_ids
                             if (e := self._encodings.get(k)) is not None)
                out.append(PendingEncode(job.patches, max(1, round(job.layers_left * scale)),
                                         prompt, max(0.0, now - job.arrival),
                                         len(job.request_ids)))
            for enc in self._backlog:
                out.append(PendingEncode(max(1, enc.patches), max(1, round(self.num_layers
                                                                           * scale)),
                                         len(enc.req.token_ids),
                                         max(0.0, now - self._arrived.get(enc.key, now))))
        return out

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

    def wait(self, timeout_s: float = 0.005) -> None:
        """Block until the oldest incomplete grant finishes (GPU), or briefly (thread driver);
        for an engine with nothing else to do."""
        with self._lock:
            pending = [f.event for f in self._flights if not _complete(f.event)]
        if pending and hasattr(pending[0], "synchronize"):
            pending[0].synchronize()
        elif self._thread is not None and self.num_pending:
            with self._cond:
                self._cond.wait(timeout_s)

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

    def _has_work(self) -> bool:
        return len(self.sched) > 0 and not self.sched.busy

    def _worker(self) -> None:
        """Thread driver: launch grants while there is work and room, then wait on events."""
        if self.partitions.cuda and self.partitions.device.index is not None:
            torch.cuda.set_device(self.partitions.device)
        while True:
            with self._cond:
                while not self._stop and not (self._has_work() and self._can_launch()):
                    self._cond.wait(0.002)
                if self._stop:
                    return
            if not self._launch_layers(math.inf):
                continue
            with self._lock:
                pending = [f.event for f in self._flights if not _complete(f.event)]
            if len(pending) >= self.max_inflight and hasattr(pending[0], "synchronize"):
                pending[0].synchronize()
