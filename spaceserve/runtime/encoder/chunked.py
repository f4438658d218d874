"""The ``temporal-chunked`` encoder stage: the time-multiplexed baseline at its strongest.

Plain ``temporal`` (`encoder_stage.TemporalEncoderStage`, as vLLM / SGLang do) encodes whole
requests on the whole GPU at the start of a step, and every decode waits for the whole pass: a
1080p image stalls decode for about a 7B model's 15-20 decode steps. ``temporal-chunked`` cuts
the encoder's work into layer chunks, as Sarathi cuts prefill into chunks: at the start of each
engine step, before the decode batch, the encoder runs layers on the whole device for about one
time window (``EngineConfig.encoder_window_s``, `--encoder-window-ms`, default 20 ms) and then
hands the device to the step's decode batch, which also carries chunked prefill under the
token budget as in every mode. Jobs are ordered by TWSRFT (shortest remaining work first, with
aging), so a small image is not stuck behind a large one, and each request is encoded alone
(no batching: its embeddings never depend on which others arrived with it), so the tokens are
``temporal``'s. As in every stage, media items the encoder cache or the prefix cache holds are
never encoded: a job covers only a request's missing items.

The window is measured in predicted time - the resource-utility curves' whole-device encoder
latency, as TWSRFT sizes its grants - not in wall time: chunks are then a function of the
requests alone, the same on every machine, and the simulator's ``temporal-chunked`` runs the
same rule. A step runs at least one layer while encoder work waits; the last chunk of a window
may overshoot it by at most one layer. TWSRFT is built as the simulator and the co-located
modes build it: with the deadline the TTFT SLO sets (`SchedulingPolicy.deadline_s`: the
encoder's share of the TTFT bound, counted from each request's arrival), or plain aging
without a TTFT bound.

With a data-parallel encoder (a tensor-parallel runner whose ``encoder_ranks`` > 1) each job
(a request's items neither cache holds) is encoded by one rank, chosen when it starts as the
rank with the least predicted work queued (`encoder_dp.RankedTwsrft`: a TWSRFT queue per rank);
every step, each rank runs one window of its own queue - the other ranks' chunks are sent first
and run while rank 0 runs its own - and a finished job's embeddings are broadcast from its rank
(`share_encoding`) before the encoder cache splits them into one entry per item.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spaceserve.checks import require_int, require_number
from spaceserve.runtime.core.request import MultiModalData, Request
from spaceserve.runtime.encoder.cache import EncoderCache, MediaTracker
from spaceserve.runtime.encoder.data_parallel import EncodingFailed, RankedTwsrft
from spaceserve.runtime.encoder.temporal import TemporalEncoderStage, release_encoding
from spaceserve.runtime.modes import TEMPORAL_MODES
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.twsrft import TwsrftScheduler


@dataclass
class _Job:
    """One request's missing media items inside the stage."""

    req: Request
    items: list[int]
    mm: MultiModalData  # the media of those items (what the runner encodes)
    patches: int
    job: Any = None  # the runner's encoder job once started
    embeds: Any = None  # a data-parallel job's embeddings on rank 0 until shared
    layers_done: int = 0
    rank: int = 0  # the rank encoding it (data-parallel)


class ChunkedEncoderStage:
    """Encode in layer chunks of one time window per engine step (module docstring).

    `curves` give the per-layer cost on `num_sms` SMs (scaled from the curves' encoder depth
    to the runner's); `max_held` bounds the requests holding or computing embeddings; `cache`
    is the engine's encoder output cache; `deadline_s` TWSRFT's deadline (None: plain aging);
    `policy` "fifo" orders jobs by arrival instead (the simulator's tuned baseline may pick it).
    """

    def __init__(self, runner: Any, curves: CurveSet, *, window_s: float = 0.02,
                 max_wait_s: float = 0.5, max_held: int = 64, num_sms: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cache: EncoderCache | None = None, deadline_s: float | None = None,
                 policy: str = "twsrft") -> None:
        require_number("window_s", window_s)
        require_int("max_held", max_held)
        self.runner, self.window_s, self.max_held = runner, window_s, max_held
        self.media = MediaTracker(cache if cache is not None else EncoderCache(0), runner)
        self.preemptible = all(hasattr(runner, m) for m in (
            "encoder_layers", "start_encode", "advance_encode", "finish_encode"))
        self.num_layers = int(runner.encoder_layers) if self.preemptible else 1
        scale = curves.encoder_depth / self.num_layers
        sms = num_sms or curves.num_sms
        self.layer_cost = lambda patches: curves.encoder(patches, scale, sms)
        cost = lambda patches, layers: layers * self.layer_cost(patches)  # noqa: E731
        kw = dict(policy=policy, window_s=window_s, max_wait_s=max_wait_s, token_budget=1,
                  clock=clock, deadline_s=deadline_s)
        self.ranks = int(getattr(runner, "encoder_ranks", 1)) if self.preemptible else 1
        self.ranked = RankedTwsrft(self.ranks, self.num_layers, cost, **kw) \
            if self.ranks > 1 else None
        self.sched = TwsrftScheduler(self.num_layers, cost, **kw) if self.ranked is None \
            else self.ranked.scheds[0]
        self._jobs: dict[int, _Job] = {}  # seq_no -> job, from admission to embeddings
        self._backlog: deque[_Job] = deque()  # waiting for a max_held slot
        self._held: set[int] = set()
        self.num_layers_run = 0
        self.num_chunks = 0

    # -- the EncoderStage protocol ------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        return len(self._backlog) + len(self._jobs)

    def submit(self, req: Request, covered: int = 0) -> None:
        missing = self.media.open(req, covered)
        if missing:
            self._queue(req, missing)

    def _queue(self, req: Request, items: list[int]) -> None:
        mm = self.media.job(req, items)
        self._backlog.append(_Job(req, items, mm, max(1, int(mm.pixel_values.shape[0]))))

    def ready(self, req: Request, start: int = 0) -> bool:
        if self.media.ready(req, start):
            return True
        if req.seq_no in self._jobs or any(j.req is req for j in self._backlog):
            return False
        missing = self.media.missing(req, start)
        if missing:
            self._queue(req, missing)
        return self.media.ready(req, start)

    def release(self, req: Request) -> None:
        """Drop `req`'s embeddings or pending work (finish or abort); a job TWSRFT still
        holds is skipped at its next grant."""
        dropped = [j for j in self._backlog if j.req is req]
        job = self._jobs.pop(req.seq_no, None)
        if job is not None:
            dropped.append(job)
        if dropped:
            self._backlog = deque(j for j in self._backlog if j.req is not req)
        for j in dropped:
            self._end(j)
        self.media.drop(req)
        self._held.discard(req.seq_no)

    def step(self) -> list[tuple[Request, str]]:
        """Encode for one window (at least one layer while work waits); returns the requests
        whose images failed, with a message."""
        failed = self._admit()
        if self.ranked is None:
            failed += self._window(None)
        else:  # the other ranks' windows are sent first, and run while rank 0 runs its own
            done: list[_Job] = []
            for rank in (*range(1, self.ranks), 0):
                failed += self._window(rank, done)
            failed += [f for job in done if (f := self._share(job)) is not None]
        return failed + self._admit()

    def _window(self, rank: int | None, done: list[_Job] | None = None
                ) -> list[tuple[Request, str]]:
        """One window of grants (at least one layer while work waits) from the one queue
        (`rank` None) or from `rank`'s; `done` collects the data-parallel jobs whose layers
        have all been sent."""
        if rank is None:
            sched, report = self.sched, self.sched.report
        else:
            sched = self.ranked.scheds[rank]

            def report(job_id: int, layers: int) -> Any:
                return self.ranked.report(job_id, layers, rank)
        failed: list[tuple[Request, str]] = []
        spent = 0.0
        ran = False
        while spent < self.window_s or not ran:
            grant = sched.next_grant()
            if grant is None:
                break
            live = [j for k in grant.request_ids if (j := self._jobs.get(k)) is not None]
            if not live:  # only released requests left in it
                report(grant.job_id, grant.layers)
                continue
            per_layer = self.layer_cost(grant.patches)
            left = self.window_s - spent
            layers = max(1, min(grant.layers, math.ceil(left / per_layer - 1e-9)))
            for job in live:
                failed += self._advance(job, layers, done)
            report(grant.job_id, layers)
            spent += layers * per_layer
            ran = True
            self.num_chunks += 1
        return failed

    # -- internals --------------------------------------------------------------------------
    def _admit(self) -> list[tuple[Request, str]]:
        """Start backlogged jobs while fewer than `max_held` requests hold or compute
        embeddings, in the order TWSRFT's deadline enters them (`TwsrftScheduler.entry`)."""
        failed = []
        while self._backlog and len(self._held) + len(self._jobs) < self.max_held:
            job = self.sched.take(self._backlog, lambda j: (j.req.arrival_time, j.patches))
            try:
                if self.ranked is not None:  # the rank with the least predicted work queued
                    job.rank = self.ranked.pick()
                    job.job = self.runner.start_encode(job.mm, rank=job.rank)
                else:
                    job.job = self.runner.start_encode(job.mm) if self.preemptible else None
            except Exception as exc:  # reported on the request, the others go on
                self.media.done(job.mm)
                failed.append((job.req, f"image encoding failed: {type(exc).__name__}: {exc}"))
                continue
            self._jobs[job.req.seq_no] = job
            if self.ranked is not None:
                self.ranked.submit(job.req.seq_no, job.patches, rank=job.rank,
                                   arrival=job.req.arrival_time)
            else:
                self.sched.submit(job.req.seq_no, job.patches, job.req.arrival_time)
        return failed

    def _advance(self, job: _Job, layers: int, done: list[_Job] | None = None
                 ) -> list[tuple[Request, str]]:
        """Run `layers` layers of one request's job; store its embeddings when done (a
        data-parallel job goes to `done`, to be shared once its rank has run it)."""
        try:
            if self.preemptible:
                ran = self.runner.advance_encode(job.job, layers)
                job.layers_done += ran
                self.num_layers_run += ran
                if job.layers_done < self.num_layers:
                    return []
                emb = self.runner.finish_encode(job.job)
                if done is not None:
                    job.embeds = emb  # rank 0's; None for another rank's (shared later)
                    done.append(job)
                    return []
            else:
                emb = self.runner.encode([job.mm])[0]
                job.layers_done = 1
        except Exception as exc:  # reported on the request, the others go on
            return [self._fail(job, exc)]
        return self._store(job, emb)

    def _share(self, job: _Job) -> tuple[Request, str] | None:
        """Wait for a data-parallel job's rank, then broadcast its embeddings to every rank
        (they are then split into encoder-cache entries on every rank)."""
        try:
            event = self.runner.encoder_event(job.job)
            if event is not None:
                event.synchronize()
            emb = self.runner.share_encoding(job.job, job.embeds)
        except (EncodingFailed, RuntimeError, ValueError) as exc:
            return self._fail(job, exc)
        failed = self._store(job, emb)
        return failed[0] if failed else None

    def _fail(self, job: _Job, exc: Exception) -> tuple[Request, str]:
        del self._jobs[job.req.seq_no]
        self._end(job)
        return job.req, f"image encoding failed: {type(exc).__name__}: {exc}"

    def _end(self, job: _Job) -> None:
        """`job` is over without output: no item waits for it, no rank keeps its state."""
        self.media.done(job.mm)
        release_encoding(self.runner, job.mm)

    def _store(self, job: _Job, emb: Any) -> list[tuple[Request, str]]:
        req = job.req
        del self._jobs[req.seq_no]
        msg = self.media.store(req, job.items, job.mm, emb)
        if msg is not None:
            release_encoding(self.runner, job.mm)
            return [(req, msg)]
        self._held.add(req.seq_no)
        return []


def encoder_cost(runner: Any, config: Any) -> Callable[[int], float] | None:
    """A data-parallel encoder's cost model (TWSRFT's: the curves' encoder time of a whole
    pass on the device); None for a runner that encodes on one rank."""
    if getattr(runner, "encoder_ranks", 1) <= 1:
        return None
    from spaceserve.runtime.policy.model_curves import load_curves

    curves = load_curves(config.curves, runner)
    depth, sms = curves.encoder_depth, curves.num_sms
    return lambda patches: curves.encoder(patches, depth, sms)


def temporal_stage(runner: Any, config: Any, *, clock: Callable[[], float] = time.monotonic,
                   cache: EncoderCache | None = None,
                   cost: Callable[[int], float] | None = None
                   ) -> TemporalEncoderStage | ChunkedEncoderStage:
    """The encoder stage of a time-multiplexed mode (``temporal`` or ``temporal-chunked``)
    from an `EngineConfig`, looking media up in `cache`; the chunked one costs layers on the
    runner's model curves. `cost`: a data-parallel encoder's cost model
    (`TemporalEncoderStage`)."""
    if config.mode == "temporal":
        return TemporalEncoderStage(runner, max_tokens_per_step=config.max_encoder_tokens_per_step,
                                    max_held=config.max_held_embeddings, cache=cache, cost=cost)
    if config.mode != "temporal-chunked":
        raise ValueError(f"mode={config.mode!r} is not one of {', '.join(TEMPORAL_MODES)}")
    from spaceserve.kernels.budget import device_num_sms
    from spaceserve.runtime.policy.model_curves import load_curves

    return ChunkedEncoderStage(runner, load_curves(config.curves, runner),
                               window_s=config.encoder_window_s,
                               max_held=config.max_held_embeddings,
                               num_sms=device_num_sms(runner.device), clock=clock,
                               cache=cache, deadline_s=twsrft_deadline(config.slo),
                               policy=config.encoder_policy)


def twsrft_deadline(slo: Any) -> float | None:
    """TWSRFT's deadline under `slo` (an `Slo`), as the co-located modes and the simulator set
    it: `SchedulingPolicy`'s ttft margin x the TTFT bound; None without a TTFT bound."""
    from spaceserve.runtime.policy.scheduling import SchedulingPolicy

    if slo is None or slo.ttft is None:
        return None
    margin = SchedulingPolicy.__dataclass_fields__["ttft_margin"].default
    return margin * slo.ttft / 1e3
