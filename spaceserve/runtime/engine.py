"""The SpaceServe engine: requests in, tokens out.

One `step()` drains newly added and aborted requests, lets the encoder stage make progress,
schedules a continuous batch (decodes plus chunked prefills under a token budget), runs the
model once, samples every row in one device operation and reads the sampled ids back (the
step's only device-to-host transfer), then finishes the requests that stopped. Host work per
step grows with the batch, never with the number of layers.

Requests may be added and aborted from any thread; steps are serialised by a lock. `generate`
runs steps until its prompts are done; `stream` drives steps from an asyncio task (each step in
a worker thread, so the event loop stays responsive) and yields incremental outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .block_manager import BlockManager
from .encoder_chunked import TEMPORAL_MODES, temporal_stage
from .memory import GRAPH_RESERVE_BYTES, max_sequence_len, plan_kv_cache
from .request import Request, RequestOutput, SamplingParams, Status, process_prompt
from .runner import ModelRunner, StepLimits
from .sampler import Sampler
from .scheduler import Scheduler
from .slo import DEFAULT_SLO, Slo

MODES = ("temporal", "temporal-chunked", "shared", "spatial-static", "spatial")
ATTENTION_BACKENDS = ("triton", "torch")
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; every field is validated (ValueError names it).

    `num_kv_blocks` None sizes the cache from free device memory (CPU: a default count).
    `max_model_len` None takes the model's context. `graph_batch_sizes` None: the default
    buckets up to `max_num_seqs` (a runner without graphs ignores them).

    Co-located modes (``shared``, ``spatial-static``, ``spatial``; see `epd.py`):
    `encoder_sms` is the static split (None: about half the device, a multiple of 8);
    `encoder_splits` the splits partitions are made for in ``spatial`` (None: about a quarter,
    half and three quarters); `curves` a resource-utility curves JSON for SIS and TWSRFT (None:
    the analytic model); `prefill_on` "auto" (SIS in ``spatial``, else the compute partition),
    "compute" or "decode"; `encoder_driver` "cooperative" or "thread" (the cooperative one
    launches encoder layers for `encoder_launch_budget_s` of host time per step, while the
    decode step runs, at least one layer per step; `encoder_window_s` is TWSRFT's grant
    window, and ``temporal-chunked``'s encoder chunk between decode steps, see
    `encoder_chunked.py`); `green_contexts` False
    forces kernel budgets alone; `programs_per_sm` applies inside green partitions only.
    `slo`: the latency SLO requests are judged by and ``spatial``'s SIS aims at (`slo.py`; an
    `Slo` or its text such as ``"ttft:2000,tpot:50"``, the default); `sis_objective` "goodput"
    or "tpot" (`sis.py`); `sis_load` the decode (batch, mean context) the split set is chosen
    for when `encoder_splits` is None (`policy.py`, the simulator's background batch).
    """

    mode: str = "temporal"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_images_per_prompt: int = 8
    max_encoder_tokens_per_step: int = 16384
    max_held_embeddings: int = 64
    gpu_memory_utilization: float = 0.9
    graph_reserve_bytes: int = GRAPH_RESERVE_BYTES
    graph_batch_sizes: tuple[int, ...] | None = None
    seed: int = 0
    encoder_sms: int | None = None
    encoder_splits: tuple[int, ...] | None = None
    curves: str | None = None
    prefill_on: str = "auto"
    encoder_driver: str = "cooperative"
    encoder_window_s: float = 0.02
    encoder_launch_budget_s: float = 0.003
    green_contexts: bool = True
    programs_per_sm: int = 1
    slo: Slo | str = DEFAULT_SLO
    sis_objective: str = "goodput"
    sis_load: tuple[int, int] = (32, 1152)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not available; modes: {', '.join(MODES)}")
        try:
            object.__setattr__(self, "slo", Slo.of(self.slo))
        except ValueError as exc:
            raise ValueError(f"slo={self.slo!r}: {exc}") from None
        from .epd import check_config

        check_config(self)  # the co-located modes' settings
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_images_per_prompt", "max_encoder_tokens_per_step",
                     "max_held_embeddings", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is None and name in ("num_kv_blocks", "max_model_len"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                             "(0, 1]")
        if self.graph_batch_sizes is not None and any(
                not isinstance(s, int) or s < 1 for s in self.graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes={self.graph_batch_sizes!r} must be ints >= 1")


class Engine:
    """Serves one model runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None, *,
                 tokenizer: Any = None, processor: Any = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer",
                                                                         None)
        self.processor = processor
        info = runner.info
        self.context_len = min(info.max_model_len, config.max_model_len or info.max_model_len)
        bs = config.block_size
        limits = StepLimits(config.max_num_seqs, config.max_num_batched_tokens,
                            self.context_len, bs)
        peak = runner.profile_peak_bytes(limits, config.max_encoder_tokens_per_step)
        self.memory = plan_kv_cache(
            block_size=bs, block_bytes=runner.kv_block_bytes(bs), device=runner.device,
            num_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            activation_bytes=peak, reserve_bytes=config.graph_reserve_bytes)
        self.max_model_len = max_sequence_len(self.context_len, self.memory)
        self.limits = StepLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                 self.max_model_len, bs)
        runner.allocate_kv_cache(self.memory.num_blocks, self.limits)
        sizes = config.graph_batch_sizes
        if sizes is None:
            sizes = tuple(s for s in DEFAULT_GRAPH_SIZES if s <= config.max_num_seqs)
        self.block_manager = BlockManager(self.memory.num_blocks, bs)
        self.spatial: Any = None  # the co-located modes' step runtime (epd.py)
        self.encoder: Any
        if config.mode in TEMPORAL_MODES:
            self.graph_batch_sizes = runner.capture_decode_graphs(sizes)
            self.encoder = temporal_stage(runner, config, clock=clock or time.monotonic)
        else:
            from .epd import build_spatial

            self.encoder, self.spatial = build_spatial(runner, config, sizes,
                                                       clock=clock or time.monotonic)
            self.graph_batch_sizes = self.spatial.graph_batch_sizes
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=info.eos_token_ids,
            is_ready=self.encoder.ready)
        self.sampler = Sampler(runner.device)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _inbox, _active
        self._step_lock = threading.Lock()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._active: dict[str, Request] = {}
        self._outbox: list[RequestOutput] = []
        self._driver: asyncio.Task | None = None
        self.num_steps = 0

    @classmethod
    def from_pretrained(cls, path: str, *, mode: str = "temporal",
                        attention_backend: str | None = None, dtype: Any = None,
                        device: Any = None, **config: Any) -> Engine:
        """Load a Qwen2-VL checkpoint (a local directory) with its tokenizer and processor.
        `attention_backend` None: "torch" (stock kernels) in ``shared`` mode, else "triton"."""
        cfg = EngineConfig(mode=mode, **config)
        if attention_backend is None:
            attention_backend = "torch" if mode == "shared" else "triton"
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        from .qwen2_vl_runner import Qwen2VLRunner

        runner = Qwen2VLRunner.from_pretrained(path, attention_backend=attention_backend,
                                               dtype=dtype, device=device)
        tokenizer, processor = load_processor(path)
        return cls(runner, cfg, tokenizer=tokenizer, processor=processor)

    # Requests in.

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, sink: Callable[[RequestOutput], Any] |
                    None = None, stream: bool = False) -> str:
        """Queue a prompt; returns its id. A bad prompt does not raise: the request ends with
        finish reason "error" and a message. A bad `sampling_params` or a duplicate
        `request_id` raises ValueError (caller mistakes, not request data)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        now = time.monotonic()
        seq_no = next(self._ids)
        rid = f"req-{seq_no}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={rid!r} must be a non-empty str")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        try:
            ids, mm = process_prompt(
                prompt, self.runner.info, context_len=self.context_len,
                capacity=self.memory.capacity_tokens, max_images=self.config.max_images_per_prompt,
                processor=self.processor, tokenizer=self.tokenizer)
            error = None
        except ValueError as exc:
            ids, mm, error = [], None, str(exc)
        req = Request(rid, seq_no, ids, params, seed, mm, arrival_time=now)
        req.sink, req.stream = sink, stream
        with self._lock:
            if rid in self._active:
                raise ValueError(f"request_id={rid!r} is already in use")
            if error is None:
                self._active[rid] = req
                self._inbox.append(("add", req))
        if error is not None:  # never queued: nothing to release
            req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
            req.finished_time = now
            self._emit(req, True)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request (takes effect at the next step); False when it is not active."""
        with self._lock:
            if request_id not in self._active:
                return False
            self._inbox.append(("abort", request_id))
            return True

    def has_unfinished(self) -> bool:
        return bool(self._active)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # The loop.

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs it produced (final ones, and incremental
        ones of streaming requests)."""
        with self._step_lock:
            now = time.monotonic()
            self._drain(now)
            for req, msg in self.encoder.step():
                self._end(req, "error", msg, now)
            if self.spatial is not None:
                self.spatial.step(self)
            else:
                batch = self.scheduler.schedule()
                if batch:
                    logits = self.runner.execute(batch)
                    sampled = self.sampler(logits, batch.sample_reqs).tolist() \
                        if batch.sample_reqs else []
                    self._account(batch, sampled)
            out, self._outbox = self._outbox, []
            return out

    def _account(self, batch: Any, sampled: list[int], count_step: bool = True) -> None:
        """A batch's sampled tokens: advance the requests, finish those that stopped, stream."""
        now = time.monotonic()
        for req in self.scheduler.update(batch, sampled, now):
            self._end(req, req.finish_reason, None, now)
        for req in batch.sample_reqs:
            if req.stream and req.status is Status.RUNNING:
                self._emit(req, False)
        if count_step:
            self.num_steps += 1

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
                self.encoder.submit(item)
                self.scheduler.add(item)
            else:
                req = self._active.get(item)
                if req is not None and not (self.spatial is not None
                                            and self.spatial.defer_abort(req)):
                    self._end(req, "abort", None, now)

    def _end(self, req: Request, reason: str, error: str | None, now: float) -> None:
        """Finish `req` for good: queues, KV blocks, embeddings, then its final output."""
        self.scheduler.finish(req, reason, error)
        self.encoder.release(req)
        req.finished_time = now
        with self._lock:
            if self._active.get(req.request_id) is req:
                del self._active[req.request_id]
        self._emit(req, True)

    def _emit(self, req: Request, finished: bool) -> None:
        out_ids = req.token_ids[req.num_prompt_tokens:]
        new = out_ids[req.num_emitted:]
        req.num_emitted = len(out_ids)
        text = None
        if self.tokenizer is not None and (finished or req.stream):
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        out = RequestOutput(req.request_id, req.prompt_token_ids, out_ids, new, text, finished,
                            req.finish_reason if finished else None, req.error, req.metrics())
        self._outbox.append(out)
        if req.sink is not None:
            req.sink(out)

    def fail_all(self, message: str) -> None:
        """End every active request with an error (the model failed; nothing can continue)."""
        with self._step_lock:
            if self.spatial is not None:
                self.spatial.drain()
            now = time.monotonic()
            with self._lock:
                self._inbox.clear()
                reqs = list(self._active.values())
            for req in reqs:
                self._end(req, "error", message, now)

    # Front ends.

    def generate(self, prompts: Any, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if isinstance(prompts, (dict, str)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}

        def collect(out: RequestOutput) -> None:
            if out.finished:
                results[out.request_id] = out

        rids = [self.add_request(p, sp, sink=collect)
                for p, sp in zip(prompts, params, strict=True)]
        while len(results) < len(rids):
            if not self.has_unfinished():
                raise RuntimeError("engine went idle with requests unfinished")
            self.step()
        return [results[r] for r in rids]

    async def stream(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per new token, the last one with ``finished`` set. Leaving
        the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop is gone: nobody listens any more
                pass

        # preprocessing (image processor, tokenizer) runs off the event loop's thread
        rid = await asyncio.to_thread(self.add_request, prompt, sampling_params,
                                      request_id=request_id, sink=sink, stream=True)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        done = False
        try:
            while not done:
                out = await queue.get()
                done = out.finished
                yield out
        finally:
            if not done:
                self.abort(rid)

    async def _drive(self) -> None:
        while self.has_unfinished():
            try:
                await asyncio.to_thread(self.step)
            except Exception as exc:  # report on every request instead of hanging streams
                self.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                return

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing (request, KV block, embedding) is held."""
        assert not self._active and not self._inbox, f"{len(self._active)} requests active"
        self.scheduler.check_idle()
        assert self.encoder.num_held == 0, f"{self.encoder.num_held} embeddings still held"
        assert self.encoder.num_pending == 0, "encoder work still pending"
        if self.spatial is not None:
            assert self.spatial.num_inflight == 0, "a compute-partition prefill is in flight"

    def close(self) -> None:
        """Stop the encoder stage's thread and release SM partitions (co-located modes)."""
        if self.spatial is not None:
            with self._step_lock:
                self.spatial.close()


def load_processor(path: str) -> tuple[Any, Any]:
    """The checkpoint's tokenizer and processor from a local directory (None when absent)."""
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = processor = None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError:
        # transformers' Qwen2-VL processor wants torchvision for its video half; images need only
        # the image processor and the tokenizer, which SpaceServe's chat preprocessor combines.
        from spaceserve.server.chat import ChatPreprocessor

        try:
            processor = ChatPreprocessor.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError):
            processor = None
    except (OSError, ValueError, KeyError, TypeError):
        processor = None
    try:
        tokenizer = getattr(processor, "tokenizer", None) or AutoTokenizer.from_pretrained(
            path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None
    if processor is not None and not hasattr(processor, "image_processor"):
        processor = None  # a bare tokenizer cannot take images
    return tokenizer, processor
