"""Attention backends behind one small interface, selected by name.

A backend provides varlen bidirectional ViT attention and paged causal attention over the
flattened LM batch (prefill chunks and decode tokens, see `context.py`), with a plan/run split:
``plan_vit`` / ``plan`` run on the host once per encoder job / LM step, the ``*_attention``
calls only launch (so a decode step can be captured in a CUDA graph).

- ``triton``: SpaceServe's persistent kernels, every launch under the caller's SM budget.
- ``torch``: SDPA / plain torch on any device; the stock-kernel baseline and the reference.
- ``flash_attn``, ``flashinfer``: the libraries of those names, when importable on CUDA
  (`library_backends.py`, registered as lazy ``module:Class`` entries: imported only when asked
  for, so this module never imports them).

KV caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer for K and for V.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from spaceserve import kernels
from spaceserve.models.step.step_context import StepContext

Tensor = torch.Tensor


@dataclass
class VitMeta:
    """Segments of a packed vision batch (one per image frame) and the backend's plan."""

    cu_seqlens: Tensor  # [S + 1] int32 on the model device
    cu_seqlens_host: list[int]
    max_seqlen: int
    plan: Any = None


def _scale(scale: float | None, q: Tensor) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


class BackendUnavailable(RuntimeError):
    """The named backend is known but cannot run here (library missing, no CUDA)."""


def _store_kv_torch(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                    ctx: StepContext) -> None:
    """Write K/V rows to their slots without a host sync. Padding tokens (slot < 0) go to the
    cache's last slot, which `KVCache` keeps as scratch (its block is never handed out)."""
    slots = ctx.slot_mapping
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    idx = torch.where(slots >= 0, slots, flat_k.shape[0] - 1)
    flat_k.index_copy_(0, idx, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v.to(v_cache.dtype))


def _vit_torch(q: Tensor, k: Tensor, v: Tensor, meta: VitMeta, scale: float) -> Tensor:
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_host
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        if e == s:
            continue
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


def _decode_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, scale: float) -> Tensor:
    """One query per sequence over its paged cache, device-only (graph-capturable)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    length = block_tables.shape[1] * k_cache.shape[1]
    keys = k_cache[block_tables].reshape(b, length, hkv, d).float()
    vals = v_cache[block_tables].reshape(b, length, hkv, d).float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bgrd,blgd->bgrl", qg, keys) * scale
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.einsum("bgrl,blgd->bgrd", probs, vals)
    return out.reshape(b, hq, d).to(q.dtype)


def _paged_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: StepContext,
                 scale: float) -> Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix + themselves."""
    if ctx.is_decode_only:
        return _decode_torch(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, scale)
    out = torch.zeros_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    cu, lens = ctx.host.cu_seqlens_q, ctx.host.seq_lens
    for i in range(ctx.num_seqs):
        s, e, length = cu[i], cu[i + 1], lens[i]
        if length == 0:
            continue
        n = e - s
        nb = -(-length // bs)
        blocks = ctx.block_tables[i, :nb]
        ks = k_cache[blocks].reshape(nb * bs, hkv, -1)[:length]
        vs = v_cache[blocks].reshape(nb * bs, hkv, -1)[:length]
        ks = ks.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vs = vs.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), ks, vs, attn_mask=mask,
                                           scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


class AttentionBackend:
    """Interface; the base implementation is the torch backend."""

    name = "torch"
    dense_ops = "torch"
    # A decode step's attention reads only device buffers refilled in place by `replan`, so a
    # captured CUDA graph replays correctly; a backend that plans in Python per step cannot.
    graph_capturable = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run here, else why not."""
        return None

    def bind_lm(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Record the LM's attention geometry (the model calls this once; plans use it)."""
        self.lm_shape = (num_q_heads, num_kv_heads, head_dim)

    def plan_vit(self, cu_seqlens_host: list[int], num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> VitMeta:
        """Segments of one encoder job, uploaded once and reused by every block."""
        cu = torch.tensor(cu_seqlens_host, dtype=torch.int32)
        if device.type != "cpu":
            cu = cu.pin_memory().to(device, non_blocking=True)
        lens = [e - s for s, e in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:], strict=True)]
        return VitMeta(cu, list(cu_seqlens_host), max(lens, default=0))

    def vit_attention(self, q: Tensor, k: Tensor, v: Tensor, meta: VitMeta, *,
                      scale: float | None = None, num_sms: int | None = None) -> Tensor:
        return _vit_torch(q, k, v, meta, _scale(scale, q))

    def plan(self, ctx: StepContext) -> Any:
        """Host-side plan of one LM step (stored in ``ctx.plan``)."""
        return None

    def replan(self, plan: Any, ctx: StepContext) -> Any:
        """The plan of `ctx`'s step, refilling `plan` (the previous step's) in place where the
        backend can: its device buffers stay, so a CUDA graph that captured them replays the
        new step. This default makes a new plan."""
        return self.plan(ctx)

    def store_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 ctx: StepContext, *, num_sms: int | None = None) -> None:
        _store_kv_torch(k, v, k_cache, v_cache, ctx)

    def paged_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: StepContext,
                        *, scale: float | None = None, num_sms: int | None = None) -> Tensor:
        return _paged_torch(q, k_cache, v_cache, ctx, _scale(scale, q))


TorchBackend = AttentionBackend


def _grow(capacity: int | None, need: int) -> int:
    """A work-list capacity for `need`: exactly that at first, then at least doubling."""
    if not capacity:
        return need
    return capacity if capacity >= need else max(need, 2 * capacity)


class TritonBackend(AttentionBackend):
    """SpaceServe's budgeted kernels. A step is planned on the host into the kernels' plan
    objects (`DecodePlan` for the leading run of one-token sequences, `PrefillPlan` for the
    rest); layers then only launch."""

    name = "triton"
    dense_ops = "triton"
    def plan_vit(self, cu_seqlens_host, num_heads, head_dim, dtype, device):
        meta = super().plan_vit(cu_seqlens_host, num_heads, head_dim, dtype, device)
        meta.plan = kernels.plan_vit_attention(cu_seqlens_host, num_heads, head_dim,
                                               dtype=dtype, device=device)
        return meta

    def vit_attention(self, q, k, v, meta, *, scale=None, num_sms=None):
        return kernels.vit_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, scale=scale,
                                     num_sms=num_sms, plan=meta.plan)

    def store_kv(self, k, v, k_cache, v_cache, ctx, *, num_sms=None):
        kernels.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping, num_sms=num_sms)

    def plan(self, ctx):
        return self.replan(None, ctx)

    def replan(self, plan, ctx):
        """Refill `plan`'s DecodePlan / PrefillPlan for `ctx`. Each is kept while large enough
        (a CUDA graph's plan, made for its own shapes, always is) and otherwise replaced by
        one at least twice as large, so a planner reusing one plan stops allocating."""
        if plan is None:
            plan = {"num_decode": 0, "decode": None, "prefill": None, "cu_rest": None,
                    "decode_plan": None, "prefill_plan": None}
        hq, hkv, d = self.lm_shape
        nd, b, host = ctx.num_decode_seqs, ctx.num_seqs, ctx.host
        lens = torch.from_numpy(np.asarray(host.seq_lens, dtype=np.int64))
        plan["num_decode"], plan["decode"], plan["prefill"] = nd, None, None
        if nd:
            dp = plan["decode_plan"]
            pages = -(-int(lens[:nd].max()) // ctx.block_size)
            if dp is None or dp.max_batch < nd or dp.max_blocks_per_seq < pages:
                dp = kernels.DecodePlan(
                    _grow(dp and dp.max_batch, nd),
                    _grow(dp and dp.max_blocks_per_seq, max(pages, ctx.block_tables.shape[1])),
                    hq, hkv, d, ctx.block_size, device=ctx.device)
            dp.plan(lens[:nd])
            plan["decode"] = plan["decode_plan"] = dp
        if nd < b:
            pp = plan["prefill_plan"]
            tokens, seqs = ctx.num_tokens - nd, b - nd
            if pp is None or pp.max_tokens < tokens or pp.max_seqs < seqs:
                pp = kernels.PrefillPlan(_grow(pp and pp.max_tokens, tokens),
                                            _grow(pp and pp.max_seqs, seqs), hq, hkv, d,
                                            device=ctx.device)
            cu = np.asarray(host.cu_seqlens_q, dtype=np.int64)
            start = int(cu[nd])
            pp.plan(torch.from_numpy(cu[nd:] - start), lens[nd:])
            plan["prefill"] = plan["prefill_plan"] = pp
            plan["cu_rest"] = ctx.cu_seqlens_q if nd == 0 else ctx.cu_seqlens_q[nd:] - start
        return plan

    def paged_attention(self, q, k_cache, v_cache, ctx, *, scale=None, num_sms=None):
        plan = ctx.plan
        if plan is None:
            return super().paged_attention(q, k_cache, v_cache, ctx, scale=scale)
        nd = plan["num_decode"]
        parts = []
        if plan["decode"] is not None:
            parts.append(plan["decode"].run(q[:nd], k_cache, v_cache, ctx.block_tables[:nd],
                                            ctx.seq_lens[:nd], scale=scale, num_sms=num_sms))
        if plan["prefill"] is not None:
            parts.append(plan["prefill"].run(q[nd:], k_cache, v_cache, ctx.block_tables[nd:],
                                             plan["cu_rest"], ctx.seq_lens[nd:], scale=scale,
                                             num_sms=num_sms))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# A name maps to a backend class, or (lazy entry) to "module:Class", imported only when the
# backend is asked for: the optional library backends are never imported by this module.
_REGISTRY: dict[str, type[AttentionBackend] | str] = {
    "triton": TritonBackend,
    "torch": TorchBackend,
    "flash_attn": "spaceserve.models.attention.library:FlashAttnBackend",
    "flashinfer": "spaceserve.models.attention.library:FlashInferBackend",
}


def register_backend(cls: type[AttentionBackend] | str, name: str | None = None
                     ) -> type[AttentionBackend] | str:
    """Add a backend to the name registry: a class (under ``cls.name``; usable as a class
    decorator), or a lazy ``"package.module:Class"`` path under `name`, imported on first use."""
    if isinstance(cls, str):
        if name is None or ":" not in cls:
            raise ValueError(f"a lazy backend needs a name and a 'module:Class' path, got "
                             f"name={name!r}, path={cls!r}")
        _REGISTRY[name] = cls
        return cls
    _REGISTRY[name or cls.name] = cls
    return cls


def _resolve(name: str) -> tuple[type[AttentionBackend] | None, str | None]:
    """(backend class, None), or (None, why it cannot be imported) for a lazy entry whose module
    or class fails to load. A loaded lazy entry is replaced by its class."""
    entry = _REGISTRY[name]
    if not isinstance(entry, str):
        return entry, None
    module, _, attr = entry.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        return None, f"{entry} is not importable ({type(exc).__name__}: {exc})"
    if _REGISTRY.get(name) == entry:
        _REGISTRY[name] = cls
    return cls, None


def _unavailable(name: str) -> tuple[type[AttentionBackend] | None, str | None]:
    """(class, why it cannot run here or None)."""
    cls, reason = _resolve(name)
    return cls, reason if cls is None else cls.unavailable_reason()


def known_backends() -> list[str]:
    return list(_REGISTRY)


def available_backends() -> list[str]:
    """Names of the backends that can run in this process."""
    return [n for n in list(_REGISTRY) if _unavailable(n)[1] is None]


def get_backend(name: str | AttentionBackend) -> AttentionBackend:
    """A backend instance by name; ValueError for an unknown name (listing the known ones),
    `BackendUnavailable` for a known one that cannot run here (saying why)."""
    if isinstance(name, AttentionBackend):
        return name
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend={name!r} is unknown; known backends: {', '.join(_REGISTRY)}"
        )
    cls, reason = _unavailable(name)
    if cls is None or reason is not None:
        raise BackendUnavailable(f"attention backend {name!r} is unavailable: {reason}")
    return cls()
