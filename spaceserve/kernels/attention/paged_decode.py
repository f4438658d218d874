"""Paged decode attention: persistent split-KV over (sequence, chunk, kv-head) work items.

One query token per sequence. Each work item attends the whole GQA group of one KV head (the q
tile is [group padded to >= 16, D], so `tl.dot` is legal on sm_90) to one chunk of `CHUNK`
cached tokens, BLOCK_N tokens (several pages, gathered through the block table) per iteration.
The chunk size is fixed, never derived from the budget, and a sequence longer than one chunk is
finished by a second pass that merges its chunks by log-sum-exp in chunk order: outputs are
bitwise identical for every `num_sms`. A sequence of one chunk is written directly.

`DecodePlan` is the plan/run split for CUDA graphs: `plan` (host) fills a preallocated work list,
`run` launches kernels whose grids depend only on capacity and budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spaceserve.kernels.attention.paged_plan import (
    StagedWorkList,
    as_host_int_tensor,
    build_decode_work,
    cdiv,
    check_block_ids_host,
    check_caches,
    check_heads,
    check_index,
    check_lengths_host,
    check_plan_sizes,
    decode_work_host,
    next_pow2,
)
from spaceserve.kernels.budget import device_num_sms, resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import launch_persistent

DECODE_CHUNK = 512  # tokens per split-KV work item: fixed, independent of the budget
LOG2E = 1.4426950408889634
DECODE_DEFAULT = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
MERGE_DEFAULT = {"num_warps": 4, "num_stages": 1}


@triton.jit
def attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row_ptr, t, t_ok, score_ok, kvh, d, d_ok,
                 scale, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h,
                 PAGE: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over BLOCK_N cached tokens `t` gathered page by page."""
    page = tl.load(bt_row_ptr + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    off = t % PAGE
    kv_ok = t_ok[:, None] & d_ok[None, :]
    k_rows = page * sk_b + off * sk_o + kvh * sk_h
    k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=kv_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(score_ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_rows = page * sv_b + off * sv_o + kvh * sv_h
    v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=kv_ok, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, work_ptr, out_ptr, po_ptr, plse_ptr,
    num_tiles, scale, max_chunks, num_q_heads,
    sq_b, sq_h, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, sbt, so_b, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):
    n_items = tl.minimum(tl.load(work_ptr), num_tiles)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    j = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    gd_ok = g_ok[:, None] & d_ok[None, :]
    for tile in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        item = work_ptr + 1 + tile * 3
        seq = tl.load(item)
        chunk = tl.load(item + 1)
        kvh = tl.load(item + 2)
        if seq >= 0:
            seq_len = tl.load(lens_ptr + seq)
            start = chunk * CHUNK
            end = tl.minimum(start + CHUNK, seq_len)
            heads = kvh * GROUP + g
            q = tl.load(q_ptr + seq.to(tl.int64) * sq_b + heads[:, None] * sq_h + d[None, :],
                        mask=gd_ok, other=0.0)
            m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
            bt_row = bt_ptr + seq.to(tl.int64) * sbt
            for n0 in tl.range(start, end, BLOCK_N):
                t = n0 + j
                t_ok = t < end
                acc, m_i, l_i = attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, t, t_ok,
                                             t_ok[None, :], kvh, d, d_ok, scale,
                                             sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, PAGE, PRECISION)
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            if seq_len <= CHUNK:
                dst = out_ptr + seq.to(tl.int64) * so_b + heads[:, None] * so_h + d[None, :]
                tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=gd_ok)
            else:
                row = (seq * max_chunks + chunk).to(tl.int64) * num_q_heads + heads
                tl.store(po_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=gd_ok)
                tl.store(plse_ptr + row, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit
def _paged_merge_kernel(
    lens_ptr, po_ptr, plse_ptr, out_ptr,
    num_tiles, num_kv_heads, max_chunks, num_q_heads, so_b, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    gd_ok = g_ok[:, None] & (d < HEAD_DIM)[None, :]
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        seq = tile // num_kv_heads
        kvh = tile % num_kv_heads
        seq_len = tl.load(lens_ptr + seq)
        if seq_len > CHUNK:
            heads = kvh * GROUP + g
            m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
            for c in range(0, tl.cdiv(seq_len, CHUNK)):
                row = (seq * max_chunks + c).to(tl.int64) * num_q_heads + heads
                lse = tl.load(plse_ptr + row, mask=g_ok, other=0.0)
                o = tl.load(po_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=gd_ok, other=0.0)
                m_new = tl.maximum(m_i, lse)
                alpha = tl.exp2(m_i - m_new)
                w = tl.exp2(lse - m_new)
                acc = acc * alpha[:, None] + o * w[:, None]
                l_i = l_i * alpha + w
                m_i = m_new
            dst = out_ptr + seq.to(tl.int64) * so_b + heads[:, None] * so_h + d[None, :]
            tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs stay exact ("ieee"); half types use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def numerics_config(name: str, num_sms: int, device: torch.device,
                    default: dict) -> dict:
    """Block sizes and warps from the full-device config, only stages from the budget's.

    Everything that changes arithmetic (tile sizes, warps) is fixed per device, so a tuned table
    cannot make results depend on the budget; pipelining depth may vary per budget.
    """
    cfg = dict(kernel_config(name, device_num_sms(device), default))
    cfg["num_stages"] = kernel_config(name, num_sms, default).get("num_stages",
                                                                  default["num_stages"])
    return cfg


def _check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """Validate decode arguments (host metadata; values too when they live on the CPU)."""
    nb, bs, _, _ = check_caches(k_cache, v_cache)
    _, group = check_heads(q, k_cache, 3)
    b = q.shape[0]
    check_index(block_tables, "block_tables", (b, None), q.device)
    check_index(seq_lens, "seq_lens", (b,), q.device)
    if seq_lens.device.type == "cpu":
        check_lengths_host(seq_lens.to(torch.int64), block_tables.shape[1] * bs)
        check_block_ids_host(block_tables, seq_lens, bs, nb)
    return bs, group


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, work: torch.Tensor,
                  out: torch.Tensor, partial_o: torch.Tensor | None,
                  partial_lse: torch.Tensor | None, max_chunks: int, chunk: int,
                  scale: float | None, num_sms: int) -> torch.Tensor:
    """Launch the split-KV pass (and the merge pass when a chunk list can exceed one)."""
    b, hq, dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = (1.0 / math.sqrt(dim)) if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg = numerics_config("paged_decode", num_sms, q.device, DECODE_DEFAULT)
    meta = dict(GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=dim,
                D_PAD=max(16, next_pow2(dim)), PAGE=k_cache.shape[1], CHUNK=chunk,
                PRECISION=dot_precision(q.dtype))
    if partial_o is None or partial_lse is None:
        if max_chunks > 1:
            raise ValueError("partial buffers are required when a sequence spans chunks")
        partial_o, partial_lse = _partials(1, 1, 1, q.device)
    capacity = (work.numel() - 1) // 3
    args = (q, k_cache, v_cache, block_tables, seq_lens, work, out, partial_o, partial_lse,
            capacity, scale * LOG2E, max_chunks, hq,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_tables.stride(0), out.stride(0), out.stride(1))
    launch_persistent(_paged_decode_kernel, "paged_decode", capacity, num_sms, args,
                      config=cfg, **meta)
    if max_chunks > 1:
        mcfg = numerics_config("paged_decode_merge", num_sms, q.device, MERGE_DEFAULT)
        margs = (seq_lens, partial_o, partial_lse, out, b * hkv, hkv, max_chunks, hq,
                 out.stride(0), out.stride(1))
        launch_persistent(_paged_merge_kernel, "paged_decode_merge", b * hkv, num_sms, margs,
                          config=mcfg, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=dim,
                          D_PAD=next_pow2(dim), CHUNK=chunk)
    return out


def _partials(rows: int, hq: int, dim: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partial outputs and log2-sum-exp; every row read is written first."""
    return (torch.empty(rows, hq, dim, dtype=torch.float32, device=device),
            torch.empty(rows, hq, dtype=torch.float32, device=device))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: float | None = None, num_sms: int | None = None
                           ) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache; [B, Hq, D].

    q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B] (0 = padding: no work, zero output). Plans its own work list, on the device
    of `seq_lens` and without a host sync.
    """
    bs, _ = _check_decode(q, k_cache, v_cache, block_tables, seq_lens)
    budget = resolve_num_sms(num_sms, q.device)
    b, hq, dim = q.shape
    hkv = k_cache.shape[2]
    max_chunks = max(1, cdiv(block_tables.shape[1] * bs, DECODE_CHUNK))
    work = torch.empty(1 + b * hkv * max_chunks * 3, dtype=torch.int32, device=q.device)
    build_decode_work(seq_lens, hkv, max_chunks, DECODE_CHUNK, work)
    po, plse = _partials(b * max_chunks if max_chunks > 1 else 1, hq, dim, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, work, out, po, plse,
                         max_chunks, DECODE_CHUNK, scale, budget)


class DecodePlan:
    """Plan/run split of paged decode for one batch-size bucket (CUDA-graph capturable).

    Owns a fixed-capacity work list and the split-KV partial buffers ([rows, Hq, D] fp32 and
    [rows, Hq] log-sum-exp), allocated once. `plan(seq_lens_host)` fills the work list from
    host-side lengths (one non-blocking copy); `run(...)` only launches kernels, with grids that
    depend on capacity and budget alone, so a captured graph replays correctly after each new
    `plan`. Capture with a block table `max_blocks_per_seq` wide, and call `plan` on the stream
    that runs the step (its copy is ordered on the current stream).
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, *,
                 device: torch.device | str, chunk_size: int = DECODE_CHUNK) -> None:
        check_plan_sizes(num_q_heads, max_batch=max_batch, max_blocks_per_seq=max_blocks_per_seq,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                         chunk_size=chunk_size)
        self.device = torch.device(device)
        self.max_batch, self.max_blocks_per_seq = max_batch, max_blocks_per_seq
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.block_size, self.chunk_size = head_dim, block_size, chunk_size
        self.max_chunks = max(1, cdiv(max_blocks_per_seq * block_size, chunk_size))
        self.work = StagedWorkList(max_batch * num_kv_heads * self.max_chunks, self.device)
        rows = max_batch * self.max_chunks if self.max_chunks > 1 else 1
        self.partial_o, self.partial_lse = _partials(rows, num_q_heads, head_dim, self.device)
        self.batch = 0
        self.pages_needed = 0

    def plan(self, seq_lens_host: Sequence[int] | torch.Tensor) -> None:
        """Fill the work list for a batch with these host-side lengths (0 = padding slot)."""
        lens = as_host_int_tensor(seq_lens_host, "seq_lens_host")
        if lens.numel() > self.max_batch:
            raise ValueError(f"seq_lens_host has {lens.numel()} entries > max_batch="
                             f"{self.max_batch}")
        check_lengths_host(lens, self.max_blocks_per_seq * self.block_size, "seq_lens_host")
        self.work.stage(decode_work_host(lens.numpy(), self.num_kv_heads, self.max_chunks,
                                         self.chunk_size))
        self.batch = lens.numel()
        self.pages_needed = cdiv(int(lens.max()), self.block_size) if lens.numel() else 0

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
            out: torch.Tensor | None = None, scale: float | None = None,
            num_sms: int | None = None) -> torch.Tensor:
        """Launch the planned decode step; writes and returns `out` [B, Hq, D]."""
        bs, _ = _check_decode(q, k_cache, v_cache, block_tables, seq_lens)
        budget = resolve_num_sms(num_sms, q.device)
        if q.shape[0] != self.batch:
            raise ValueError(f"q has batch {q.shape[0]} but the plan was made for {self.batch}")
        if (q.shape[1], k_cache.shape[2], q.shape[2], bs) != (
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size):
            raise ValueError("q/k_cache heads, head_dim or block_size differ from the plan")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device}, the plan on {self.device}")
        if block_tables.shape[1] < self.pages_needed:
            raise ValueError(f"block_tables has {block_tables.shape[1]} columns, the planned "
                             f"lengths need {self.pages_needed}")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}")
        return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, self.work.buffer,
                             out, self.partial_o, self.partial_lse, self.max_chunks,
                             self.chunk_size, scale, budget)


def ref_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                               scale: float | None = None) -> torch.Tensor:
    """Torch reference: gather each sequence's pages, attend in q's dtype (pass fp64)."""
    b, hq, dim = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = (1.0 / math.sqrt(dim)) if scale is None else scale
    out = torch.zeros_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pages = block_tables[i, : cdiv(n, bs)].long()
        k = k_cache[pages].reshape(-1, hkv, dim)[:n].repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, dim)[:n].repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i], k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out
