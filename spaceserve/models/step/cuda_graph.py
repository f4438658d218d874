"""Decode steps replayed from CUDA graphs, through the attention backends' plan/run split.

A `DecodeGraph` captures one decode step of a fixed padded batch size, block-table width and SM
budget on an all-padding step (nothing is stored, nothing read), so it can be built at start-up.
It captures on the buffers of a `ContextPlanner`: its own, or the caller's (a runner's), so
that every later step the planner lays out with the same shape already sits where the graph
reads, and a replay only refills the backend's plan on the host and launches. A context from
anywhere else is copied in first. A graph captured on a green-context stream stays bound to
that partition.

A `DecodeGraphSet` holds every decode graph of one model and KV cache: one per (batch size,
block-table width, SM budget), captured largest first into one shared memory pool (decode graphs
never replay at the same time, so their temporaries can share memory), each copying its logits
into one shared output buffer so that no graph keeps an output of its own in the pool. The
memory they take (pool growth at capture plus the output buffer) is bounded: `max_bytes`,
checked after every capture (`GraphMemoryError` past it, with the graphs dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from spaceserve.models.qwen2_vl_text import KVCache
from spaceserve.models.step.context import ContextPlanner, StepContext, plan_step
from spaceserve.models.step.graph_buckets import pick_bucket

Tensor = torch.Tensor


class GraphMemoryError(RuntimeError):
    """Decode graphs took more memory than their bound (`DecodeGraphSet.max_bytes`)."""


class DecodeGraph:
    """One captured decode step: `batch_size` one-token sequences, block tables
    `max_blocks_per_seq` wide, every launch under `num_sms`. With `planner`, the capture uses
    that planner's buffers: its steps planned with ``pad_seqs_to=batch_size`` and
    ``width=max_blocks_per_seq`` replay with no copy. `pool` (a graph pool handle) shares a
    memory pool with other graphs; `out` (``[>= batch_size, vocab]``) receives the logits, so
    the graph keeps no output in the pool. `memory_bytes` is what the capture added to the
    device memory reserved by the allocator."""

    def __init__(self, model: Any, kv_cache: KVCache, batch_size: int, max_blocks_per_seq: int,
                 *, num_sms: int | None = None, warmup: int = 2,
                 planner: ContextPlanner | None = None, pool: Any = None,
                 out: Tensor | None = None) -> None:
        if model.device.type != "cuda":
            raise ValueError("DecodeGraph needs a model on a CUDA device")
        if not model.backend.graph_capturable:
            raise ValueError(f"the {model.backend.name!r} attention backend plans each step in "
                             "Python: its decode steps cannot be replayed from a CUDA graph")
        if out is not None and out.shape[0] < batch_size:
            raise ValueError(f"out has {out.shape[0]} rows for batch_size={batch_size}")
        bs = kv_cache.block_size
        if planner is None:
            planner = ContextPlanner(batch_size, batch_size, max_blocks_per_seq, bs,
                                     device=model.device)
            self._own_planner = True
        else:
            self._own_planner = False
            if (planner.block_size, planner.buffers.device) != (bs, kv_cache.k[0].device):
                raise ValueError("planner: block size or device differs from the cache's")
            if planner.max_num_seqs < batch_size or planner.max_blocks_per_seq < \
                    max_blocks_per_seq:
                raise ValueError(f"planner is too small for batch_size={batch_size}, "
                                 f"max_blocks_per_seq={max_blocks_per_seq}")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_size = batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_sms = num_sms
        self.planner = planner
        self.ctx = planner.plan([], [], [], pad_seqs_to=batch_size, width=max_blocks_per_seq,
                                plan_attention=False)
        self.ctx.plan = model.backend.plan(self.ctx)
        self.input_ids = self.ctx.input_ids
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        dev = model.device
        before = torch.cuda.memory_reserved(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            logits = self._step()
            if out is not None:
                out[:batch_size].copy_(logits)
                logits = out[:batch_size]
        self.logits = logits
        del logits
        self.memory_bytes = max(0, torch.cuda.memory_reserved(dev) - before)

    def _step(self) -> Tensor:
        return self.model.forward(self.input_ids, self.ctx, self.kv_cache, num_sms=self.num_sms)

    def plan(self, num_cached_tokens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
             rope_deltas: Sequence[int] | None = None) -> StepContext:
        """A decode step's context padded to this graph's shapes (one new token each): in the
        graph's own buffers when it owns its planner (valid until the next `plan`), else a
        fresh one that `replay` copies in."""
        n = len(num_cached_tokens)
        ones = np.ones(n, dtype=np.int64)
        if not self._own_planner:
            return plan_step(num_cached_tokens, ones, block_tables,
                             block_size=self.kv_cache.block_size, device=self.model.device,
                             rope_deltas=rope_deltas, pad_seqs_to=self.batch_size,
                             max_blocks_per_seq=self.max_blocks_per_seq)
        p = self.planner
        p.load_rows(num_cached_tokens, ones, block_tables, width=self.max_blocks_per_seq,
                    rope_deltas=rope_deltas)
        return p.plan(p._arange[:n], num_cached_tokens, ones, pad_seqs_to=self.batch_size,
                      width=self.max_blocks_per_seq, plan_attention=False)

    def replay(self, input_ids: Tensor | None, ctx: StepContext) -> Tensor:
        """Run the step of `ctx` (from `plan`, or the shared planner) on `input_ids`
        ``[real batch]`` or ``[batch_size]`` (None: ``ctx.input_ids``); returns the logits of its
        real sequences (a view of the graph's output buffer)."""
        if not ctx.is_decode_only:
            raise ValueError("DecodeGraph replays decode-only steps")
        n = ctx.num_real_seqs
        if input_ids is None:
            input_ids = ctx.input_ids
        if input_ids is None or input_ids.shape[0] not in (n, self.batch_size):
            got = None if input_ids is None else input_ids.shape[0]
            raise ValueError(f"input_ids has {got} tokens for {n} sequences")
        if not self.ctx.shares_buffers(ctx):
            self.ctx.copy_from(ctx)
        elif not self.planner.is_current(ctx):
            raise ValueError("ctx: a later plan of the graph's planner has overwritten it; "
                             "replay a step right after planning it")
        self.ctx.plan = self.model.backend.replan(self.ctx.plan, ctx)  # refilled in place
        if input_ids.data_ptr() != self.input_ids.data_ptr():
            self.input_ids[: input_ids.shape[0]].copy_(input_ids, non_blocking=True)
        self.graph.replay()
        return self.logits[:n]


def _vocab_size(model: Any) -> int:
    lm = getattr(model, "language", model)
    return int(lm.vocab_size)


class DecodeGraphSet:
    """Every decode graph of one model and KV cache (module docstring): buckets are
    `batch_sizes` x `widths` (ascending; block-table widths in blocks), captured per SM budget
    by `capture`, found by `pick`. `max_bytes` None leaves the memory unbounded. `factory`
    builds one graph (default `DecodeGraph`; tests pass a stand-in with ``memory_bytes``)."""

    def __init__(self, model: Any, kv_cache: KVCache, batch_sizes: Sequence[int],
                 widths: Sequence[int], *, planner: ContextPlanner | None = None,
                 max_bytes: int | None = None,
                 factory: Callable[..., Any] = DecodeGraph) -> None:
        if not widths or min(widths) < 1:
            raise ValueError(f"widths={tuple(widths)!r} must be block counts >= 1")
        self.model, self.kv_cache, self.planner = model, kv_cache, planner
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.widths = tuple(sorted(set(widths)))
        self.max_bytes = max_bytes
        self.factory = factory
        self.graphs: dict[tuple[int, int, int | None], Any] = {}
        self.bytes = 0  # pool growth of every capture + the shared output buffer
        self.pool: Any = None
        self.out: Tensor | None = None

    def __iter__(self):  # (batch size, width, budget) of every captured graph
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def _resources(self) -> None:
        """The shared pool and output buffer, made before the first capture (CUDA only)."""
        if self.pool is not None or self.model.device.type != "cuda" or not self.batch_sizes:
            return
        self.pool = torch.cuda.graph_pool_handle()
        self.out = torch.empty(self.batch_sizes[-1], _vocab_size(self.model),
                               dtype=self.model.dtype, device=self.model.device)
        self.bytes += self.out.numel() * self.out.element_size()

    def capture(self, num_sms: int | None) -> tuple[int, ...]:
        """Capture every bucket not yet captured for budget `num_sms`, largest first (so the
        smaller ones fit in memory the larger ones' temporaries left in the pool); returns
        the batch sizes. Raises `GraphMemoryError` (all graphs dropped) once the graphs'
        memory passes `max_bytes`."""
        self._resources()
        for b in reversed(self.batch_sizes):
            for w in reversed(self.widths):
                key = (b, w, num_sms)
                if key in self.graphs:
                    continue
                graph = self.factory(self.model, self.kv_cache, b, w, num_sms=num_sms,
                                     planner=self.planner, pool=self.pool, out=self.out)
                self.graphs[key] = graph
                self.bytes += int(graph.memory_bytes)
                if self.max_bytes is not None and self.bytes > self.max_bytes:
                    n, used = len(self.graphs), self.bytes
                    self.clear()
                    raise GraphMemoryError(
                        f"decode graphs need more than graph_reserve_bytes={self.max_bytes} "
                        f"({used / 2**20:.0f} MiB after {n} graphs, the last batch {b} x "
                        f"{w} blocks under {num_sms} SMs): raise graph_reserve_bytes, or "
                        "capture fewer or narrower graphs (graph_batch_sizes, "
                        "graph_context_lens, max_model_len)")
        return self.batch_sizes

    def pick(self, num_seqs: int, need_width: int, num_sms: int | None) -> Any:
        """The graph to replay a decode step of `num_seqs` sequences needing `need_width`
        blocks under `num_sms`, or None (the step runs eagerly)."""
        bucket = pick_bucket(self.batch_sizes, self.widths, num_seqs, need_width)
        return None if bucket is None else self.graphs.get((*bucket, num_sms))

    def clear(self) -> None:
        """Drop every graph, the pool and the output buffer."""
        self.graphs.clear()
        self.pool = self.out = None
        self.bytes = 0
