"""The spatial encoder stage: images encoded on the encoder's own stream and SMs, TWSRFT-ordered.

A request's images become one encoder job (`PreemptibleEncoder.start_encode`) at submission;
its pixels are pinned and copied non-blocking on the encoder side's upload stream, which the
encoder streams wait for by event (`_start` says why). TWSRFT picks which job advances next and
for how many layers (about one time window), so a small image behind a huge one is not blocked
by it. With a `SchedulingPolicy` (`plan`, ``spatial`` mode) TWSRFT runs the policy's deadline,
aging and batching rule, exactly as the simulator does (a merge happens only where the curves say
it cannot delay the chosen job; each request's layers are still launched on their own, so its
embeddings never depend on which others arrived with it); without one batching is off. Arrival
times (on the stage's clock) give SIS each request's age and the arrival-rate estimate. Every
launch goes on the current partition's encoder stream under its encoder budget, followed by an
event. Hand-off: embeddings are attached to the request (admitting it to prefill) only once that
event has completed - `event.query()`, never a wait - and are marked with ``record_stream`` on
every decoder stream; they stay with the request (recompute needs them) until `release`.
Media items the encoder cache already has, or whose tokens all lie in the prefix cache, never
become a job: TWSRFT sees only the items that need the encoder (`encoder_cache.MediaTracker`).

Data-parallel encoder (a tensor-parallel runner with ``encoder_ranks`` > 1): each job (a
request's items neither cache holds) is assigned at admission to the rank whose TWSRFT queue has
the least predicted work left, which encodes it; when its last flight completes, the hand-off
first has every rank take the embeddings from that rank (`share_encoding`, a broadcast on the
decoder stream), then stores them as above: the encoder cache splits them into one entry per
item, on every rank.

The launches themselves (TWSRFT grants, one event each, under the ``cooperative`` or the
``thread`` driver, and why cooperative is the default) are `spatial_launch.py`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from spaceserve.checks import require_choice, require_int, require_number
from spaceserve.runtime.core.request import Request
from spaceserve.runtime.encoder.cache import EncoderCache, MediaTracker
from spaceserve.runtime.encoder.data_parallel import EncodingFailed, RankedTwsrft
from spaceserve.runtime.encoder.temporal import release_encoding
from spaceserve.runtime.modes import DRIVERS
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.scheduling import RateEstimator, SchedulingPolicy
from spaceserve.runtime.policy.sis import PendingEncode
from spaceserve.runtime.spatial.launches import EncoderLaunches, Encoding, Flight, event_complete
from spaceserve.runtime.spatial.partition import PartitionSet
from spaceserve.runtime.worker.protocol import ModelRunner

__all__ = ["SpatialEncoderStage"]


class SpatialEncoderStage(EncoderLaunches):
    """Encoder stage on its own stream and SM partition, ordered by TWSRFT (module docstring).

    `curves` give TWSRFT its cost model (scaled from the curves' encoder depth to the runner's);
    `event_factory` replaces CUDA events (tests and the host-side experiment model an
    asynchronous device with it). `max_held` bounds the requests holding or computing
    embeddings; `max_inflight` the launches (each a few layers and one event) not complete.
    `cache` is the encoder output cache (None: none).
    """

    def __init__(self, runner: ModelRunner, partitions: PartitionSet, curves: CurveSet, *,
                 driver: str = "cooperative", window_s: float = 0.02, max_wait_s: float = 0.5,
                 policy: str = "twsrft", max_held: int = 64,
                 max_inflight: int = 2, launch_budget_s: float = 0.003,
                 clock: Callable[[], float] = time.monotonic,
                 event_factory: Callable[[], Any] | None = None,
                 cache: EncoderCache | None = None,
                 plan: SchedulingPolicy | None = None) -> None:
        require_choice("driver", driver, DRIVERS)
        require_number("launch_budget_s", launch_budget_s, zero_ok=True)
        for name, value in (("max_held", max_held), ("max_inflight", max_inflight)):
            require_int(name, value)
        self.runner = runner
        self.partitions = partitions
        self.max_held = max_held
        self.media = MediaTracker(cache if cache is not None else EncoderCache(0), runner)
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
        whole = partitions.total  # a whole-GPU window's layers run alone on every SM
        self.window_cost = lambda patches, layers: curves.encoder(patches, layers * scale,
                                                                  whole, False)
        self.ranks = int(getattr(runner, "encoder_ranks", 1)) if self.preemptible else 1
        self.sched = RankedTwsrft(
            self.ranks, self.num_layers, cost, policy=policy, window_s=window_s,
            max_wait_s=plan.max_wait_s if plan else max_wait_s,
            token_budget=plan.token_budget if plan else 1,
            deadline_s=plan.deadline_s if plan else None,
            overdue_s=plan.overdue_s if plan else None, clock=clock)
        self.clock = clock
        self.arrivals = RateEstimator()
        self._arrived: dict[int, float] = {}  # job key -> arrival on `clock`
        self._encodings: dict[int, Encoding] = {}  # job key -> encoding, until release
        self._by_req: dict[int, int] = {}  # request seq_no -> key of its latest encoding
        self._keys = itertools.count()
        self._backlog: deque[Encoding] = deque()  # waiting for a max_held slot
        self._active = 0  # encodings set up (or being set up) and not finished
        self._held: set[int] = set()
        self._failures: list[tuple[Request, str]] = []
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._init_launches(driver, max_inflight, launch_budget_s, event_factory)
        self._start_driver()

    # -- the EncoderStage protocol ------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._backlog) + self._active

    def submit(self, req: Request, covered: int = 0) -> None:
        missing = self.media.open(req, covered)
        if missing:
            self._queue(req, missing)

    def _queue(self, req: Request, items: list[int]) -> None:
        mm = self.media.job(req, items)
        enc = Encoding(next(self._keys), req, int(mm.pixel_values.shape[0]), items=items, mm=mm)
        now = self.clock()
        with self._lock:
            first = req.seq_no not in self._by_req  # a re-queue is not a new arrival
            self._arrived.pop(self._by_req.get(req.seq_no, -1), None)
            self._encodings.pop(self._by_req.get(req.seq_no, -1), None)  # a finished one
            self._encodings[enc.key] = enc
            self._by_req[req.seq_no] = enc.key
            self._backlog.append(enc)
            self._arrived[enc.key] = now
            if first:
                self.arrivals.add(now, max(1, enc.patches), len(req.token_ids))
        self._admit()

    def ready(self, req: Request, start: int = 0) -> bool:
        if self.media.ready(req, start):
            return True
        with self._lock:
            enc = self._encodings.get(self._by_req.get(req.seq_no, -1))
            if enc is not None and enc.state in ("backlog", "active"):
                return False
        missing = self.media.missing(req, start)
        if missing:
            self._queue(req, missing)
        return self.media.ready(req, start)

    def step(self) -> list[tuple[Request, str]]:
        """Attach the embeddings of completed grants, start backlogged jobs; returns failures."""
        self.poll()
        self._admit()
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def release(self, req: Request) -> None:
        with self._lock:
            key = self._by_req.pop(req.seq_no, -1)
            enc = self._encodings.pop(key, None)
            self._arrived.pop(key, None)
            if enc is not None:
                if enc.state == "backlog":
                    self._backlog.remove(enc)
                elif enc.state == "active":
                    self._active -= 1
                if enc.state != "held":
                    self.media.done(enc.mm)
                    release_encoding(self.runner, enc.mm)
                enc.state = "released"
                enc.embeds = enc.job = None
            self._held.discard(req.seq_no)
            self._cond.notify_all()
        self.media.drop(req)

    # -- completion and hand-off --------------------------------------------------------------
    def poll(self) -> int:
        """Attach the embeddings of every completed grant (event query, no wait); returns how
        many requests became ready."""
        ready = 0
        while True:
            with self._lock:
                flight = self._next_complete()
                if flight is None:
                    return ready
                for enc, msg in flight.failed:
                    if enc.state == "active":
                        self._fail(enc, msg)
                done = [e for e in flight.done if e.state == "active"]
            for enc in done:
                msg = self._share(enc) if self.ranks > 1 else None
                with self._lock:
                    if enc.state != "active":
                        continue
                    if msg is not None:
                        self._fail(enc, msg)
                    elif self._attach(enc):
                        ready += 1
            with self._lock:
                self._cond.notify_all()

    def _next_complete(self) -> Flight | None:
        """The oldest completed flight of a rank with no older incomplete one, taken off the
        queue (lock held; a rank's flights complete in order, different ranks' in any)."""
        blocked: set[int] = set()
        for i, flight in enumerate(self._flights):
            if flight.rank in blocked:
                continue
            if event_complete(flight.event):
                del self._flights[i]
                return flight
            blocked.add(flight.rank)
        return None

    def _share(self, enc: Encoding) -> str | None:
        """Data-parallel hand-off: every rank takes `enc`'s embeddings from its owner (on the
        decoder stream, outside the lock: a collective); returns an error message, or None."""
        job, enc.job = enc.job, None
        try:
            part = self.partitions.current
            with part.decoder_scope():
                enc.embeds = self.runner.share_encoding(job, enc.embeds,
                                                        num_sms=part.decoder_sms)
        except EncodingFailed as exc:
            enc.embeds = None
            return str(exc)
        return None

    def _fail(self, enc: Encoding, msg: str) -> None:
        self._active -= 1
        enc.state = "failed"
        enc.job = enc.embeds = None
        self.media.done(enc.mm)
        release_encoding(self.runner, enc.mm)
        self._failures.append((enc.req, msg))

    def _attach(self, enc: Encoding) -> bool:
        emb = enc.embeds
        enc.embeds = None
        if emb is not None and emb.is_cuda:
            for stream in self.partitions.decoder_streams():
                emb.record_stream(stream)
        msg = self.media.store(enc.req, enc.items, enc.mm, emb)
        if msg is not None:
            self._fail(enc, msg)
            return False
        self._active -= 1
        enc.state = "held"
        self._held.add(enc.req.seq_no)
        return True

    def _admit(self) -> None:
        """Start backlogged jobs while fewer than `max_held` requests hold or compute
        embeddings, in the order TWSRFT's deadline enters them (`TwsrftScheduler.entry`): pin
        and upload the pixels on the encoder stream, set up the job."""
        while True:
            with self._lock:
                if not self._backlog or len(self._held) + self._active >= self.max_held:
                    return
                enc = self.sched.take(self._backlog,
                                      lambda e: (self._arrived.get(e.key), e.patches))
                enc.state = "active"
                self._active += 1
                rank = self.sched.pick()
            try:
                job = self._start(enc, rank) if self.preemptible else None
            except Exception as exc:
                with self._lock:
                    if enc.state == "active":
                        self._fail(enc, f"image encoding failed: {type(exc).__name__}: {exc}")
                continue
            with self._lock:
                if enc.state == "active":
                    enc.job = job
                    self.sched.submit(enc.key, max(1, enc.patches), rank,
                                      arrival=self._arrived.get(enc.key))
                self._cond.notify_all()

    def _start(self, enc: Encoding, rank: int = 0) -> Any:
        """Set up a job (on `rank`, data-parallel); on CUDA on the upload stream
        (`PartitionSet.staged`): the pixels are pinned and copied non-blocking, and the job's
        small blocking uploads (rotary tables, attention plan) synchronise only that idle
        stream, never the encoder's queue. Another rank's job uploads nothing here."""
        mm, pset = enc.mm, self.partitions
        if self.ranks > 1 and rank != 0:
            return self.runner.start_encode(mm, rank=rank)
        if not pset.cuda:
            return self.runner.start_encode(mm)
        with pset.staged() as done:
            pv = mm.pixel_values
            if pv.device.type == "cpu":
                pv = pv.pin_memory().to(pset.device, non_blocking=True)
            job = done(self.runner.start_encode(mm, pixel_values=pv))
        return job

    # -- for SIS, and an engine with nothing else to do ----------------------------------------
    def age(self, req: Request) -> float:
        """Seconds since `req` reached the stage (0 for a request without images)."""
        arrived = self._arrived.get(self._by_req.get(req.seq_no, -1))
        return 0.0 if arrived is None else max(0.0, self.clock() - arrived)

    def pending_work(self, curve_depth: int) -> list[PendingEncode]:
        """Waiting encoder jobs as SIS sees them (layers scaled to the curves' depth), with
        their oldest request's age."""
        scale = curve_depth / self.num_layers
        now = self.clock()
        out = []
        with self._lock:
            for job in self.sched.jobs():
                prompt = sum(_prefill(e.req) for k in job.request_ids
                             if (e := self._encodings.get(k)) is not None)
                out.append(PendingEncode(job.patches, max(1, round(job.layers_left * scale)),
                                         prompt, max(0.0, now - job.arrival),
                                         len(job.request_ids)))
            for enc in self._backlog:
                out.append(PendingEncode(max(1, enc.patches), max(1, round(self.num_layers
                                                                           * scale)),
                                         _prefill(enc.req),
                                         max(0.0, now - self._arrived.get(enc.key, now))))
        return out

    def wait(self, timeout_s: float = 0.005) -> None:
        """Block until the oldest incomplete grant finishes (GPU), or briefly (thread driver);
        for an engine with nothing else to do."""
        with self._lock:
            pending = [f.event for f in self._flights if not event_complete(f.event)]
        if pending and hasattr(pending[0], "synchronize"):
            pending[0].synchronize()
        elif self._thread is not None and self.num_pending:
            with self._cond:
                self._cond.wait(timeout_s)


def _prefill(req: Request) -> int:
    """Tokens a waiting request will prefill: those the prefix cache did not hold."""
    return len(req.token_ids) - max(req.num_computed, req.prefix_hint)
