"""Causal paged prefill attention: persistent over (sequence, q-block, kv-head) tiles.

q holds the newest tokens of each sequence (their K/V already stored in the cache). Query i of a
sequence with n new tokens and `seq_len` cached tokens sits at absolute position
``seq_len - n + i`` and attends to cache positions up to it, so chunked prefill (store a chunk,
attend, repeat) equals a one-shot prefill. A tile holds BLOCK_Q tokens times the GQA group of one
KV head (rows = BLOCK_Q * group padded to a power of two), so each K/V page is loaded once per
group. Tiles run most KV tokens first; KV blocks wholly below a tile's first position skip the
causal mask. Each tile owns its output rows, so the budget never changes a bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spaceserve.kernels.attention.paged_decode import (
    LOG2E,
    attend_block,
    dot_precision,
    numerics_config,
)
from spaceserve.kernels.attention.paged_plan import (
    StagedWorkList,
    as_host_int_tensor,
    build_prefill_work,
    cdiv,
    check_block_ids_host,
    check_caches,
    check_heads,
    check_index,
    check_lengths_host,
    check_plan_sizes,
    next_pow2,
    prefill_work_host,
)
from spaceserve.kernels.budget import device_num_sms, resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import launch_persistent

PREFILL_DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def prefill_default(head_dim: int) -> dict:
    """Default config: 8 warps past D=64, where a [64, D] fp32 accumulator in 4 warps spills."""
    return {**PREFILL_DEFAULT, "num_warps": 8 if head_dim > 64 else 4}


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, work_ptr, out_ptr,
    num_tiles, scale,
    sq_t, sq_h, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, sbt, so_t, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    n_items = tl.minimum(tl.load(work_ptr), num_tiles)
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, D_PAD)
    j = tl.arange(0, BLOCK_N)
    d_ok = d < HEAD_DIM
    for tile in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        item = work_ptr + 1 + tile * 3
        seq = tl.load(item)
        qb = tl.load(item + 1)
        kvh = tl.load(item + 2)
        if seq >= 0:
            q0 = tl.load(cu_ptr + seq)
            n_new = tl.load(cu_ptr + seq + 1) - q0
            seq_len = tl.load(lens_ptr + seq)
            i = qb * BLOCK_Q + tok
            row_ok = (i < n_new) & (g < GROUP)
            rd_ok = row_ok[:, None] & d_ok[None, :]
            pos = seq_len - n_new + i
            heads = kvh * GROUP + g
            q_rows = (q0 + i).to(tl.int64) * sq_t + heads * sq_h
            q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=rd_ok, other=0.0)
            pos_lo = seq_len - n_new + qb * BLOCK_Q
            kv_end = seq_len - n_new + tl.minimum(qb * BLOCK_Q + BLOCK_Q, n_new)
            full_end = (pos_lo + 1) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
            bt_row = bt_ptr + seq.to(tl.int64) * sbt
            for n0 in tl.range(0, full_end, BLOCK_N):
                t = n0 + j
                t_ok = t < full_end
                acc, m_i, l_i = attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, t, t_ok,
                                             t_ok[None, :], kvh, d, d_ok, scale,
                                             sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, PAGE, PRECISION)
            for n0 in tl.range(full_end, kv_end, BLOCK_N):
                t = n0 + j
                t_ok = t < kv_end
                causal = t_ok[None, :] & (t[None, :] <= pos[:, None])
                acc, m_i, l_i = attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, t, t_ok,
                                             causal, kvh, d, d_ok, scale,
                                             sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, PAGE, PRECISION)
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_rows = (q0 + i).to(tl.int64) * so_t + heads * so_h
            tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=rd_ok)


def prefill_block_q(group: int, device: torch.device) -> int:
    """Query tokens per tile: BLOCK_M rows shared by the padded GQA group (full-device config)."""
    block_m = kernel_config("paged_prefill", device_num_sms(device), PREFILL_DEFAULT)["BLOCK_M"]
    gpad = next_pow2(group)
    if gpad > block_m:
        raise ValueError(f"GQA group {group} exceeds the prefill tile of {block_m} rows")
    return block_m // gpad


def _check_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   seq_lens: torch.Tensor) -> tuple[int, int]:
    """Validate prefill arguments (host metadata; values too when they live on the CPU)."""
    nb, bs, _, _ = check_caches(k_cache, v_cache)
    _, group = check_heads(q, k_cache, 3)
    s = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_index(seq_lens, "seq_lens", (s,), q.device)
    check_index(cu_seqlens_q, "cu_seqlens_q", (s + 1,), q.device)
    check_index(block_tables, "block_tables", (s, None), q.device)
    if cu_seqlens_q.device.type == "cpu":
        check_prefill_values(cu_seqlens_q, seq_lens, q.shape[0], block_tables.shape[1] * bs)
        check_block_ids_host(block_tables, seq_lens, bs, nb)
    return bs, group


def check_prefill_values(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                         capacity_tokens: int) -> None:
    """Host-side checks: cu_seqlens_q starts at 0, is non-decreasing, ends at T; n <= seq_len."""
    cu = cu_seqlens_q.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    if cu.numel() != lens.numel() + 1:
        raise ValueError(f"cu_seqlens_q has {cu.numel()} entries, seq_lens {lens.numel()}")
    n = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or (n.numel() and int(n.min()) < 0):
        raise ValueError("cu_seqlens_q must start at 0 and be non-decreasing")
    if int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens_q ends at {int(cu[-1])}, q has {num_tokens} tokens")
    check_lengths_host(lens, capacity_tokens)
    if n.numel() and bool((n > lens).any()):
        raise ValueError("seq_lens is shorter than the new tokens of cu_seqlens_q")


def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   seq_lens: torch.Tensor, work: torch.Tensor, out: torch.Tensor, block_q: int,
                   scale: float | None, num_sms: int) -> torch.Tensor:
    """Launch the persistent prefill kernel over the work list in `work`."""
    _, hq, dim = q.shape
    group = hq // k_cache.shape[2]
    scale = (1.0 / math.sqrt(dim)) if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg = numerics_config("paged_prefill", num_sms, q.device, prefill_default(dim))
    cfg.pop("BLOCK_M", None)
    capacity = (work.numel() - 1) // 3
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, work, out,
            capacity, scale * LOG2E, q.stride(0), q.stride(1), *k_cache.stride()[:3],
            *v_cache.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1))
    launch_persistent(_paged_prefill_kernel, "paged_prefill", capacity, num_sms, args,
                      config=cfg, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=dim,
                      D_PAD=max(16, next_pow2(dim)), PAGE=k_cache.shape[1], BLOCK_Q=block_q,
                      PRECISION=dot_precision(q.dtype))
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, *, scale: float | None = None,
                            num_sms: int | None = None) -> torch.Tensor:
    """Causal attention of the newest tokens of each sequence over its paged cache; [T, Hq, D].

    q [T, Hq, D]; cu_seqlens_q int32 [S+1] splits q by sequence; seq_lens int32 [S] = cached
    length (prefix + new) per sequence; block_tables int32 [S, max_blocks]. Plans its own work
    list on the device of `seq_lens`, without a host sync.
    """
    _, group = _check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    budget = resolve_num_sms(num_sms, q.device)
    block_q = prefill_block_q(group, q.device)
    hkv = k_cache.shape[2]
    qblocks = cdiv(q.shape[0], block_q) + seq_lens.shape[0]
    work = torch.empty(1 + qblocks * hkv * 3, dtype=torch.int32, device=q.device)
    build_prefill_work(cu_seqlens_q, seq_lens, hkv, block_q, qblocks, work)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return launch_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, work, out,
                          block_q, scale, budget)


class PrefillPlan:
    """Plan/run split of paged prefill: a fixed-capacity work list filled from host metadata.

    Capacity covers up to `max_tokens` new tokens in up to `max_seqs` sequences. `plan` takes the
    host-side cu_seqlens_q and seq_lens; `run` only launches, with a grid fixed by capacity and
    budget.
    """

    def __init__(self, max_tokens: int, max_seqs: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, *, device: torch.device | str) -> None:
        check_plan_sizes(num_q_heads, max_tokens=max_tokens, max_seqs=max_seqs,
                         num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_q = prefill_block_q(num_q_heads // num_kv_heads, self.device)
        self.qblocks = cdiv(max_tokens, self.block_q) + max_seqs
        self.work = StagedWorkList(self.qblocks * num_kv_heads, self.device)
        self.num_tokens = -1
        self.num_seqs = -1
        self.max_len = 0

    def plan(self, cu_seqlens_q_host: Sequence[int] | torch.Tensor,
             seq_lens_host: Sequence[int] | torch.Tensor) -> None:
        """Fill the work list from host-side cu_seqlens_q [S+1] and seq_lens [S]."""
        cu = as_host_int_tensor(cu_seqlens_q_host, "cu_seqlens_q_host")
        lens = as_host_int_tensor(seq_lens_host, "seq_lens_host")
        if lens.numel() > self.max_seqs:
            raise ValueError(f"seq_lens_host has {lens.numel()} entries > max_seqs="
                             f"{self.max_seqs}")
        if cu.numel() and int(cu[-1]) > self.max_tokens:
            raise ValueError(f"cu_seqlens_q_host totals {int(cu[-1])} > max_tokens="
                             f"{self.max_tokens}")
        check_prefill_values(cu, lens, int(cu[-1]) if cu.numel() else 0, 1 << 31)
        self.work.stage(prefill_work_host(cu.numpy(), lens.numpy(), self.num_kv_heads,
                                          self.block_q))
        self.num_tokens, self.num_seqs = int(cu[-1]), lens.numel()
        self.max_len = int(lens.max()) if lens.numel() else 0

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *,
            out: torch.Tensor | None = None, scale: float | None = None,
            num_sms: int | None = None) -> torch.Tensor:
        """Launch the planned prefill; writes and returns `out` [T, Hq, D]."""
        bs, _ = _check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
        budget = resolve_num_sms(num_sms, q.device)
        if (q.shape[0], seq_lens.shape[0]) != (self.num_tokens, self.num_seqs):
            raise ValueError(f"q/seq_lens describe {q.shape[0]} tokens in {seq_lens.shape[0]} "
                             f"sequences; the plan {self.num_tokens} in {self.num_seqs}")
        if (q.shape[1], k_cache.shape[2], q.shape[2]) != (
                self.num_q_heads, self.num_kv_heads, self.head_dim):
            raise ValueError("q/k_cache heads or head_dim differ from the plan")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device}, the plan on {self.device}")
        if block_tables.shape[1] * bs < self.max_len:
            raise ValueError(f"block_tables holds {block_tables.shape[1] * bs} tokens, the "
                             f"planned seq_lens need {self.max_len}")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}")
        return launch_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                              self.work.buffer, out, self.block_q, scale, budget)


def ref_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, *, scale: float | None = None
                                ) -> torch.Tensor:
    """Torch reference: gather pages, causal by absolute position, in q's dtype (pass fp64)."""
    hq, dim = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = (1.0 / math.sqrt(dim)) if scale is None else scale
    out = torch.zeros_like(q)
    for s in range(seq_lens.shape[0]):
        a, b, n = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(seq_lens[s])
        if b == a:
            continue
        pages = block_tables[s, : cdiv(n, bs)].long()
        k = k_cache[pages].reshape(-1, hkv, dim)[:n].repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, dim)[:n].repeat_interleave(hq // hkv, dim=1)
        pos = torch.arange(n - (b - a), n)
        mask = torch.arange(n)[None, :] <= pos[:, None]
        sc = torch.einsum("thd,nhd->htn", q[a:b], k) * scale
        sc = sc.masked_fill(~mask[None], float("-inf"))
        out[a:b] = torch.einsum("htn,nhd->thd", torch.softmax(sc, dim=-1), v)
    return out
