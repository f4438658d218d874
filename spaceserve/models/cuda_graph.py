"""Decode steps replayed from CUDA graphs, through the attention backends' plan/run split.

A `DecodeGraph` captures one decode step of a fixed padded batch size, block-table width and SM
budget on an all-padding step (nothing is stored, nothing read), so it can be built at start-up.
It captures on the buffers of a `ContextPlanner`: its own, or the caller's (a runner's), so
that every later step the planner lays out with the same shape already sits where the graph
reads, and a replay only refills the backend's plan on the host and launches. A context from
anywhere else is copied in first. Build one per (batch bucket, budget); a graph captured on a
green-context stream stays bound to that partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .context import ContextPlanner, StepContext, plan_step
from .qwen2_vl_text import KVCache

Tensor = torch.Tensor


class DecodeGraph:
    """One captured decode step: `batch_size` one-token sequences, block tables
    `max_blocks_per_seq` wide, every launch under `num_sms`. With `planner`, the capture uses
    that planner's buffers: its steps planned with ``pad_seqs_to=batch_size`` and
    ``width=max_blocks_per_seq`` replay with no copy."""

    def __init__(self, model: Any, kv_cache: KVCache, batch_size: int, max_blocks_per_seq: int,
                 *, num_sms: int | None = None, warmup: int = 2,
                 planner: ContextPlanner | None = None) -> None:
        if model.device.type != "cuda":
            raise ValueError("DecodeGraph needs a model on a CUDA device")
        if not model.backend.graph_capturable:
            raise ValueError(f"the {model.backend.name!r} attention backend plans each step in "
                             "Python: its decode steps cannot be replayed from a CUDA graph")
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
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

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
