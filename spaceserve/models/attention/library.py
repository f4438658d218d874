"""Optional attention backends on third-party libraries: flash_attn and flashinfer.

Both are registered by name and report themselves unavailable (with the reason) when their
package is not importable or there is no CUDA device. Their dense ops are the stock torch ones.
Library calls need head counts, so each plan is finished on the first attention call of a
job/step (host-side, before any graph capture that replays it).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from spaceserve.models.attention.backends import AttentionBackend, VitMeta, _scale, register_backend
from spaceserve.models.step.step_context import StepContext

Tensor = torch.Tensor


def _library_reason(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"the {module} package is not installed"
    if not torch.cuda.is_available():
        return "it needs a CUDA device"
    return None


@register_backend
class FlashAttnBackend(AttentionBackend):
    """flash-attn's varlen and paged-KV kernels (FA2 needs a KV block size that is a multiple
    of 256 for paged attention)."""

    name = "flash_attn"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _library_reason("flash_attn")

    def __init__(self) -> None:
        import flash_attn

        self._varlen = flash_attn.flash_attn_varlen_func
        self._with_kvcache = flash_attn.flash_attn_with_kvcache

    def vit_attention(self, q, k, v, meta, *, scale=None, num_sms=None):
        return self._varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen,
                            meta.max_seqlen, softmax_scale=_scale(scale, q), causal=False)

    def plan(self, ctx: StepContext) -> Any:
        cu_k = [0]
        for n in ctx.host.seq_lens:
            cu_k.append(cu_k[-1] + n)
        t = torch.tensor(cu_k, dtype=torch.int32)
        return {"cu_seqlens_k": t.to(ctx.device, non_blocking=True)}

    def paged_attention(self, q, k_cache, v_cache, ctx, *, scale=None, num_sms=None):
        sc = _scale(scale, q)
        if ctx.is_decode_only:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.seq_lens,
                                     block_table=ctx.block_tables, softmax_scale=sc, causal=True)
            return out.squeeze(1)
        plan = ctx.plan if ctx.plan is not None else self.plan(ctx)
        return self._varlen(q, k_cache, v_cache, ctx.cu_seqlens_q, plan["cu_seqlens_k"],
                            ctx.max_seqlen_q, ctx.max_seqlen_k, softmax_scale=sc, causal=True,
                            block_table=ctx.block_tables)


@register_backend
class FlashInferBackend(AttentionBackend):
    """flashinfer's ragged (ViT) and paged (LM, NHD layout) prefill wrappers."""

    name = "flashinfer"
    graph_capturable = False  # its wrappers are planned in Python each step (`wrapper.plan`)
    WORKSPACE_BYTES = 128 * 1024 * 1024

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _library_reason("flashinfer")

    def __init__(self) -> None:
        import flashinfer

        self._fi = flashinfer
        self._workspace: Tensor | None = None

    def _ws(self, device: torch.device) -> Tensor:
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def vit_attention(self, q, k, v, meta: VitMeta, *, scale=None, num_sms=None):
        if meta.plan is None:
            w = self._fi.BatchPrefillWithRaggedKVCacheWrapper(self._ws(q.device), "NHD")
            w.plan(meta.cu_seqlens, meta.cu_seqlens, q.shape[1], k.shape[1], q.shape[2],
                   causal=False, sm_scale=_scale(scale, q), q_data_type=q.dtype)
            meta.plan = w
        return meta.plan.run(q, k, v)

    def plan(self, ctx: StepContext) -> Any:
        bs = ctx.block_size
        indptr, indices, last = [0], [], []
        for length, table in zip(ctx.host.seq_lens, ctx.host.block_tables, strict=True):
            nb = -(-length // bs)
            indices.extend(table[:nb])
            indptr.append(indptr[-1] + nb)
            last.append(length - (nb - 1) * bs if nb else 0)
        dev = ctx.device

        def put(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.int32).to(dev, non_blocking=True)

        return {"indptr": put(indptr), "indices": put(indices), "last": put(last),
                "wrapper": None}

    def paged_attention(self, q, k_cache, v_cache, ctx, *, scale=None, num_sms=None):
        if ctx.plan is None:
            ctx.plan = self.plan(ctx)
        plan = ctx.plan
        if plan["wrapper"] is None:
            w = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._ws(q.device), "NHD")
            w.plan(ctx.cu_seqlens_q, plan["indptr"], plan["indices"], plan["last"], q.shape[1],
                   k_cache.shape[2], q.shape[2], ctx.block_size, causal=True,
                   sm_scale=_scale(scale, q), q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            plan["wrapper"] = w
        return plan["wrapper"].run(q, (k_cache, v_cache))
