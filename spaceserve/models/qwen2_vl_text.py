"""Qwen2-VL language model: embeddings, decoder layers with M-RoPE over a paged KV cache, LM head.

One `forward` runs a flattened batch mixing prefill chunks and decode tokens (layout in
`context.py`), splices image embeddings in at image-token positions, and returns logits only
for the rows the step context asks for. Every kernel launch runs under the given `num_sms`.

Under tensor parallelism (`parallel.py`) the weights handed in are this rank's shards: the
layers run on the rank's heads and MLP columns, its KV cache holds only its KV heads, and the
hidden state is all-reduced after o_proj, after down_proj and after the vocabulary-parallel
embedding lookup; the logits shards are all-gathered, so every rank returns full logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spaceserve.models.attention.backends import AttentionBackend
from spaceserve.models.ops import TorchOps
from spaceserve.models.parallel import Communicator, SingleRank, TensorParallel, Unconnected
from spaceserve.models.step.step_context import StepContext

Tensor = torch.Tensor


@dataclass
class KVCache:
    """Paged K and V caches, one ``[num_blocks + 1, block_size, num_kv_heads, head_dim]`` pair
    per layer. Blocks ``0..num_blocks-1`` are for sequences; the last block is scratch where
    stores without a skip path put padding tokens, so it must never be handed out."""

    k: list[Tensor]
    v: list[Tensor]
    block_size: int

    def copy_blocks(self, pairs: Any) -> None:
        """Copy blocks ``pairs[:, 0]`` onto ``pairs[:, 1]`` in every layer (copy on write of a
        block shared by forked sequences); `pairs` is ``[C, 2]`` int (host)."""
        idx = torch.as_tensor(pairs, dtype=torch.int64).to(self.k[0].device, non_blocking=True)
        src, dst = idx[:, 0], idx[:, 1]
        for t in (*self.k, *self.v):
            t.index_copy_(0, dst, t.index_select(0, src))

    @property
    def num_blocks(self) -> int:
        """Blocks available to sequences (the scratch block excluded)."""
        return self.k[0].shape[0] - 1


def mrope_section_index(section: list[int], half: int) -> Tensor:
    """Which position row (0 t, 1 h, 2 w) drives each of the ``head_dim / 2`` frequencies."""
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {half}")
    return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])


class LanguageModel:
    """The Qwen2-VL decoder on SpaceServe ops; weights come from a name -> tensor getter (this
    rank's shards under tensor parallelism, see the module docstring). Q/K/V and gate/up
    projections are fused into one GEMM each at load time. `num_heads` / `num_kv_heads` are the
    rank's own; `total_heads` / `total_kv_heads` the model's. `media_token_rows` maps the image
    (and video) token id to its full embedding row (needed only when the vocabulary is split:
    a generated media token is plain text and embeds as its own row)."""

    qkv_bias = True  # Qwen2's q/k/v projections have biases (Qwen3's do not)

    def __init__(self, config: Any, weight: Callable[[str], Tensor], lm_head: Tensor,
                 image_token_id: int, ops: TorchOps, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, *, tp: TensorParallel | None = None,
                 comm: Communicator | None = None, video_token_id: int | None = None,
                 media_token_rows: dict[int, Tensor] | None = None) -> None:
        self.config = config
        self.ops = ops
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.tp = tp or TensorParallel()
        self.comm = comm or (SingleRank() if self.tp.size == 1 else
                             Unconnected(self.tp.rank, self.tp.size))
        if (self.comm.rank, self.comm.size) != (self.tp.rank, self.tp.size):
            raise ValueError(f"communicator rank {self.comm.rank} of {self.comm.size} does not "
                             f"match tensor-parallel rank {self.tp.rank} of {self.tp.size}")
        self.image_token_id = int(image_token_id)
        self.video_token_id = None if video_token_id is None else int(video_token_id)
        self.hidden = int(config.hidden_size)
        self.total_heads = int(config.num_attention_heads)
        self.total_kv_heads = int(config.num_key_value_heads or self.total_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden // self.total_heads)
        if self.total_heads % self.total_kv_heads:
            raise ValueError(f"num_attention_heads={self.total_heads} is not a multiple of "
                             f"num_key_value_heads={self.total_kv_heads}")
        split = self.tp.heads(self.total_heads, self.total_kv_heads)
        self.num_heads, self.num_kv_heads = split.q_heads, split.kv_heads
        if self.tp.size > 1:
            self.tp.even(int(config.intermediate_size), "intermediate_size")
        self.eps = float(config.rms_norm_eps)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        rope = dict(getattr(config, "rope_parameters", None)
                    or getattr(config, "rope_scaling", None) or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"rope_type={rope.get('rope_type')!r} is not supported (default only)")
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 1e6)))
        d = self.head_dim
        self.inv_freq = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))).to(device)
        section = list(rope.get("mrope_section", [16, 24, 24]))
        self.section_index = mrope_section_index(section, d // 2).to(device)

        backend.bind_lm(self.num_heads, self.num_kv_heads, self.head_dim)
        self.vocab_start, vocab_end, shard_rows = self.tp.vocab(self.vocab_size)
        self.embed = weight("embed_tokens.weight")
        if self.embed.shape[0] != vocab_end - self.vocab_start:
            raise ValueError(f"embed_tokens.weight has {self.embed.shape[0]} rows, vocabulary "
                             f"shard [{self.vocab_start}, {vocab_end}) of vocab_size="
                             f"{self.vocab_size} needs {vocab_end - self.vocab_start}")
        media = [t for t in (self.image_token_id, self.video_token_id) if t is not None]
        if self.tp.size > 1:
            missing = [t for t in media if t not in (media_token_rows or {})]
            if missing:
                raise ValueError(f"a split vocabulary needs media_token_rows for token ids "
                                 f"{missing} (their full embedding rows)")
            self.media_token_rows = {t: media_token_rows[t].reshape(self.hidden)
                                     for t in media}
            if lm_head.shape[0] < shard_rows:  # a short last shard: zero logits, cut after
                lm_head = torch.cat([lm_head, lm_head.new_zeros(shard_rows - lm_head.shape[0],
                                                                lm_head.shape[1])])
        else:
            self.media_token_rows = {t: self.embed[t] for t in media}
        self.layers = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            qkv_w = torch.cat([weight(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([weight(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) \
                if self.qkv_bias else None
            gate_up = torch.cat([weight(p + "mlp.gate_proj.weight"),
                                 weight(p + "mlp.up_proj.weight")])
            self.layers.append((
                weight(p + "input_layernorm.weight"), qkv_w.contiguous(),
                None if qkv_b is None else qkv_b.contiguous(),
                weight(p + "self_attn.o_proj.weight"),
                weight(p + "post_attention_layernorm.weight"),
                gate_up.contiguous(), weight(p + "mlp.down_proj.weight"),
            ))
        self.norm = weight("norm.weight")
        self.lm_head = lm_head

    @property
    def embed_width(self) -> int:
        """Width of one media token's encoder row (`image_embeds`): the hidden size."""
        return self.hidden

    def split_media(self, input_ids: Tensor, image_embeds: Tensor | None
                    ) -> tuple[Tensor | None, Any]:
        """(rows spliced in at the embeddings, what `after_layer` adds later); Qwen2-VL
        splices every row in and adds nothing later."""
        return image_embeds, None

    def after_layer(self, i: int, h: Tensor, residual: Tensor | None, extra: Any
                    ) -> tuple[Tensor, Tensor | None]:
        """Hook after decoder layer `i` given `split_media`'s extra (none in Qwen2-VL)."""
        return h, residual

    def qk_norm(self, i: int, q: Tensor, k: Tensor, num_sms: int | None
                ) -> tuple[Tensor, Tensor]:
        """Hook on layer `i`'s q ``[T, Hq, D]`` and k before the rotary (none in Qwen2-VL)."""
        return q, k

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Zeroed paged caches for every layer (plus the scratch block) in the model dtype on
        the model device; `block_size` must be a power of two (the paged kernels' pages)."""
        if num_blocks < 1 or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"num_blocks={num_blocks} must be >= 1 and block_size={block_size} "
                             "a power of two")
        shape = (num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        mk = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)
        return KVCache([mk() for _ in range(self.num_layers)],
                       [mk() for _ in range(self.num_layers)], block_size)

    def rotary_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 M-RoPE cos/sin ``[T, head_dim]`` from positions ``[3, T]`` (torch ops, no sync)."""
        pos = positions.index_select(0, self.section_index)  # [D/2, T]
        freqs = pos.t().float() * self.inv_freq
        full = torch.cat([freqs, freqs], dim=-1)
        return full.cos(), full.sin()

    def embed_tokens(self, input_ids: Tensor, image_embeds: Tensor | None,
                     comm: Communicator | None = None, *, num_sms: int | None = None) -> Tensor:
        """Token embeddings (vocabulary-parallel: local rows, others zeroed, all-reduced over
        `comm`, default the model's, under `num_sms`) with `image_embeds` spliced in at
        image-token positions."""
        if self.tp.size == 1:
            h = F.embedding(input_ids, self.embed)
        else:
            local = input_ids - self.vocab_start
            inside = (local >= 0) & (local < self.embed.shape[0])
            h = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.embed)
            h = (comm or self.comm).all_reduce(h.masked_fill_(~inside.unsqueeze(-1), 0),
                                               num_sms=num_sms)
        if image_embeds is None:
            return h
        mask = input_ids == self.image_token_id
        if self.video_token_id is not None:  # video tokens take encoder rows the same way
            mask |= input_ids == self.video_token_id
        if image_embeds.dim() != 2 or image_embeds.shape[1] != self.hidden:
            raise ValueError(f"image_embeds must be [image_tokens, {self.hidden}], got "
                             f"{tuple(image_embeds.shape)}")
        if input_ids.device.type == "cpu":
            n = int(mask.sum())
            if n != image_embeds.shape[0]:
                raise ValueError(f"input_ids hold {n} image/video tokens, image_embeds has "
                                 f"{image_embeds.shape[0]} rows")
        return h.masked_scatter(mask.unsqueeze(-1), image_embeds.to(h.dtype))

    def forward(self, input_ids: Tensor, ctx: StepContext, kv_cache: KVCache, *,
                image_embeds: Tensor | None = None, num_sms: int | None = None,
                comm: Communicator | None = None) -> Tensor:
        """Logits ``[len(ctx.logits_indices), vocab]`` of one step over the flattened batch.

        `input_ids` ``[T]`` is the flattened batch; `image_embeds` the embedding rows of the
        image tokens it holds, in order (for prefill chunks covering image tokens). `comm`
        replaces the model's communicator for this step (a stage with a group of its own).
        """
        if input_ids.dim() != 1 or input_ids.shape[0] != ctx.num_tokens:
            raise ValueError(f"input_ids must be [{ctx.num_tokens}] (the step's tokens), got "
                             f"{tuple(input_ids.shape)}")
        if kv_cache.block_size != ctx.block_size or len(kv_cache.k) != self.num_layers:
            raise ValueError("kv_cache does not match the step context / model")
        if ctx.plan is None:
            ctx.plan = self.backend.plan(ctx)
        ops, be = self.ops, self.backend
        comm = comm or self.comm
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.rotary_tables(ctx.positions)
        spliced, extra = self.split_media(input_ids, image_embeds)
        h = self.embed_tokens(input_ids, spliced, comm, num_sms=num_sms)
        residual = None
        for i, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down) in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rms_norm(h, ln1, self.eps, num_sms=num_sms), h
            else:
                x, residual = ops.rms_norm(h, ln1, self.eps, residual=residual, num_sms=num_sms)
            qkv = ops.linear(x, qkv_w, qkv_b, num_sms=num_sms)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
            q, k = self.qk_norm(i, q, k, num_sms)
            q, k = ops.rotary(q, k, cos, sin, num_sms=num_sms)
            be.store_kv(k, v, kv_cache.k[i], kv_cache.v[i], ctx, num_sms=num_sms)
            o = be.paged_attention(q, kv_cache.k[i], kv_cache.v[i], ctx, num_sms=num_sms)
            h = comm.all_reduce(ops.linear(o.reshape(t, hq * d), o_w, num_sms=num_sms),
                                num_sms=num_sms)
            x, residual = ops.rms_norm(h, ln2, self.eps, residual=residual, num_sms=num_sms)
            h = comm.all_reduce(ops.gated_mlp(x, gate_up, down, num_sms=num_sms),
                                num_sms=num_sms)
            if extra is not None:
                h, residual = self.after_layer(i, h, residual, extra)
        sel = ctx.logits_indices
        if sel.numel() == 0:
            return h.new_empty(0, self.vocab_size)
        if residual is None:  # the last layer's hook folded the residual in
            x = ops.rms_norm(h.index_select(0, sel), self.norm, self.eps, num_sms=num_sms)
        else:
            x, _ = ops.rms_norm(h.index_select(0, sel), self.norm, self.eps,
                                residual=residual.index_select(0, sel), num_sms=num_sms)
        logits = ops.linear(x, self.lm_head, num_sms=num_sms)
        if self.tp.size == 1:
            return logits
        rows, shard = logits.shape
        full = comm.all_gather(logits, num_sms=num_sms).view(self.tp.size, rows, shard) \
            .transpose(0, 1)
        return full.reshape(rows, self.tp.size * shard)[:, :self.vocab_size]
