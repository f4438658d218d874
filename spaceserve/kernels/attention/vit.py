"""Varlen bidirectional flash attention for the vision tower, persistent under an SM budget.

q, k, v are ``[T, H, D]``; `cu_seqlens` (int32 ``[S+1]``) splits the tokens into segments (one
image, or one window) and every token attends to all tokens of its own segment. One tile is
(segment, head, block of BLOCK_M queries); a persistent grid of at most `num_sms` programs walks
the tiles, each tile running an fp32 online softmax over its segment's keys in BLOCK_N steps.

Work list. With host data for `cu_seqlens` (a CPU tensor, `cu_seqlens_cpu`, or a reusable
`plan_vit_attention` plan) the tiles are listed on the host, longest segment first (LPT), so the
last round of tiles is short. With `cu_seqlens` only on the GPU the launcher may not sync, so the
kernel derives tiles itself from a bound of ``S * H * cdiv(max_seqlen, BLOCK_M)`` tiles in
segment order, skipping empty query blocks (`device_worklist=True` forces this path, e.g. for a
CUDA graph replayed with new cu_seqlens). Both paths compute each tile identically, so they agree
bitwise, and the KV reduction order is fixed by the segment, so every budget gives the same bits.
The host side (block config, argument checks, the work list and its plan) is `vit_plan.py`.

Head dim. `tl.arange` needs powers of two, so D is covered by two dot widths of at least 16:
D=80 runs as 64 + 16 (two dots per product) instead of a padded 128, which would cost 1.6x the
MMA work and the loads; D=128 or 64 is a single dot.

Rotary. Optional `cos`/`sin` (fp32, ``[T, D]`` or ``[T, D/2]``) apply rotate-half RoPE to q and k
as they are loaded, in fp32, rounded back to the input dtype before the dots (what a separate
rotary pass stores). K is re-rotated for every query block, so this trades a q/k round trip
through memory for extra loads and arithmetic in the inner loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spaceserve.checks import require_int
from spaceserve.kernels.attention.vit_plan import (
    DTYPE_NAMES,
    NAME,
    VitAttentionPlan,
    block_config,
    build_tiles,
    check_qkv,
    check_rotary,
    default_config,
    head_dim_split,
    host_cu_seqlens,
    plan_vit_attention,
)
from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

__all__ = ["compile_specs", "head_dim_split", "plan_vit_attention", "ref_vit_attention",
           "vit_attention", "VitAttentionPlan"]
_LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(X, rows, row_ok, stride_t, col0, COS, SIN, stride_ct, cos_cols,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr):
    """Load columns col0..col0+BLOCK_D of rows `rows` of one head; rotate them when ROTARY."""
    d = col0 + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    row_off = rows.to(tl.int64)[:, None] * stride_t
    x = tl.load(X + row_off + d[None, :], mask=mask, other=0.0)
    if ROTARY:
        first = d < HEAD_DIM // 2
        partner = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
        xp = tl.load(X + row_off + partner[None, :], mask=mask, other=0.0)
        cs_off = rows.to(tl.int64)[:, None] * stride_ct + (d % cos_cols)[None, :]
        c = tl.load(COS + cs_off, mask=mask, other=0.0)
        s = tl.load(SIN + cs_off, mask=mask, other=0.0)
        sign = tl.where(first, -1.0, 1.0)
        rot = x.to(tl.float32) * c + xp.to(tl.float32) * sign[None, :] * s
        x = rot.to(X.dtype.element_ty)
    return x


@triton.jit
def _vit_attention_kernel(
    Q, K, V, Out, COS, SIN, CU_SEQLENS, TILES,
    num_tiles, num_heads, num_q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ct, cos_cols, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D0: tl.constexpr,
    BLOCK_D1: tl.constexpr, USE_TILES: tl.constexpr, ROTARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        if USE_TILES:
            seg_start = tl.load(TILES + tile * 4)
            seg_end = tl.load(TILES + tile * 4 + 1)
            q_start = tl.load(TILES + tile * 4 + 2)
            head = tl.load(TILES + tile * 4 + 3)
        else:
            q_block = tile % num_q_blocks
            head = (tile // num_q_blocks) % num_heads
            seg = tile // (num_q_blocks * num_heads)
            seg_start = tl.load(CU_SEQLENS + seg)
            seg_end = tl.load(CU_SEQLENS + seg + 1)
            q_start = seg_start + q_block * BLOCK_M
        # An empty query block (device work list only) runs no KV steps and stores nothing.
        kv_end = tl.where(q_start < seg_end, seg_end, seg_start)
        rows = q_start + tl.arange(0, BLOCK_M)
        row_ok = rows < seg_end
        h64 = head.to(tl.int64)
        Qh = Q + h64 * stride_qh
        Kh = K + h64 * stride_kh
        Vh = V + h64 * stride_vh
        q0 = _load_rows(Qh, rows, row_ok, stride_qt, 0, COS, SIN, stride_ct,
                        cos_cols, HEAD_DIM, BLOCK_D0, ROTARY)
        if BLOCK_D1 > 0:
            q1 = _load_rows(Qh, rows, row_ok, stride_qt, BLOCK_D0, COS, SIN,
                            stride_ct, cos_cols, HEAD_DIM, BLOCK_D1, ROTARY)
            acc1 = tl.zeros([BLOCK_M, BLOCK_D1], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, BLOCK_D0], tl.float32)
        for kv in tl.range(seg_start, kv_end, BLOCK_N):
            cols = kv + tl.arange(0, BLOCK_N)
            col_ok = cols < seg_end
            k0 = _load_rows(Kh, cols, col_ok, stride_kt, 0, COS, SIN, stride_ct,
                            cos_cols, HEAD_DIM, BLOCK_D0, ROTARY)
            qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
            if BLOCK_D1 > 0:
                k1 = _load_rows(Kh, cols, col_ok, stride_kt, BLOCK_D0, COS, SIN,
                                stride_ct, cos_cols, HEAD_DIM, BLOCK_D1, ROTARY)
                qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
            qk = tl.where(col_ok[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(V.dtype.element_ty)
            v0 = _load_rows(Vh, cols, col_ok, stride_vt, 0, COS, SIN, stride_ct,
                            cos_cols, HEAD_DIM, BLOCK_D0, False)
            acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
            if BLOCK_D1 > 0:
                v1 = _load_rows(Vh, cols, col_ok, stride_vt, BLOCK_D0, COS, SIN,
                                stride_ct, cos_cols, HEAD_DIM, BLOCK_D1, False)
                acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
        inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
        Oh = Out + h64 * stride_oh
        row_off = rows.to(tl.int64)[:, None] * stride_ot
        d0 = tl.arange(0, BLOCK_D0)
        out0 = (acc0 * inv_l[:, None]).to(Out.dtype.element_ty)
        tl.store(Oh + row_off + d0[None, :], out0,
                 mask=row_ok[:, None] & (d0 < HEAD_DIM)[None, :])
        if BLOCK_D1 > 0:
            d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
            out1 = (acc1 * inv_l[:, None]).to(Out.dtype.element_ty)
            tl.store(Oh + row_off + d1[None, :], out1,
                     mask=row_ok[:, None] & (d1 < HEAD_DIM)[None, :])


_DUMMY: dict[torch.device, torch.Tensor] = {}


def _dummy_fp32(device: torch.device) -> torch.Tensor:
    """A one-element fp32 buffer standing in for cos/sin when no rotary is fused."""
    buf = _DUMMY.get(device)
    if buf is None:
        buf = _DUMMY[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return buf


def vit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, *, scale: float | None = None, num_sms: int | None = None,
                  cu_seqlens_cpu: torch.Tensor | Sequence[int] | None = None,
                  plan: VitAttentionPlan | None = None, cos: torch.Tensor | None = None,
                  sin: torch.Tensor | None = None, device_worklist: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional attention within each `cu_seqlens` segment: q, k, v ``[T, H, D]`` -> out.

    Host data for the LPT work list comes from `plan`, else `cu_seqlens_cpu`, else `cu_seqlens`
    itself when it lives on the CPU; otherwise (or with `device_worklist`) the kernel walks
    ``S * H * cdiv(max_seqlen, BLOCK_M)`` tiles in segment order, so `max_seqlen` must bound every
    segment. `cos`/`sin` fuse rotate-half RoPE into the loads; `out` (``[T, H, D]``, unit last
    stride) receives the result. Never syncs with the device.
    """
    total, heads, head_dim = check_qkv(q, k, v)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or not cu_seqlens.numel():
        raise ValueError("cu_seqlens must be a 1-D tensor of S+1 >= 1 offsets")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the CPU or on {q.device}")
    require_int("max_seqlen", max_seqlen, 0)
    if max_seqlen == 0 and total > 0:
        raise ValueError("max_seqlen must be >= 1 when T > 0")
    sm_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    budget = resolve_num_sms(num_sms, q.device)
    cos_cols = check_rotary(cos, sin, q)
    rotary = cos_cols > 0
    num_segments = cu_seqlens.numel() - 1

    host = None
    if plan is not None:
        if (plan.num_heads, plan.head_dim, plan.dtype, plan.total_tokens) != (
                heads, head_dim, q.dtype, total) or plan.tiles.device != q.device:
            raise ValueError(f"plan was made for H={plan.num_heads}, D={plan.head_dim}, "
                             f"{plan.dtype}, T={plan.total_tokens} on {plan.tiles.device}")
        if max_seqlen < plan.max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} < longest segment {plan.max_seqlen}")
    elif cu_seqlens_cpu is not None or cu_seqlens.device.type == "cpu":
        name = "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens"
        src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        try:
            host = host_cu_seqlens(src, total)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if host.numel() != cu_seqlens.numel():
            raise ValueError(f"{name} has {host.numel()} entries, cu_seqlens {cu_seqlens.numel()}")
        longest = int((host[1:] - host[:-1]).max()) if num_segments else 0
        if max_seqlen < longest:
            raise ValueError(f"max_seqlen={max_seqlen} < longest segment {longest}")

    if out is None:
        out = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
    elif (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
          or out.stride(2) != 1):
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device} with "
                         "unit last stride")
    if total == 0:
        return out
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    cfg = dict(block_config(head_dim, q.dtype, q.device, rotary))
    if plan is not None:
        cfg["BLOCK_M"] = plan.block_m
    block_m = cfg["BLOCK_M"]
    use_tiles = not device_worklist and (plan is not None or host is not None)
    if use_tiles:
        tiles = plan.tiles if plan is not None else build_tiles(host, heads, block_m).to(q.device)
        cu_dev, num_tiles, num_q_blocks = tiles, tiles.shape[0], 1
    else:
        tiles = cu_dev = cu_seqlens.to(q.device)
        num_q_blocks = triton.cdiv(max_seqlen, block_m)
        num_tiles = num_segments * heads * num_q_blocks
    if num_tiles >= 2**31:
        raise ValueError(f"{num_tiles} tiles overflow int32; lower max_seqlen")
    if rotary:
        cos_t, sin_t, stride_ct = cos, sin, cos.stride(0)
    else:
        cos_t = sin_t = _dummy_fp32(q.device)
        stride_ct, cos_cols = 0, head_dim
    d0, d1 = head_dim_split(head_dim)
    args = (q, k, v, out, cos_t, sin_t, cu_dev, tiles, num_tiles, heads, num_q_blocks,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), stride_ct, cos_cols, sm_scale * _LOG2E)
    launch_persistent(_vit_attention_kernel, NAME, num_tiles, budget, args, config=cfg,
                      HEAD_DIM=head_dim, BLOCK_D0=d0, BLOCK_D1=d1, USE_TILES=use_tiles,
                      ROTARY=rotary,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out


def _ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in x's dtype; cos/sin [T, D] or [T, D/2] (halves repeated)."""
    half = x.shape[-1] // 2
    if cos.shape[-1] == half:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def ref_vit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float | None = None, *, cos: torch.Tensor | None = None,
                      sin: torch.Tensor | None = None) -> torch.Tensor:
    """Per-segment softmax attention in the input dtype (tests pass fp64); optional RoPE first."""
    if cos is not None:
        q, k = _ref_rotary(q, cos, sin), _ref_rotary(k, cos, sin)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    bounds = [int(x) for x in cu_seqlens.cpu()]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            att = torch.softmax(qs @ ks.transpose(1, 2) * sm_scale, dim=-1)
            out[start:end] = (att @ vs).transpose(0, 1)
    return out


def compile_specs() -> list[CompileSpec]:
    """Every GPU configuration the launcher picks by default: bf16/fp16 x D in {64, 80, 128} x
    (host work list, device work list) x (plain, fused rotary)."""
    # q/k/v/out strides carry the divisible-by-16 hint ("i32:16") the JIT finds at run time for
    # D in {64, 80, 128}; without it the AOT build loses vector loads and cp.async pipelining.
    strides = [f"stride_{t}{d}" for t in "qkvo" for d in "th"]
    specs = []
    for dtype, head_dim, use_tiles, rotary in itertools.product(
            (torch.bfloat16, torch.float16), (64, 80, 128), (True, False), (False, True)):
        ty, (d0, d1) = DTYPE_NAMES[dtype], head_dim_split(head_dim)
        cfg = default_config(head_dim, dtype, "cuda", rotary)
        sig = {n: f"*{ty}" for n in ("Q", "K", "V", "Out")}
        sig.update(COS="*fp32", SIN="*fp32", CU_SEQLENS="*i32", TILES="*i32")
        sig.update(num_tiles="i32", num_heads="i32", num_q_blocks="i32")
        sig.update({n: "i32:16" for n in strides}, stride_ct="i32", cos_cols="i32", qk_scale="fp32")
        const = {"HEAD_DIM": head_dim, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                 "BLOCK_D0": d0, "BLOCK_D1": d1, "USE_TILES": use_tiles, "ROTARY": rotary,
                 "DOT_PRECISION": "tf32"}
        tag = f"{ty},d{head_dim},{'tiles' if use_tiles else 'segments'}{',rotary' * rotary}"
        specs.append(CompileSpec(f"{NAME}[{tag}]", _vit_attention_kernel, sig, const,
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                 expect_wgmma=cfg["BLOCK_M"] >= 64))
    return specs
