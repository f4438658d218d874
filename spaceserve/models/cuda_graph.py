"""Decode steps replayed from CUDA graphs, through the attention backends' plan/run split.

A `DecodeGraph` captures one decode step of a fixed padded batch size, block-table width and SM
budget on an all-padding step (nothing is stored, nothing read), so it can be built at start-up.
`replay` copies a real step's metadata into the captured buffers, refills the backend's plan in
place on the host, and replays. Build one per (batch bucket, budget); a graph captured on a
green-context stream stays bound to that partition.
"""

from __future__ import annotations

from typing import Any

import torch

from .context import StepContext, plan_step
from .qwen2_vl_text import KVCache

Tensor = torch.Tensor


class DecodeGraph:
    """One captured decode step: `batch_size` one-token sequences, block tables
    `max_blocks_per_seq` wide, every launch under `num_sms`."""

    def __init__(self, model: Any, kv_cache: KVCache, batch_size: int, max_blocks_per_seq: int,
                 *, num_sms: int | None = None, warmup: int = 2) -> None:
        if model.device.type != "cuda":
            raise ValueError("DecodeGraph needs a model on a CUDA device")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_size = batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_sms = num_sms
        self.ctx = plan_step([], [], [], block_size=kv_cache.block_size, device=model.device,
                             pad_seqs_to=batch_size, max_blocks_per_seq=max_blocks_per_seq,
                             backend=model.backend)
        self.input_ids = torch.zeros(batch_size, dtype=torch.long, device=model.device)
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

    def plan(self, num_cached_tokens: list[int], block_tables: list[list[int]], *,
             rope_deltas: list[int] | None = None) -> StepContext:
        """A decode step's context padded to this graph's shapes (one new token each)."""
        n = len(num_cached_tokens)
        return plan_step(num_cached_tokens, [1] * n, block_tables,
                         block_size=self.kv_cache.block_size, device=self.model.device,
                         rope_deltas=rope_deltas, pad_seqs_to=self.batch_size,
                         max_blocks_per_seq=self.max_blocks_per_seq)

    def replay(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        """Run the step of `ctx` (from `plan`) on `input_ids` ``[real batch]``; returns the
        logits of its real sequences (a view of the graph's output buffer)."""
        if not ctx.is_decode_only:
            raise ValueError("DecodeGraph replays decode-only steps")
        n = ctx.num_real_seqs
        if input_ids.shape[0] not in (n, self.batch_size):
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens for {n} sequences")
        self.ctx.copy_from(ctx)
        self.ctx.plan = self.model.backend.replan(self.ctx.plan, self.ctx)
        self.input_ids[: input_ids.shape[0]].copy_(input_ids, non_blocking=True)
        self.graph.replay()
        return self.logits[:n]
