"""The SpaceServe engine: requests in, tokens out.

One `step()` drains newly added and aborted requests, lets the encoder stage make progress,
schedules a continuous batch (decodes plus chunked prefills under a token budget), runs the
model once and samples every row on the device, starting the copy of the sampled ids (and
logprobs) to the host: the step's only device-to-host transfer.

Steps are pipelined (``EngineConfig.async_scheduling``, as vLLM's asynchronous scheduling): a
step schedules and launches step n+1 before it reads back step n, so the host's work for both
steps (planning; appending tokens, stop checks, streaming) runs while the device computes. While
the encoder stage has work left, a step is read back at once instead: the next window runs after
it anyway (the host plans the next step while that window runs), and the next step then sees
the held-embedding slots it frees and the requests that arrived meanwhile.
Step n+1 is scheduled as if every request of step n drew a token (a placeholder); the decode
inputs that are still placeholders are taken on the device from the sampler's last-token table,
so nothing waits for the host. A request that step n finishes has drawn one token too many in
step n+1, which is dropped. The co-located modes pipeline their decode steps the same way
while SIS takes turns on the whole GPU (spatial/step.py); sharing the GPU they run unpipelined
(their decode step already overlaps the encoder's launches).

Requests may be added, aborted, paused and resumed (control.py) from any thread; steps are
serialised by a lock. Settings are in config.py, outputs in outputs.py, the front ends in
frontends.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from spaceserve.runtime.core.batch import ScheduledBatch
from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.forks import make_group, waiting_on
from spaceserve.runtime.core.memory import max_sequence_len, plan_kv_cache
from spaceserve.runtime.core.request import Request, RequestOutput, SamplingParams, Status
from spaceserve.runtime.core.sampling_params import check_for_model
from spaceserve.runtime.core.scheduler import Scheduler
from spaceserve.runtime.encoder.cache import EncoderCache, default_capacity
from spaceserve.runtime.encoder.chunked import encoder_cost, temporal_stage
from spaceserve.runtime.engine.admission import EngineAdmission
from spaceserve.runtime.engine.config import ATTENTION_BACKENDS, DEFAULT_GRAPH_SIZES, EngineConfig
from spaceserve.runtime.engine.control import CONTROLS, RequestControl
from spaceserve.runtime.engine.frontends import EngineFrontends
from spaceserve.runtime.engine.outputs import OutputProcessor
from spaceserve.runtime.inputs.processor import load_processor
from spaceserve.runtime.inputs.prompt import process_prompt
from spaceserve.runtime.modes import MODES, TEMPORAL_MODES
from spaceserve.runtime.sample.sampler import Launched, Sampler
from spaceserve.runtime.worker.protocol import ModelRunner, StepLimits

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_GRAPH_SIZES", "MODES", "Engine", "EngineConfig",
           "load_processor"]


class Engine(EngineFrontends, RequestControl):
    """Serves one model runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None, *,
                 tokenizer: Any = None, processor: Any = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config = config or EngineConfig()
        tp = getattr(runner, "tp_size", 1)
        if tp != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but the runner "
                             f"runs {tp} rank(s); Engine.from_pretrained(..., "
                             "tensor_parallel_size=N) builds a tensor-parallel runner")
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer",
                                                                         None)
        self.processor = processor
        info = runner.info
        self.context_len = min(info.max_model_len, config.max_model_len or info.max_model_len)
        bs = config.block_size
        lens = config.graph_context_lens
        limits = StepLimits(config.max_num_seqs, config.max_num_batched_tokens,
                            self.context_len, bs, lens)
        peak = runner.profile_peak_bytes(limits, config.max_encoder_tokens_per_step)
        cache_bytes = config.encoder_cache_bytes
        if cache_bytes is None:
            cache_bytes = default_capacity(runner.device)
        self.encoder_cache = EncoderCache(cache_bytes,
                                          on_drop=getattr(runner, "release_encoding", None))
        on_gpu = torch.device(runner.device).type == "cuda"
        self.memory = plan_kv_cache(
            block_size=bs, block_bytes=runner.kv_block_bytes(bs), device=runner.device,
            num_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            activation_bytes=peak,
            reserve_bytes=config.graph_reserve_bytes + (cache_bytes if on_gpu else 0))
        self.max_model_len = max_sequence_len(self.context_len, self.memory)
        self.limits = StepLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                 self.max_model_len, bs, lens, config.graph_reserve_bytes)
        runner.allocate_kv_cache(self.memory.num_blocks, self.limits)
        sizes = config.graph_batch_sizes
        if sizes is None:
            sizes = tuple(s for s in DEFAULT_GRAPH_SIZES if s <= config.max_num_seqs)
        self.block_manager = BlockManager(self.memory.num_blocks, bs,
                                          enable_caching=config.enable_prefix_caching)
        self.spatial: Any = None  # the co-located modes' step runtime (spatial/step.py)
        self.encoder: Any
        if config.mode in TEMPORAL_MODES:
            self.graph_batch_sizes = runner.capture_decode_graphs(sizes)
            self.encoder = temporal_stage(runner, config, clock=clock or time.monotonic,
                                          cache=self.encoder_cache,
                                          cost=encoder_cost(runner, config))
        else:
            from spaceserve.runtime.spatial.step import build_spatial

            self.encoder, self.spatial = build_spatial(runner, config, sizes,
                                                       clock=clock or time.monotonic,
                                                       cache=self.encoder_cache)
            self.graph_batch_sizes = self.spatial.graph_batch_sizes
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=info.eos_token_ids,
            is_ready=self.encoder.ready, fair_share=config.fair_share)
        self.sampler = Sampler(runner.device, info.vocab_size, config.max_num_seqs,
                               info.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self._inflight: Launched | None = None  # the pipelined step awaiting its read-back
        self._watch_key: list[Request] | None = None
        self._watch: list[Request] = []
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _inbox, _active
        self._step_lock = threading.Lock()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._active: dict[str, Request] = {}
        self._paused: set[str] = set()  # ids of paused requests (control.py)
        self._outbox: list[RequestOutput] = []
        self._driver = None  # the stream front end's driving task (frontends.py)
        self.num_steps = 0
        self.admission = EngineAdmission(self)  # --admission slo (admission.py)

    # Requests in (pause, resume: control.py).
    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, sink: Callable[[RequestOutput], Any] |
                    None = None, stream: bool = False, fair_key: str | None = None) -> str:
        """Queue a prompt; returns its id. A bad prompt does not raise: the request ends with
        finish reason "error" and a message. A bad `sampling_params` or `fair_key` (its user:
        `EngineConfig.fair_share`) or a duplicate `request_id` raises ValueError. With ``n`` >
        1 its n sequences share the prompt's processing and KV blocks (forks.py); each ends
        with its own final output (`RequestOutput.index`), and `abort` ends them all. Under
        ``admission="slo"`` one that cannot meet its TTFT bound raises `Refused`."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        self.check_params(params)
        now = time.monotonic()
        seq_no = next(self._ids)
        rid = f"req-{seq_no}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={rid!r} must be a non-empty str")
        if fair_key is not None and not isinstance(fair_key, str):
            raise ValueError(f"fair_key={fair_key!r} must be a str or None")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        try:
            ids, mm = process_prompt(
                prompt, self.runner.info, context_len=self.context_len,
                capacity=self.memory.capacity_tokens, max_images=self.config.max_images_per_prompt,
                processor=self.processor, tokenizer=self.tokenizer)
            error = None
        except ValueError as exc:
            ids, mm, error = [], None, str(exc)
        if mm is not None and (self.encoder_cache.enabled or self.block_manager.enable_caching):
            _ = mm.content_hashes  # hashed here, on the caller's thread, not in the step loop
        req = Request(rid, seq_no, ids, params, seed, mm, arrival_time=now)
        req.sink, req.stream, req.fair_key = sink, stream, fair_key
        if params.n > 1:
            make_group(req, params.n, lambda: next(self._ids))
        self.admission.admit(req, error)  # SLO-aware: raises Refused, nothing queued
        with self._lock:
            if rid in self._active:
                raise ValueError(f"request_id={rid!r} is already in use")
            if error is None:
                self._active[rid] = req
                self._inbox.append(("add", req))
        if error is not None:  # never queued: nothing to release
            for seq in req.group.seqs if req.group is not None else (req,):
                seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", error
                seq.finished_time = now
                self._emit(seq, True)
        return rid

    def check_params(self, params: SamplingParams) -> None:
        """What a `SamplingParams` cannot check alone (`check_for_model`, ``n`` within the
        sequence slots); ValueError."""
        check_for_model(params, self.runner.info.vocab_size, self.tokenizer is not None)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n}: more sequences than the engine's max_num_seqs="
                             f"{self.config.max_num_seqs}")

    def has_unfinished(self) -> bool:  # paused requests alone give a step nothing to do
        return bool(self._inbox) or len(self._active) > len(self._paused)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def device_sms(self) -> int:
        """SMs of the runner's device (on a CPU: an H200's 132, or SPACESERVE_NUM_SMS)."""
        from spaceserve.kernels.budget import device_num_sms
        return int(device_num_sms(self.runner.device))

    def sm_split(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs) the next step runs under; the whole device for both in
        the time-multiplexed modes."""
        return self.spatial.sm_split() if self.spatial is not None else \
            (self.device_sms, self.device_sms)

    # The loop.

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs it produced (final ones, and incremental
        ones of streaming requests). Pipelined, a step's tokens come out of the next call."""
        with self._step_lock:
            now = time.monotonic()
            self._drain(now)
            self.admission.check(now)  # ends the requests that can no longer meet their SLO
            for req, msg in self.encoder.step():
                self._end(req, "error", msg, now)
            if self.spatial is not None:
                self.spatial.step(self)
            else:
                batch = self.scheduler.schedule()
                launched = self._launch(batch) if batch else None
                if launched is not None:
                    self.num_steps += 1  # counted when launched (its tokens come later)
                previous, self._inflight = self._inflight, launched
                if previous is not None:
                    self._complete(previous, count_step=False)
                if launched is not None and (not self.config.async_scheduling or not self._active
                                             or self.encoder.num_pending):
                    # unpipelined; every request of it has ended; or the encoder has work left:
                    # its next window runs after this step anyway, and planned after it the
                    # next step sees the slots it frees and the requests arriving meanwhile
                    self._inflight = None
                    self._complete(launched, count_step=False)
            out, self._outbox = self._outbox, []
            return out

    def _launch(self, batch: ScheduledBatch, stage: str | None = None) -> Launched:
        """Run `batch` on the device and draw its tokens (no host sync): decode inputs still
        in flight come from the sampler's last-token table; `stage` "encoder" runs it under
        the encoder's budget (a co-located mode's compute partition). A sequence forked this
        step draws from its parent's logits row."""
        reqs = batch.drawn_reqs
        sb = self.sampler.prepare(reqs, stage or "decoder", batch.admissions) if reqs else None
        if batch.pending:
            assert sb is not None
            batch.input_source = (self.sampler.last_tokens, sb.rows[:batch.num_decodes])
        logits = self.runner.execute(batch) if stage is None else \
            self.runner.execute(batch, stage=stage)
        if batch.forks:
            rows = torch.tensor([i for i, _ in batch.forks], device=logits.device)
            logits = torch.cat([logits, logits.index_select(0, rows)])
        return Launched(batch, self.sampler.sample(logits, sb) if sb is not None else None)

    def _complete(self, launched: Launched, count_step: bool = True) -> None:
        """Read a launched step's draws back (waits for the device) and account them."""
        sampled = launched.sampled
        if sampled is None:
            self._account(launched.batch, [], None, count_step)
            return
        ids, lps = sampled.fetch()
        self._account(launched.batch, ids, lps, count_step, sampled.batch.reqs)

    def _account(self, batch: ScheduledBatch, sampled: list[int],
                 logprobs: list[list[float]] | None = None, count_step: bool = True,
                 same_reqs: list[Request] | None = None) -> None:
        """A batch's drawn tokens: advance the requests, finish those that stopped (a stop
        token, the length limit, a stop string in the new text), stream."""
        now = time.monotonic()
        reqs = batch.drawn_reqs
        if logprobs is not None:
            self.outputs.add_logprobs(reqs, logprobs)
        for req in self.scheduler.update(batch, sampled, now):
            self._end(req, req.finish_reason, None, now)
        check = self.outputs.check_stop if self.outputs.decode is not None else None
        for req in self._watched(reqs if same_reqs is None else same_reqs):
            if req.status is Status.FINISHED:
                continue
            if req.params.stop and check is not None and check(req) is not None:
                self._end(req, "stop", None, now)
            elif req.stream:
                self._emit(req, False)
        if count_step:
            self.num_steps += 1

    def _watched(self, reqs: list[Request]) -> list[Request]:
        """A sampled batch's requests that stream or have stop strings (cached per batch)."""
        if reqs is not self._watch_key:
            self._watch_key = reqs
            self._watch = [r for r in reqs if r.stream or r.params.stop]
        return self._watch

    def _drain(self, now: float) -> None:
        while self._inbox:
            with self._lock:
                kind, item = self._inbox.popleft()
            if kind == "add":
                if item.status is Status.FINISHED:
                    continue
                try:
                    self.runner.prepare_request(item)
                except ValueError as exc:
                    self._end(item, "error", str(exc), now)
                    continue
                item.prefix_hint = self.scheduler.peek_cached(item)
                self.encoder.submit(item, item.prefix_hint)
                self.scheduler.add(item)
            elif kind in CONTROLS:
                self._apply_control(kind, item)
            else:
                req = self._active.get(item)
                # siblings not forked yet end with their parent (whose abort may be deferred)
                for seq in () if req is None else req.group.started() if req.group else (req,):
                    if seq.status is not Status.FINISHED and not (
                            self.spatial is not None and self.spatial.defer_abort(seq)):
                        self._end(seq, "abort", None, now)

    def _end(self, req: Request, reason: str, error: str | None, now: float) -> None:
        """Finish `req` for good: queues, KV blocks, embeddings, then its final output. Its
        siblings not forked yet end with it; the request is over when all its sequences are."""
        group = req.group
        unforked = list(waiting_on(req))  # only the first sequence's end ends them
        self.scheduler.finish(req, reason, error)
        self.encoder.release(req)
        req.finished_time = now
        for child in unforked:  # never started: nothing held but slots, released with req's
            self.scheduler.finish(child, reason, error)
            child.finished_time = now
        if unforked:
            group.unforked = []
        with self._lock:
            if self._active.get(req.request_id) is (req if group is None else group.seqs[0]) \
                    and (group is None or group.all_finished()):
                del self._active[req.request_id]
                self._paused.discard(req.request_id)
        self._emit(req, True)
        for child in unforked:
            self._emit(child, True)

    def _emit(self, req: Request, finished: bool) -> None:
        out = self.outputs.make(req, finished)
        self.admission.annotate(req, out, finished)  # ended by admission: the server's 503
        self._outbox.append(out)
        if req.sink is not None:
            req.sink(out)

    def counters(self) -> dict[str, int]:
        """Monotonic counters (docs/engine.md): requests shed by admission, encoder cache
        lookups and hits, encoder jobs, prefix cache tokens queried / hit, tokens prefilled."""
        cache, sched = self.encoder_cache, self.scheduler
        return {**self.admission.counts, "encoder_cache_queries": cache.queries,
                "encoder_cache_hits": cache.hits,
                "encoder_jobs": self.encoder.media.num_jobs,
                "prefix_cache_queried_tokens": sched.prefix_queried_tokens,
                "prefix_cache_hit_tokens": sched.prefix_hit_tokens,
                "prefill_tokens": sched.prefill_tokens}

    def check_idle(self) -> None:
        """AssertionError unless nothing (request, KV block, embedding) is held."""
        with self._step_lock:
            assert not self._active and not self._inbox, f"{len(self._active)} requests active"
            assert self._inflight is None, "a pipelined step was never read back"
            self.scheduler.check_idle()
            self.encoder_cache.check_idle()
            assert self.encoder.num_held == 0, f"{self.encoder.num_held} embeddings still held"
            assert self.encoder.num_pending == 0, "encoder work still pending"
            if self.spatial is not None:
                assert self.spatial.num_inflight == 0, "a compute-partition prefill is in flight"

    def close(self) -> None:
        """Stop the encoder stage's thread, release SM partitions, stop TP worker processes."""
        if self.spatial is not None:
            with self._step_lock:
                self.spatial.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

