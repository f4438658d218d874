"""The time-multiplexed modes in the simulator: the engine's own step loop, priced by curves.

``temporal`` and ``temporal-chunked`` run what `engine.Engine.step` runs unpipelined
(``async_scheduling`` off; pipelined.py runs it pipelined, the engine's default): each
step first lets the encoder stage work on the whole GPU, then the engine's `core.Scheduler`
(over a `core.BlockManager`) picks a continuous batch - decodes plus chunked prefills of several
requests under ``max_num_batched_tokens``, at most ``max_num_seqs`` sequences, KV blocks with
preemption by recompute - and the batch runs as one whole-GPU step priced by `batch_seconds`,
plus ``host_s`` of host time (scheduling, planning, sampling).

The encoder stages are the engine's rules on the simulator's clock:
- ``temporal`` (`encoder.temporal.TemporalEncoderStage`): oldest requests first, whole passes,
  at most ``max_encoder_tokens`` media tokens a step (always one request) as one batch;
- ``temporal-chunked`` (`encoder.chunked.ChunkedEncoderStage`): TWSRFT (deadline-aware under a
  TTFT bound) grants layer chunks until one window of predicted whole-GPU time is spent (at
  least one layer while work waits), each request encoded alone.
Both admit no new encoder job while ``max_held`` requests hold or compute embeddings; held
embeddings are released when the request finishes. Requests that arrive during a step join at
the next one, as the engine drains its inbox at the start of a step.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from spaceserve.runtime.encoder.data_parallel import RankedTwsrft, assign_ranks
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.sim.op import Op
from spaceserve.runtime.sim.workload import PATCHES_PER_TOKEN, Request

TOKEN = 1  # every simulated draw: never a stop token (requests end by length)


def batch_seconds(curves: CurveSet, batch: Any, sms: int, corun: bool | int = False,
                  side: str = "decoder") -> float:
    """Seconds of one engine step on `sms` SMs (`corun`: the other side's SMs while it runs
    beside, False alone; `side`: whose contention a prefill chunk pays): the decode step of its
    single-token sequences at their mean context, plus each prefill chunk's marginal cost over
    the smallest prefill pass (which streams the weights the decode step streams anyway); a step
    without decodes pays its first chunk whole (`CurveSet.mixed_step` for one chunk)."""
    nd = batch.num_decodes
    ctx = sum(batch.num_cached[:nd]) / nd + 1 if nd else 0.0
    t = curves.decode(nd, ctx, sms, corun) if nd else 0.0
    tokens0 = curves.prefill_curve.grid["tokens"][0]
    for n, c in zip(batch.num_new[nd:], batch.num_cached[nd:], strict=True):
        whole = curves.prefill(n, c, sms, corun, side)
        t += whole if t == 0.0 else max(0.0, whole - curves.prefill(tokens0, c, sms, corun,
                                                                       side))
    return t


class StepLoop:
    """The engine's step loop for one simulated GPU (a `Simulator`) in a time-multiplexed
    mode. `engine` holds the engine's scheduler objects (`config.engine_objects`)."""

    def __init__(self, sim: Any, policy: str, deadline_s: float | None, engine: Any) -> None:
        self._request, self._params, self._finished = engine.Request, engine.SamplingParams, \
            engine.Status.FINISHED
        c, curves = sim.config, sim.curves
        self.sim, self.curves, self.total = sim, curves, curves.num_sms
        self.bm = engine.BlockManager(c.kv_blocks, c.block_size)
        self.sched = engine.Scheduler(self.bm, max_num_seqs=c.max_num_seqs,
                                      max_num_batched_tokens=c.max_num_batched_tokens,
                                      max_model_len=1 << 40, is_ready=self._ready)
        self.chunked = c.mode == "temporal-chunked"
        self.window_s = sim.window_s
        self.core: dict[int, Any] = {}  # sim rid -> the scheduler's request
        self.sim_of: dict[int, Request] = {}  # core seq_no -> sim request
        self.inbox: deque[Request] = deque()
        self.backlog: deque[Request] = deque()  # encoder jobs waiting for a held slot
        self.jobs: set[int] = set()  # rids whose embeddings are being computed
        self.held: set[int] = set()  # rids holding embeddings
        self.encoded: set[int] = set()
        self.layer_s = lambda patches: curves.encoder(patches, 1, self.total)
        self.ranks = int(curves.model.get("encoder_ranks", 1))  # a data-parallel encoder
        self._offset = 0.0  # encoder time spent so far in the window being planned
        self.twsrft = RankedTwsrft(
            self.ranks, curves.encoder_depth, lambda p, n: n * self.layer_s(p), policy=policy,
            window_s=self.window_s, max_wait_s=c.max_wait_s, token_budget=1,
            deadline_s=deadline_s, clock=lambda: sim.now + self._offset)
        self.phase = "idle"  # idle -> encode -> step -> (next step) encode ...
        self.ran = False  # this step's encoder op has been planned
        self.num_steps = self.num_preemptions = 0

    # -- requests ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.inbox.append(req)

    def add_background(self, req: Request) -> None:
        """A request already decoding: its prompt and generated tokens are cached, so its first
        step is a decode (no prefill is charged)."""
        core = self._core(req, req.prompt_tokens, req.output_tokens - req.generated)
        core.num_computed = core.num_prompt_tokens - 1
        self.sched.add(core)

    def _core(self, req: Request, prompt: int, max_tokens: int) -> Any:
        seq = len(self.sim_of)
        core = self._request(str(req.rid), seq, [TOKEN] * prompt,
                             self._params(max_tokens=max(1, max_tokens), ignore_eos=True), 0)
        self.core[req.rid], self.sim_of[seq] = core, req
        return core

    def _ready(self, core: Any, start: int) -> bool:
        req = self.sim_of[core.seq_no]
        return req.patches <= 0 or req.rid in self.encoded

    def _drain(self) -> None:
        while self.inbox:
            req = self.inbox.popleft()
            if req.patches > 0:
                self.backlog.append(req)
                self.sim.arrivals.add(self.sim.now, req.patches, req.prompt_tokens)
            core = self._core(req, req.prompt_tokens, req.output_tokens)
            core.num_computed = req.cached_tokens  # a prefix-cache hit: prefill only the rest
            self.sched.add(core)

    def _admit(self) -> None:
        """Start backlogged encoder jobs while fewer than ``max_held`` requests hold or compute
        embeddings (``temporal``'s stage counts the batch it builds)."""
        if not self.chunked:
            return
        while self.backlog and len(self.held) + len(self.jobs) < self.sim.config.max_held:
            req = self.twsrft.take(self.backlog, lambda r: (r.arrival, r.patches))
            self.jobs.add(req.rid)
            self.twsrft.submit(req.rid, req.patches, arrival=req.arrival)

    # -- the step loop ----------------------------------------------------------------------
    def dispatch(self) -> None:
        """Start the next op of the loop if the GPU is free."""
        sim = self.sim
        while not sim.ops:
            if self.phase == "idle":
                if not (self.inbox or self.backlog or self.jobs or self.sched.has_work()):
                    return
                self.phase = "encode"
                self.ran = False
                self._drain()
                self._admit()
            if self.phase == "encode":
                self.phase = "step"
                if self._start_encode():
                    return
            self._admit()
            batch = self.sched.schedule()
            self.phase = "idle"
            if batch:
                self.num_preemptions += len(batch.preempted)
                t = batch_seconds(self.curves, batch, self.total)
                t += sim.config.host_s  # unpipelined: the host plans, then the step runs
                sim.ops["decode"] = Op("decode", "decode", self.total, lambda n, o, t=t: t,
                                       batch)
                return
            room = len(self.held) + len(self.jobs) < sim.config.max_held
            if not (self.inbox or self.jobs or (self.backlog and room)):
                return  # nothing can run until something arrives or finishes

    def _start_encode(self) -> bool:
        """Start this step's encoder op (the stage's whole work of the step); False when the
        stage has nothing to run."""
        if self.ran:
            return False
        self.ran = True
        done, t = self._window() if self.chunked else self._passes()
        if t <= 0.0:
            return False
        self.sim.ops["compute"] = Op("compute", "encode", self.total, lambda n, o, t=t: t, done)
        return True

    def _passes(self) -> tuple[list[Request], float]:
        """``temporal``: the oldest requests' whole passes, at most ``max_encoder_tokens``
        media tokens per encoding rank (always one request); a data-parallel encoder divides
        them over its ranks by predicted cost (`assign_ranks`) and lasts its slowest rank."""
        c, curves = self.sim.config, self.curves
        batch: list[Request] = []
        tokens = 0
        while self.backlog and len(self.held) + len(batch) < c.max_held:
            n = self.backlog[0].patches // PATCHES_PER_TOKEN
            if batch and tokens + n > c.max_encoder_tokens * self.ranks:
                break
            batch.append(self.backlog.popleft())
            tokens += n
        if not batch:
            return [], 0.0
        depth = curves.encoder_depth
        if self.ranks == 1:
            return batch, curves.encoder(sum(r.patches for r in batch), depth, self.total)
        costs = [curves.encoder(r.patches, depth, self.total) for r in batch]
        per = [0] * self.ranks
        for r, rank in zip(batch, assign_ranks(costs, self.ranks), strict=True):
            per[rank] += r.patches
        return batch, max(curves.encoder(p, depth, self.total) for p in per)

    def _window(self) -> tuple[list[Request], float]:
        """``temporal-chunked``: on each rank, TWSRFT grants until one window of predicted time
        is spent (at least one layer while work waits), the clock running on as chunks run;
        the ranks run at once, the step's encoder time is the slowest rank's."""
        done: list[Request] = []
        longest = 0.0
        for sched in self.twsrft.scheds:
            spent, ran = 0.0, False
            while spent < self.window_s or not ran:
                self._offset = spent
                grant = sched.next_grant()
                if grant is None:
                    break
                per_layer = self.layer_s(grant.patches)
                layers = max(1, min(grant.layers, math.ceil((self.window_s - spent) / per_layer
                                                            - 1e-9)))
                spent += layers * per_layer
                ran = True
                self._offset = spent
                done += [self.sim.requests[r] for r in sched.report(grant.job_id, layers)]
            longest = max(longest, spent)
        self._offset = 0.0
        return done, longest

    def complete(self, op: Op) -> None:
        """An op of the loop ended now."""
        sim = self.sim
        if op.kind == "encode":
            for req in op.payload:  # type: ignore[attr-defined]
                self.jobs.discard(req.rid)
                req.encoded_at = sim.now
                if req.finish is None and not req.shed:  # not ended by admission meanwhile
                    self.encoded.add(req.rid)
                    self.held.add(req.rid)
            return
        self.num_steps += 1
        self.account(op.payload)

    def account(self, batch: Any) -> None:
        """A batch's tokens were drawn now: advance its requests (first tokens, tokens)."""
        sim = self.sim
        drawn = batch.drawn_reqs
        live = [core for core in drawn if core.num_placeholders]  # not ended meanwhile
        self.sched.update(batch, [TOKEN] * len(drawn), sim.now)
        for core in live:
            req = self.sim_of[core.seq_no]
            if req.generated == 0:
                req.prefilled = req.prompt_tokens
                sim._first_token(req)
            else:
                sim._token(req)
            if req.finish is not None:
                self.release(req)
        sim.decoding = [r for r in sim.decoding if r.finish is None]

    def release(self, req: Request) -> None:
        """`req` has finished (or the background batch stopped): free its slot, KV blocks and
        embeddings."""
        core = self.core.pop(req.rid, None)
        if core is not None and core.status is not self._finished:
            self.sched.finish(core, "length")
        self.held.discard(req.rid)
        self.encoded.discard(req.rid)

    def stats(self) -> dict[str, Any]:
        return {"steps": self.num_steps, "preemptions": self.num_preemptions}
