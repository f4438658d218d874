"""`Qwen2VLRunner`: SpaceServe's Qwen2-VL behind the engine's `ModelRunner` protocol.

The runner owns the model, its paged KV cache and its decode graphs. Per step it turns the
engine's `ScheduledBatch` into a `StepContext` (`plan_step`), splices the image embeddings of
the prefill chunks that cover image tokens, and runs the LM under `decoder_num_sms`; image
batches are encoded under `encoder_num_sms` (None = the whole device for either). Pure-decode
batches replay a captured graph of the next larger batch bucket when one exists for the current
decoder budget.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.runner import ModelInfo, StepLimits

from .context import plan_step
from .cuda_graph import DecodeGraph
from .loader import from_pretrained
from .mrope import mrope_positions
from .qwen2_vl import Qwen2VL
from .qwen2_vl_text import KVCache

Tensor = torch.Tensor


def _eos_ids(config: Any, path: str | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (getattr(config.text_config, "eos_token_id", None),
                  getattr(config, "eos_token_id", None)):
        ids += value if isinstance(value, list) else [] if value is None else [value]
    gen = os.path.join(path, "generation_config.json") if path else None
    if gen and os.path.isfile(gen):
        with open(gen) as f:
            value = json.load(f).get("eos_token_id")
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return tuple(dict.fromkeys(int(i) for i in ids))


class Qwen2VLRunner:
    """Weights, caches and kernels of one Qwen2-VL, driven by the engine."""

    def __init__(self, model: Qwen2VL, *, max_model_len: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.device = model.device
        tc = model.config.text_config
        self.info = ModelInfo(
            vocab_size=int(tc.vocab_size),
            max_model_len=int(max_model_len or tc.max_position_embeddings),
            eos_token_ids=tuple(eos_token_ids),
            image_token_id=int(model.config.image_token_id),
            spatial_merge_size=int(model.config.vision_config.spatial_merge_size),
            patch_dim=model.vision.patch_dim,
        )
        self.encoder_num_sms: int | None = None
        self.decoder_num_sms: int | None = None
        self.cache: KVCache | None = None
        self.limits: StepLimits | None = None
        self.graphs: dict[tuple[int, int | None], DecodeGraph] = {}

    @classmethod
    def from_pretrained(cls, path: str, *, attention_backend: str = "triton", dtype: Any = None,
                        device: Any = None) -> Qwen2VLRunner:
        model = from_pretrained(path, attention_backend=attention_backend, dtype=dtype,
                                device=device)
        return cls(model, eos_token_ids=_eos_ids(model.config, os.fspath(path)))

    # -- memory ----------------------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        lm = self.model.language
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * lm.num_layers * block_size * lm.num_kv_heads * lm.head_dim * elem

    def profile_peak_bytes(self, limits: StepLimits, max_encoder_tokens: int) -> int:
        """Peak extra bytes of the largest encoder pass and the largest LM step, measured by
        running both once on dummy inputs (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        model, merge = self.model, self.info.spatial_merge_size
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        pv = torch.zeros(max_encoder_tokens * merge ** 2, model.vision.patch_dim,
                         dtype=model.dtype, device=self.device)
        model.encode_images(pv, [[1, merge, merge * max_encoder_tokens]])
        del pv
        peak = torch.cuda.max_memory_allocated() - base
        bs, total = limits.block_size, limits.max_tokens
        seqs = min(limits.max_num_seqs, total)
        news = [total // seqs + (i < total % seqs) for i in range(seqs)]
        per = [-(-n // bs) for n in news]
        cache = model.allocate_kv_cache(sum(per), bs)
        cache_bytes = torch.cuda.memory_allocated() - base
        starts = np.cumsum([0] + per).tolist()
        tables = [list(range(s, s + p)) for s, p in zip(starts, per, strict=False)]
        torch.cuda.reset_peak_memory_stats()
        ctx = model.plan_step([0] * seqs, news, tables, block_size=bs)
        model.forward(torch.zeros(total, dtype=torch.long, device=self.device), ctx, cache)
        peak = max(peak, torch.cuda.max_memory_allocated() - base - cache_bytes)
        del cache, ctx
        torch.cuda.empty_cache()
        return int(peak)

    def allocate_kv_cache(self, num_blocks: int, limits: StepLimits) -> None:
        """The paged cache of `num_blocks` blocks (plus the scratch block the store of padding
        tokens uses, never handed out)."""
        self.cache = self.model.allocate_kv_cache(num_blocks, limits.block_size)
        self.limits = limits

    def capture_decode_graphs(self, batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """Capture decode graphs for the current decoder budget (CUDA only)."""
        assert self.cache is not None and self.limits is not None, "allocate_kv_cache first"
        if self.device.type != "cuda":
            return ()
        sizes = sorted({s for s in batch_sizes if s <= self.limits.max_num_seqs})
        for s in sizes:
            key = (s, self.decoder_num_sms)
            if key not in self.graphs:
                self.graphs[key] = DecodeGraph(self.model, self.cache, s,
                                               self.limits.max_blocks_per_seq,
                                               num_sms=self.decoder_num_sms)
        return tuple(sizes)

    # -- requests --------------------------------------------------------------------------
    def prepare_request(self, req: Any) -> None:
        """M-RoPE positions and rope delta of the prompt into ``req.model_state``; ValueError
        when its image tokens and grids disagree."""
        mm = req.mm
        grid = mm.image_grid_thw if mm is not None and mm.num_images else None
        positions, delta = mrope_positions(req.prompt_token_ids, grid, self.model.config)
        if grid is not None:
            expected = int(grid.prod(-1).sum()) // self.info.spatial_merge_size ** 2
            if mm.num_tokens != expected:
                raise ValueError(f"the prompt has {mm.num_tokens} image tokens, its image "
                                 f"grids {expected}")
        req.model_state = (positions if grid is not None else None, delta)

    def encode(self, mms: Sequence[Any]) -> list[Tensor]:
        """All images of these requests in one encoder job; one ``[tokens, hidden]`` per
        request."""
        pv = torch.cat([mm.pixel_values for mm in mms])
        grid = torch.cat([mm.image_grid_thw for mm in mms])
        embeds = self.model.encode_images(pv, grid, num_sms=self.encoder_num_sms)
        return list(embeds.split([mm.num_tokens for mm in mms]))

    def execute(self, batch: Any) -> Tensor:
        """One step; logits rows follow ``batch.sample_reqs``. No host sync."""
        assert self.cache is not None and self.limits is not None, "allocate_kv_cache first"
        reqs, cached, new = batch.reqs, batch.num_cached, batch.num_new
        tables = [r.block_ids for r in reqs]
        deltas = [r.model_state[1] if r.model_state is not None else 0 for r in reqs]
        tokens: list[int] = []
        parts: list[Tensor] = []
        for r, c, n in zip(reqs, cached, new, strict=True):
            tokens += r.token_ids[c:c + n]
            mm = r.mm
            if mm is not None and mm.embeds is not None and mm.num_tokens:
                lo, hi = np.searchsorted(mm.positions, [c, c + n])
                if hi > lo:
                    parts.append(mm.embeds[lo:hi])
        ids = torch.tensor(tokens, dtype=torch.long)
        ids = ids if self.device.type == "cpu" else ids.pin_memory().to(self.device,
                                                                        non_blocking=True)
        graph = self._graph_for(batch)
        if graph is not None:
            ctx = graph.plan(list(cached), tables, rope_deltas=deltas)
            return graph.replay(ids, ctx)
        ctx = plan_step(cached, new, tables, block_size=self.limits.block_size,
                        device=self.device, backend=self.model.backend,
                        mrope_positions=[r.model_state[0] if r.model_state else None
                                         for r in reqs],
                        rope_deltas=deltas, need_logits=batch.need_logits)
        if len(ctx.host.logits_seqs) != len(batch.sample_reqs):
            raise RuntimeError("need_logits and sample_reqs disagree")
        return self.model.forward(ids, ctx, self.cache,
                                  image_embeds=torch.cat(parts) if parts else None,
                                  num_sms=self.decoder_num_sms)

    def _graph_for(self, batch: Any) -> DecodeGraph | None:
        n = len(batch.reqs)
        if not self.graphs or batch.num_decodes != n or not all(batch.need_logits):
            return None
        fits = [s for s, b in self.graphs if b == self.decoder_num_sms and s >= n]
        return self.graphs[min(fits), self.decoder_num_sms] if fits else None
