"""The engine step of the co-located modes: encoder, prefill and decode on their own partitions.

Modes (`Engine(..., mode=...)`; ``temporal`` is the engine's own time-multiplexed baseline):
- ``spatial``: SM partitions (green contexts where available, else kernel budgets alone) for a
  small set of splits; SIS picks the split and where prefill runs every step, from
  resource-utility curves (a ``curves=`` JSON file, else the analytic roofline of the model);
- ``spatial-static``: one fixed split (``encoder_sms``);
- ``shared``: two streams, no partition, every launch on the whole device - what running the
  encoder beside the decoder under MPS gives (use the torch backend's stock kernels for it).

One step: collect prefills finished in the compute partition, let SIS choose (a split change
waits until the compute side is idle, then switches streams with events between them), schedule
a continuous batch, and run it. Prefill chunks go beside the encoder on the compute partition
("compute": launched on the encoder stream under the encoder budget, sampled there into pinned
memory and collected by event query in a later step, so decode never waits for them) or stay in
the decode batch under its token budget ("decode"). Then the decode step is launched on the
decoder stream, the encoder stage issues its launches (cooperative driver) while that step runs
on the device, and the step's sampled tokens are read back - a sync of the decoder stream only.

SIS's whole-GPU window (``sis_actions`` superset, taking turns): the full partition becomes
current and steps alternate, as temporal-chunked runs them - an encoder step, where the decoder
pauses, the encoder stage launches TWSRFT grants on every SM until SIS's window of predicted time
is filled, then an ordinary step on the whole device whose batch carries the prompts' prefill
chunks - while SIS keeps choosing the window. The host waits for a window's launches only up to
the last that finishes a request's embeddings (used once the host has seen them complete); the
decoder streams wait for the window's end on the device, and the next step's host time runs
while the rest of the window computes. While taking turns the decode steps are pipelined
(``EngineConfig.async_scheduling``, as the temporal modes' steps, engine.py): a decode step on
the full partition is left in flight (`Engine._inflight`) and read back by the next step after
it launched its own, scheduled with placeholders (the decode inputs still on the device come
from the sampler's last-token table). A step that needs it settled - encoder work waiting (its
window pauses the decoder) or compute-partition prefills in flight, SIS leaving turns or
changing the split, nothing to decode - reads it back and ends there, so the next step plans
with the arrivals, embeddings and freed slots of that wait (as temporal-chunked's step does).

A request whose prefill is in flight on the compute stream is hidden from the scheduler (it can
be neither scheduled again nor preempted: its KV blocks are being written) and an abort of it
takes effect when the prefill completes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.kernels.budget import device_num_sms
from spaceserve.runtime.core.batch import ScheduledBatch
from spaceserve.runtime.core.request import Request, Status
from spaceserve.runtime.core.scheduler import Scheduler
from spaceserve.runtime.policy.model_curves import load_curves
from spaceserve.runtime.policy.scheduling import SchedulingPolicy
from spaceserve.runtime.policy.sis import SisState, SpaceInferenceScheduler, Split
from spaceserve.runtime.policy.sis_goodput import TURNS_ORDER, order_encoder, turns_order
from spaceserve.runtime.spatial.batch_split import split_batch, turn_budget
from spaceserve.runtime.spatial.encoder_stage import SpatialEncoderStage
from spaceserve.runtime.spatial.partition import Partition, PartitionSet
from spaceserve.runtime.spatial.split_set import (
    check_tp_partitions,
    engine_policy,
    make_partitions,
)

CONTEXT_BUCKET = 64  # SIS sees the mean decode context rounded to this
# Compute-partition prefills in flight at once; beyond that a step's prefill chunks stay in the
# decode batch. Two matches the runner planner's double-buffered pinned staging, whose reuse
# waits for the copy that last read the buffer (queued behind encoder work on that stream).
MAX_COMPUTE_PREFILLS = 2


@dataclass
class _Prefill:
    """A prefill batch launched on the compute partition: sampled ids land in `host`."""

    launched: Any  # engine.Launched: the batch and its draws (read back into pinned memory)
    event: Any


class SpatialRuntime:
    """Runs the engine steps of one co-located mode (module docstring)."""

    def __init__(self, runner: Any, stage: SpatialEncoderStage, partitions: PartitionSet, *,
                 mode: str, target: Partition, sis: SpaceInferenceScheduler | None = None,
                 prefill_on: str = "auto", curve_depth: int = 32,
                 clock: Callable[[], float] = time.monotonic,
                 graph_batch_sizes: tuple[int, ...] = (),
                 policy: SchedulingPolicy | None = None,
                 async_scheduling: bool = False) -> None:
        self.runner, self.stage, self.partitions = runner, stage, partitions
        self.async_scheduling = async_scheduling  # pipeline the decode steps while taking turns
        self.policy = policy
        self.graph_bytes: dict[int, int] = {}  # decode graph memory per partition (CUDA)
        self.mode, self.target, self.sis = mode, target, sis
        self.prefill_on, self.curve_depth, self.clock = prefill_on, curve_depth, clock
        self.graph_batch_sizes = graph_batch_sizes
        self.placement = "compute" if prefill_on == "auto" else prefill_on
        self.last_split: Split | None = None
        self.switches: list[tuple[float, int]] = [(clock(), partitions.current.requested)]
        self._prefills: deque[_Prefill] = deque()
        self._busy: set[int] = set()  # seq_no of requests whose prefill is in flight
        self._deferred: set[int] = set()  # aborts waiting for an in-flight prefill
        self.num_compute_prefills = 0
        self.num_windows = 0  # encoder steps of whole-GPU windows (decoder paused)
        self.num_pipelined = 0  # decode steps left in flight (read back by the next step)
        self.num_hidden = 0  # windows the host did not wait for (`_window_launch`)
        self._window = False  # SIS's split is a whole-GPU window
        self._encoder_turn = False  # the window's next step is the encoder's

    # -- the step --------------------------------------------------------------------------------
    def step(self, eng: Any) -> None:
        """One engine step after new requests were drained and the encoder stage polled."""
        self._collect(eng)
        if eng._inflight is not None and not self._may_pipeline():
            return self._settle(eng)  # the next step drains what arrived while it waited
        if not self._choose(eng):
            return  # the step in flight had to be read back before SIS's choice
        if self._window and self._window_step():
            return
        part = self.partitions.current
        with turn_budget(eng.scheduler, self.sis, self._window, part is not self.partitions.full):
            batch = self._schedule(eng.scheduler)
        if self._window and not batch and self._window_ready():  # nothing decodes: encode
            self._encoder_turn = True
            if self._window_launch():
                return
        batch.partition = part.budgets  # the runner runs each stage under its budget here
        on_compute = self.placement == "compute" and (part.requested > 0 or
                                                      self.partitions.shared) \
            and len(self._prefills) < MAX_COMPUTE_PREFILLS
        dec, pre = split_batch(batch) if on_compute else ((batch or None), None)
        if pre is not None:
            self._launch_prefill(eng, pre, part)
        if dec is None and eng._inflight is not None:  # nothing to plan beside it
            self._settle(eng)
            return
        if dec is None:
            if not self.stage.launch() and pre is None:
                self._wait()
            return
        with part.decoder_scope():
            launched = eng._launch(dec)
            self.stage.launch(self._launch_budget())  # while the decode step runs on the device
            if self.pipelining:  # left in flight; the previous step is read back now
                previous, eng._inflight = eng._inflight, launched
                self.num_pipelined += 1
                if previous is not None:
                    self._read_back(eng, previous)
                if not eng._active:  # every request of it has ended meanwhile
                    self._settle(eng)
                return
            if launched.sampled is not None:
                launched.sampled.fetch()  # a sync of the decoder stream only
        self._read_back(eng, launched)

    @property
    def turns_order(self) -> str:  # the encoder's order in turns: SIS's, from the admission
        return self.sis.turns_order if self.sis is not None else TURNS_ORDER

    @property
    def pipelining(self) -> bool:
        """Whether a decode step launched now is left in flight: asynchronous scheduling while
        SIS takes turns on the full partition."""
        return self.async_scheduling and self.sis is not None and self.sis.turns and \
            self.partitions.current is self.partitions.full

    def _may_pipeline(self) -> bool:
        """Whether this step may plan its decode step before reading back the one in flight:
        still taking turns, no encoder work waiting (its window pauses the decoder) and no
        compute-partition prefill in flight."""
        return self.pipelining and self.stage.num_pending == 0 and not self._prefills

    def _settle(self, eng: Any) -> None:
        """Read back the decode step in flight (waits for the device) and account it."""
        previous, eng._inflight = eng._inflight, None
        self._read_back(eng, previous)

    def _read_back(self, eng: Any, launched: Any) -> None:
        """Account a decode step's tokens; SIS measures the turns' intervals from them."""
        eng._complete(launched)
        if self.sis is not None and launched.batch.drawn_reqs:
            self.sis.spread.read(self.clock(), self.sis.turns and
                                 self.partitions.current is self.partitions.full)

    def _window_ready(self) -> bool:
        return self.partitions.current is self.partitions.full and \
            self.stage.num_pending > 0 and self.sis is not None

    def _window_step(self) -> bool:
        """SIS's whole-GPU window: every other step once the full partition is current is the
        encoder's (`_window_launch`); False when it is the decode step's turn or SIS passes
        the window (`sis_goodput.hold_encoder`). A step without a window is a decode step, so
        the next step with encoder work is the encoder's, as temporal-chunked's."""
        if not self._window_ready() or self.sis.hold:
            self._encoder_turn = False
            return False
        self._encoder_turn = not self._encoder_turn
        return self._encoder_turn and self._window_launch(hide=True)

    def _window_launch(self, hide: bool = False) -> bool:
        """One window as temporal-chunked runs it: the encoder on every SM for SIS's window of
        predicted time while the decoder pauses. With `hide` the host waits only for the last
        launch that finishes a request's embeddings (its prompt then prefills in the next step),
        if any: the decoder streams wait for the window's end on the device and the next step
        is planned and launched while the rest runs. Without it, the host waits for all."""
        n = self.stage.launch_window(self.sis.last_window_s)
        if not n:
            return False
        self.num_windows += 1
        end, finish = self.stage.window_end(n)
        if not hide or self.stage.driver != "cooperative":
            self.stage.wait_all()
            return True
        self.partitions.decoder_wait(end.event)
        if finish is not end:
            self.num_hidden += 1
        if finish is not None and hasattr(finish.event, "synchronize"):
            finish.event.synchronize()
        return True

    def _launch_budget(self) -> float | None:
        """Host seconds of encoder launches beside this decode step: a share of its predicted
        time (`SchedulingPolicy.launch_budget`), as the simulator models it."""
        if self.policy is None or self.last_split is None:
            return None
        return self.policy.launch_budget(self.last_split.predicted_tpot_s)

    def _schedule(self, sched: Scheduler) -> ScheduledBatch:
        if not self._busy:
            return sched.schedule()
        hidden = [r for r in sched.running if r.seq_no in self._busy]
        sched.running = [r for r in sched.running if r.seq_no not in self._busy]
        try:
            return sched.schedule()
        finally:
            sched.running = hidden + sched.running

    def _launch_prefill(self, eng: Any, pre: ScheduledBatch, part: Partition) -> None:
        with part.encoder_scope():
            launched = eng._launch(pre, stage="encoder")
            event = self.stage.record_event()
        self._prefills.append(_Prefill(launched, event))
        # sequences forked off these prompts wait for them too (their KV and first tokens)
        self._busy.update(r.seq_no for r in (*pre.reqs, *(c for _, c in pre.forks)))
        self.num_compute_prefills += 1

    def _collect(self, eng: Any) -> None:
        """Account every compute-partition prefill whose event has completed (no wait)."""
        while self._prefills and (self._prefills[0].event is None
                                  or self._prefills[0].event.query()):
            fl = self._prefills.popleft()
            self.partitions.decoder_wait(fl.event)  # its KV writes come first
            batch = fl.launched.batch
            seqs = (*batch.reqs, *(c for _, c in batch.forks))
            for r in seqs:
                self._busy.discard(r.seq_no)
            eng._complete(fl.launched, count_step=False)
            now = time.monotonic()
            for r in seqs:
                if r.seq_no in self._deferred:
                    self._deferred.discard(r.seq_no)
                    if r.status is not Status.FINISHED:
                        eng._end(r, "abort", None, now)

    def _wait(self) -> None:
        """Nothing to run this step: wait for a prefill or a grant in flight."""
        if self._prefills and hasattr(self._prefills[0].event, "synchronize"):
            self._prefills[0].event.synchronize()
        else:
            self.stage.wait()

    # -- splits and placement ----------------------------------------------------------------
    def _choose(self, eng: Any) -> bool:
        """SIS's split and prefill placement; False when a decode step in flight had to be read
        back first (SIS leaves turns or the split changes): the step ends there."""
        if self.sis is not None:
            split = self.sis.decide(self.sis_state(eng.scheduler))
            self.last_split = split
            deadline = self.policy.deadline_s if self.policy is not None else None
            order_encoder(self.stage.sched.scheds, self.sis.turns, deadline, self.sis.turns_order)
            self._window = split.encoder_sms >= self.partitions.total
            target = self.partitions.full if self._window else \
                self.partitions.get(split.encoder_sms)
            auto = split.prefill_on
        else:
            target, auto = self.target, "compute"
        self.placement = auto if self.prefill_on == "auto" else self.prefill_on
        if eng._inflight is not None and (target is not self.partitions.current
                                          or not self.pipelining):
            self._settle(eng)
            return False
        if target is self.partitions.current:
            self.stage.resume()
            return True
        self.stage.pause()  # the switch waits until the compute side is idle
        if self.stage.idle() and not self._prefills:
            self.partitions.switch(target)
            self.switches.append((self.clock(), target.requested))
            self.stage.resume()
        return True

    def sis_state(self, sched: Scheduler) -> SisState:
        """Waiting encoder jobs, prompts ready to prefill (with their ages), the decode load and
        the image arrival rate, for SIS."""
        media = self.stage.media  # cached items (encoder or prefix cache) are no encoder work
        ready = [r for r in sched.waiting if media.ready(r, r.prefix_hint)]
        prefill = [len(r.token_ids) + r.num_placeholders - max(r.num_computed, r.prefix_hint)
                   for r in ready]
        ages = [self.stage.age(r) for r in ready]
        decoding = 0
        context = 0
        for r in sched.running:
            left = len(r.token_ids) + r.num_placeholders - r.num_computed
            if left > 1:
                prefill.append(left)
                ages.append(self.stage.age(r))
            else:
                decoding += 1
                context += len(r.token_ids)
        mean = context / decoding if decoding else 0.0
        rate, patches, prompt = self.stage.arrivals.estimate(self.clock())
        return SisState(tuple(self.stage.pending_work(self.curve_depth)), tuple(prefill),
                        decoding, round(mean / CONTEXT_BUCKET) * CONTEXT_BUCKET, tuple(ages),
                        rate, patches, prompt)

    # -- aborts, failures, shutdown ------------------------------------------------------------
    def defer_abort(self, req: Request) -> bool:
        """True when `req`'s prefill is in flight: its abort waits for it."""
        if req.seq_no in self._busy:
            self._deferred.add(req.seq_no)
            return True
        return False

    def sm_split(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs) of the current partition: the budgets its steps carry."""
        return self.partitions.current.budgets

    @property
    def num_inflight(self) -> int:
        return len(self._prefills)

    def drain(self) -> None:
        """Wait for the compute side's launches; forget in-flight prefills (being ended)."""
        for fl in self._prefills:
            if hasattr(fl.event, "synchronize"):
                fl.event.synchronize()
        self.stage.drain()
        self._prefills.clear()
        self._busy.clear()
        self._deferred.clear()

    def close(self) -> None:
        self.stage.close()
        self.drain()
        self.partitions.close()


def build_spatial(runner: Any, config: Any, graph_sizes: Sequence[int], *,
                  clock: Callable[[], float] = time.monotonic, cache: Any = None
                  ) -> tuple[SpatialEncoderStage, SpatialRuntime]:
    """Partitions, decode graphs per partition, the encoder stage and the step runtime of a
    co-located mode from an `EngineConfig`; ValueError names a bad setting."""
    mode, device = config.mode, torch.device(runner.device)
    total = device_num_sms(device)
    curves = load_curves(config.curves, runner)
    policy = engine_policy(curves, config, total) if mode == "spatial" else None
    pset, parts = make_partitions(config, device, policy.splits if policy else None)
    check_tp_partitions(runner, pset, mode, total)
    captured: tuple[int, ...] = ()
    graph_bytes: dict[int, int] = {}  # device memory the decode graphs took, per partition
    for part in parts:
        before = torch.cuda.memory_reserved(device) if pset.cuda else 0
        with pset.capture_scope(part):
            captured = runner.capture_decode_graphs(graph_sizes, partition=part.budgets)
        if pset.cuda:
            graph_bytes[part.requested] = torch.cuda.memory_reserved(device) - before
    target = parts[0] if mode != "spatial" else pset.full
    pset.switch(target)
    if pset.cuda:
        torch.cuda.synchronize(device)  # weights, caches and graphs are ready on every stream
    stage = SpatialEncoderStage(runner, pset, curves, driver=config.encoder_driver,
                                window_s=config.encoder_window_s,
                                launch_budget_s=config.encoder_launch_budget_s,
                                max_held=config.max_held_embeddings, clock=clock,
                                plan=policy, cache=cache)
    sis = None if policy is None else SpaceInferenceScheduler(
        curves, sorted(pset.splits), total_sms=total, objective=policy.objective,
        slo=policy.slo, tpot_factor=policy.tpot_factor, decode_margin=policy.decode_margin,
        ttft_margin=policy.ttft_margin, comfort_factor=policy.comfort_factor,
        actions=config.sis_actions, window_s=policy.window_s, clock=clock,
        turns_order=turns_order(config.admission))
    runtime = SpatialRuntime(runner, stage, pset, mode=mode, target=target, sis=sis,
                             prefill_on=config.prefill_on, curve_depth=curves.encoder_depth,
                             clock=clock, graph_batch_sizes=captured, policy=policy,
                             async_scheduling=config.async_scheduling)
    runtime.graph_bytes = graph_bytes
    return stage, runtime
