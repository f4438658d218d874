"""Discrete-event simulation of one GPU serving a multimodal LLM under five execution modes.

The simulator drives the real `TwsrftScheduler` and `SpaceInferenceScheduler`; each stage's
latency comes from a `CurveSet` at its launch's SM count (co-running while the other stage is
busy); work proceeds as a fraction per second, at the new speed once the other starts or stops.

Modes:
- ``temporal``: the engine's temporal mode, as vLLM runs it: each step the encoder runs the
  oldest requests' whole passes on the whole GPU, then one continuous batch (decodes plus
  chunked prefills of several requests under ``max_num_batched_tokens``) - the engine's own
  scheduler objects, pipelined as the engine's (pipelined.py) or not (stepped.py);
- ``temporal-chunked``: the same loop, TWSRFT-ordered layer chunks for one window per step;
- ``spatial-static`` / ``spatial``: the engine's co-located step (spatial_loop.py) on a fixed
  split (``static_encoder_sms``) or SIS's split and prefill placement, chosen every step;
- ``shared``: both stages on all SMs without a partition; while both run, decode gets
  ``shared_decode_share`` of the SMs' throughput (default half, an optimistic view).

With ``encoder_ranks`` > 1 (a data-parallel vision encoder at TP, `analytic_tp`) encoder
queues run in rounds on the one encoder lane (`RoundTwsrft`); decode is in lockstep.

A launch keeps its SMs until it ends. While both lanes run, each op takes its isolated latency
x ``1 + slowdown`` from the contention table at the (encoder, decoder) SMs, kept current.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from spaceserve.runtime.encoder.data_parallel import RoundTwsrft
from spaceserve.runtime.modes import MODES, PLACEMENTS, TEMPORAL_MODES
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.scheduling import RateEstimator
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler, Split
from spaceserve.runtime.policy.sis_goodput import turns_order
from spaceserve.runtime.policy.twsrft import Grant, TwsrftScheduler, curve_cost
from spaceserve.runtime.sim.admission import SimAdmission
from spaceserve.runtime.sim.config import (
    SimConfig,
    chunked_window_s,
    default_allowed,
    engine_objects,
    sim_policy,
)
from spaceserve.runtime.sim.loops.pipelined import PipelinedStepLoop
from spaceserve.runtime.sim.loops.sis_window import dispatch_sis_window
from spaceserve.runtime.sim.loops.spatial_loop import SpatialLoop
from spaceserve.runtime.sim.loops.stepped import StepLoop
from spaceserve.runtime.sim.op import Op, lane_latencies
from spaceserve.runtime.sim.workload import Request

__all__ = ["MODES", "PLACEMENTS", "TEMPORAL_MODES", "Op", "SimConfig", "Simulator",
           "default_allowed", "sim_policy"]


@dataclass
class Simulator:
    """One GPU. Feed requests with `add` after `advance_to(arrival)`; `drain` finishes them."""

    curves: CurveSet
    config: SimConfig = field(default_factory=SimConfig)
    gpu: int = 0
    horizon: float = math.inf  # the background batch stops once this passes and work is done
    on_finish: Callable[[Request], None] | None = None  # told of every request that finishes

    def __post_init__(self) -> None:
        c, self.total = self.config, self.curves.num_sms
        self.now = 0.0
        temporal = c.mode in TEMPORAL_MODES
        if c.mode == "spatial-static" and not 0 < c.static_encoder_sms < self.total:
            raise ValueError(f"static_encoder_sms must be in 1..{self.total - 1}")
        self.policy = sim_policy(self.curves, c)
        self.allowed = self.policy.splits
        policy = c.encoder_policy or ("fifo" if c.mode == "temporal" else "twsrft")
        window = math.inf if c.mode == "temporal" else self.policy.window_s
        if c.mode == "temporal-chunked" and c.window_s is None:
            window = chunked_window_s(self.curves, c)
        self.window_s = window
        clock: Callable[[], float] = lambda: self.now
        cost = curve_cost(self.curves, self._encoder_target, corun=not temporal)
        deadline = self.policy.deadline_s if policy == "twsrft" else None
        kw = dict(policy=policy, window_s=window, max_wait_s=c.max_wait_s, clock=clock,
                  token_budget=c.token_budget, deadline_s=deadline, overdue_s=self.policy.overdue_s)
        ranks = int(self.curves.model.get("encoder_ranks", 1))  # a data-parallel encoder
        stepped = c.mode in ("spatial", "spatial-static") and ranks == 1  # the engine's step
        engine = engine_objects() if temporal or stepped else None
        loop = PipelinedStepLoop if c.async_scheduling else StepLoop
        self.loop = loop(self, policy, deadline, engine) if temporal else \
            SpatialLoop(self, engine) if stepped else None
        if self.loop is not None:  # the engine's stage: None for temporal's FIFO passes
            self.sched = self.loop.twsrft if c.mode != "temporal" else None
        elif ranks == 1:
            self.sched = TwsrftScheduler(self.curves.encoder_depth, cost, **kw)
        else:
            self.sched = RoundTwsrft(ranks, self.curves.encoder_depth, cost, **kw)
        self.sis, p = None, self.policy
        if c.mode == "spatial":
            self.sis = SpaceInferenceScheduler(
                self.curves, self.allowed, total_sms=self.total, tpot_factor=c.tpot_factor,
                min_gain=c.min_gain, min_dwell_s=c.min_dwell_s, chunk_tokens=c.chunk_tokens,
                objective=p.objective, slo=p.slo, decode_margin=p.decode_margin,
                ttft_margin=p.ttft_margin, comfort_factor=p.comfort_factor,
                actions=c.sis_actions, window_s=p.window_s, clock=clock,
                turns_order=turns_order(c.admission))
        # the engine's cooperative driver launches at most this many layers per decode step
        self._launch_model = c.mode in ("spatial", "spatial-static")
        self.layers_per_step = self.policy.layers_per_step() if self._launch_model else 1 << 30
        self._launched = 0
        self.arrivals = RateEstimator()
        self.split: Split | None = None
        self.requests: dict[int, Request] = {}
        self.prefill_q: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.ops: dict[str, Op] = {}
        self.timeline: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        self.splits: list[tuple[float, int]] = []
        self.wake_at = math.inf
        self._open = 0
        self._decided = False  # SIS decided since the last decode step (its host time)
        self._bg_ids = itertools.count()
        self.admission = SimAdmission(self)  # SLO-aware admission (a no-op under "queue")
        n, out = c.background, c.background_output
        for i in range(n):
            self._spawn_background(i * (out - 1) // n)

    def _spawn_background(self, offset: int = 0) -> None:
        """A background request already decoding (`offset` tokens into its output)."""
        c = self.config
        rid = -(self.gpu * 10**9 + next(self._bg_ids) + 1)
        req = Request(rid, self.now, 0, c.background_context + offset,
                      c.background_output - offset, "background", gpu=self.gpu)
        req.prefilled, req.generated = req.prompt_tokens, 1
        req.first_token = req.last_token = self.now
        self.requests[rid] = req
        self.decoding.append(req)
        if self.loop is not None:
            self.loop.add_background(req)

    # -- inputs ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """An image or text-only request arrives now."""
        if req.kind == "background" or req.rid in self.requests:
            raise ValueError(f"req: rid {req.rid} is a background or duplicate request")
        req.gpu = self.gpu
        if not self.admission.admit(req):
            return  # refused: shed at arrival, never runs
        self.requests[req.rid] = req
        self._open += 1
        req.prefilled = req.cached_tokens  # a prefix-cache hit: prefill only the rest
        if self.loop is not None:
            self.loop.add(req)
        elif req.patches > 0:  # a cached image is no encoder work
            self.sched.submit(req.rid, req.patches, req.arrival)
            self.arrivals.add(self.now, req.patches, req.prompt_tokens)
        else:
            self.prefill_q.append(req)

    def outstanding(self) -> int:
        """Unfinished requests other than the background batch (for routers)."""
        return self._open

    # -- time --------------------------------------------------------------------------------
    def advance_to(self, t: float) -> None:
        """Run events up to time `t` (math.inf: until nothing is left to run), or up to
        `wake_at` if an `on_finish` callback sets it meanwhile (a closed-loop client's next
        request); the caller resets `wake_at`."""
        if t < self.now:
            raise ValueError(f"t={t} is before the simulation clock {self.now}")
        while True:
            t = min(t, self.wake_at)
            self._dispatch()
            self._record()
            if not self.ops:
                if math.isfinite(t):
                    self.now = max(self.now, t)
                return
            lat = self._latencies()
            t_next = min(self.now + op.remaining * lat[lane] for lane, op in self.ops.items())
            if t_next > t:
                self._progress(t - self.now, lat)
                self.now = t
                return
            self._progress(t_next - self.now, lat)
            self.now = t_next
            for lane, op in list(self.ops.items()):
                if op.remaining * lat[lane] <= 1e-12:
                    del self.ops[lane]
                    self._complete(op)

    def drain(self, limit_s: float | None = None) -> None:
        """Run until every request has finished (the background batch stops after that), or
        for at most `limit_s` seconds more: requests unfinished then stay unfinished."""
        self.horizon = min(self.horizon, self.now)
        if limit_s is not None:
            if not limit_s >= 0:
                raise ValueError(f"limit_s must be >= 0, got {limit_s}")
            self.advance_to(self.now + limit_s)
            return
        self.advance_to(math.inf)
        left = [r.rid for r in self.requests.values() if r.finish is None and not r.shed]
        if left:
            raise RuntimeError(f"simulation stalled with unfinished requests {left[:10]}")

    def _latencies(self) -> dict[str, float]:
        c = self.config
        return lane_latencies(self.ops, c.mode == "shared", self.total, c.shared_decode_share)

    def _progress(self, dt: float, lat: dict[str, float]) -> None:
        for lane, op in self.ops.items():
            op.remaining = max(0.0, op.remaining - dt / lat[lane])

    def _record(self) -> None:
        held = (self._held("compute"), self._held("decode"))
        if self.timeline[-1][1:] != held:
            self.timeline.append((self.now, *held))

    def _held(self, lane: str) -> int:
        op = self.ops.get(lane)
        return op.sms if op is not None else 0

    # -- scheduling --------------------------------------------------------------------------
    def _encoder_target(self) -> int:
        mode = self.config.mode
        if mode == "spatial-static":
            return self.config.static_encoder_sms
        if mode == "spatial":
            e = self.split.encoder_sms if self.split is not None else 0
            return e or self.allowed[-1]
        return self.total

    def _placement(self) -> str:
        c = self.config
        if c.prefill_on != "auto":
            return c.prefill_on
        return self.split.prefill_on if (self.sis and self.split) else "compute"

    def sis_state(self) -> SisState:
        """What SIS observes: waiting encoder jobs, prompts to prefill, the decode load."""
        reqs, now = self.requests, self.now
        encode = tuple(PendingEncode(j.patches, j.layers_left,
                                     sum(reqs[r].prompt_tokens - reqs[r].prefilled
                                         for r in j.request_ids),
                                     now - j.arrival, len(j.request_ids))
                       for j in self.sched.jobs() if not j.running)
        prefill = tuple(r.prompt_tokens - r.prefilled for r in self.prefill_q)
        ages = tuple(now - r.arrival for r in self.prefill_q)
        batch = len(self.decoding)
        ctx = sum(r.context for r in self.decoding) / batch if batch else 0.0
        bucket = self.config.context_bucket
        rate, patches, prompt = self.arrivals.estimate(now)
        return SisState(encode, prefill, batch, round(ctx / bucket) * bucket, ages, rate,
                        patches, prompt)

    def _dispatch(self) -> None:
        self.admission.check()
        if self.loop is not None:
            self.loop.dispatch()
            return
        if "compute" not in self.ops:
            if self.sis is not None:
                split = self.sis.decide(self.sis_state())
                self._decided = True
                if self.split is None or split.encoder_sms != self.split.encoder_sms:
                    self.splits.append((self.now, split.encoder_sms))
                self.split = split
            if dispatch_sis_window(self):  # SIS gave the encoder the whole GPU for a window
                return
            self._start_compute(self._budget("compute"))
        if "decode" not in self.ops:
            self._start_decode(self._budget("decode"))
            if "compute" not in self.ops and "decode" in self.ops:  # a fresh launch budget
                self._start_compute(self._budget("compute"))

    def _budget(self, lane: str) -> int:
        mode, other = self.config.mode, self._held("decode" if lane == "compute" else "compute")
        if mode == "shared":
            return self.total
        if mode == "spatial-static":
            e = self.config.static_encoder_sms
            return e if lane == "compute" else self.total - e
        assert self.split is not None
        if lane == "compute":  # wait for a decode step to hand SMs back rather than start short
            e = self.split.encoder_sms
            return e if e <= self.total - other else 0
        return min(self.split.decoder_sms, self.total - other)

    def _encoder_waiting(self) -> bool:
        return any(not j.running for j in self.sched.jobs())

    def _start_compute(self, sms: int) -> None:
        if sms < 1:
            return
        c = self.curves
        chunking = self.ops["decode"].payload[1] if "decode" in self.ops else None
        ready = [r for r in self.prefill_q if r is not chunking]
        if "decode" not in self.ops and self._launched:  # an engine step without decode
            self._launched = 0
            if self._launch_model:
                self.layers_per_step = self.policy.layers_per_step()
        if ready and self._placement() == "compute":
            req = ready[0]
            self.prefill_q.remove(req)
            tokens, ctx = req.prompt_tokens - req.prefilled, req.prefilled
            self.ops["compute"] = Op("compute", "prefill", sms,
                                     lambda n, o: c.prefill(tokens, ctx, n, o), req)
        elif self._encoder_waiting() and self._launched < self.layers_per_step:
            g = self.sched.next_grant()
            assert g is not None
            if g.layers > self.layers_per_step - self._launched:  # the launch budget binds
                g = dataclasses.replace(g, layers=self.layers_per_step - self._launched)
            self._launched += g.layers
            self.ops["compute"] = Op("compute", "encode", sms,
                                     lambda n, o: c.encoder(g.patches, g.layers, n, o), g)
        else:
            return

    def _start_decode(self, sms: int) -> None:
        chunk_req = None
        if self.prefill_q and self._placement() == "decode":
            chunk_req = self.prefill_q[0]
        if sms < 1 or (not self.decoding and chunk_req is None):
            return
        batch = list(self.decoding)
        ctx = sum(r.context for r in batch) / len(batch) if batch else 0.0
        chunk, chunk_ctx = 0, 0
        if chunk_req is not None:
            chunk_ctx = chunk_req.prefilled
            chunk = min(self.config.chunk_tokens, chunk_req.prompt_tokens - chunk_ctx)
        c = self.curves
        # the engine's host work of a step, and of SIS's decisions since the last one
        host = self.config.host_s + (self.config.sis_host_s if self._decided else 0.0)
        self._decided = False
        self.ops["decode"] = Op("decode", "decode", sms,
                                lambda n, o: c.mixed_step(len(batch), ctx, chunk, chunk_ctx, n,
                                                          o) + host,
                                (batch, chunk_req, chunk))
        self._launched = 0
        if self._launch_model:
            op = self.ops["decode"]
            self.layers_per_step = self.policy.layers_per_step(
                op.latency(op.sms, self._held("compute") or False))

    # -- completions -------------------------------------------------------------------------
    def _complete(self, op: Op) -> None:
        if self.loop is not None:
            self.loop.complete(op)
        elif op.kind == "encode":
            g: Grant = op.payload  # type: ignore[assignment]
            for rid in self.sched.report(g.job_id, g.layers):
                req = self.requests[rid]
                req.encoded_at = self.now
                self.prefill_q.append(req)
        elif op.kind == "prefill":
            req: Request = op.payload  # type: ignore[no-redef]
            req.prefilled = req.prompt_tokens
            self._first_token(req)
        else:
            batch, chunk_req, chunk = op.payload  # type: ignore[misc]
            for r in batch:
                self._token(r)
            self.decoding = [r for r in self.decoding if r.finish is None]
            if chunk_req is not None:
                chunk_req.prefilled += chunk
                if chunk_req.prefilled >= chunk_req.prompt_tokens:
                    self.prefill_q.remove(chunk_req)
                    self._first_token(chunk_req)

    def _first_token(self, req: Request) -> None:
        req.first_token = req.last_token = self.now
        req.generated = 1
        if req.output_tokens <= 1:
            self._finish(req)
        else:
            self.decoding.append(req)

    def _token(self, r: Request) -> None:
        r.generated += 1
        r.itls.append(self.now - r.last_token)
        r.last_token = self.now
        if r.kind != "background":
            if r.generated >= r.output_tokens:
                self._finish(r)
            return
        stop = self.now >= self.horizon and self._open == 0
        if stop or r.generated >= r.output_tokens:
            r.finish = self.now
            if stop and self.loop is not None:
                self.loop.release(r)
            if not stop:
                self._spawn_background()

    def _finish(self, r: Request) -> None:
        r.finish = self.now
        self._open -= 1
        if self.on_finish is not None:
            self.on_finish(r)
