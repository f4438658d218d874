"""Host side of `vit_attention`: block config, argument checks and the LPT work list.

The work list has one (segment start, segment end, first query row, head) int32 row per tile,
longest segment first (a stable sort), so the last round of a persistent launch is short. It
depends on cu_seqlens, the head count and BLOCK_M only, never on the budget, so one
`VitAttentionPlan` serves every split and every layer of a vision pass. BLOCK_M and the other
block sizes come from the whole-device config bucket: they set the reduction order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton

from spaceserve.checks import require_int
from spaceserve.kernels.budget import device_num_sms
from spaceserve.kernels.configs import kernel_config

NAME = "vit_attention"
MAX_HEAD_DIM = 256
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def head_dim_split(head_dim: int) -> tuple[int, int]:
    """Two power-of-two dot widths (>= 16, second may be 0) covering `head_dim`: 80 -> (64, 16)."""
    d0 = max(16, 1 << (head_dim.bit_length() - 1))
    if d0 >= head_dim:
        return d0, 0
    return d0, max(16, triton.next_power_of_2(head_dim - d0))


def default_config(head_dim: int, dtype: torch.dtype, device_type: str,
                   rotary: bool = False) -> dict[str, Any]:
    """Block sizes, warps and stages used when no tuned table is installed.

    Fused rotary pipelines fp32 cos/sin tiles beside K, so it takes fewer stages and, past D=80,
    a narrower BLOCK_N (D=128 with three stages needs 288 KiB of shared memory, over sm_90's
    227 KiB; with BLOCK_N=64 it spills registers).
    """
    if device_type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    wide = sum(head_dim_split(head_dim)) > 128
    if dtype == torch.float32:
        stages = 1 if wide and rotary else 2
        return {"BLOCK_M": 32 if wide else 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": stages}
    if wide:
        return {"BLOCK_M": 64, "BLOCK_N": 32 if rotary else 64, "num_warps": 4,
                "num_stages": 2}
    if rotary:
        return {"BLOCK_M": 128, "BLOCK_N": 32 if head_dim > 80 else 64, "num_warps": 8,
                "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def block_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                 rotary: bool = False) -> dict[str, Any]:
    """The launch config: the tuned table's entry at the whole-device bucket, else the default.

    Never per budget: block sizes and warps change the reduction order, so a per-budget choice
    would make the result depend on the budget."""
    default = default_config(head_dim, dtype, device.type, rotary)
    return kernel_config(NAME, device_num_sms(device), default)


def host_cu_seqlens(cu: torch.Tensor | Sequence[int], total: int | None) -> torch.Tensor:
    """Validate host cu_seqlens (int32 tensor or int list) and return it as an int64 CPU tensor."""
    if isinstance(cu, torch.Tensor):
        if cu.device.type != "cpu":
            raise ValueError("cu_seqlens host copy must be a CPU tensor or a list of ints")
        if cu.dtype != torch.int32:
            raise ValueError(f"cu_seqlens must be int32, got {cu.dtype}")
        host = cu.to(torch.int64)
    else:
        host = torch.tensor([int(x) for x in cu], dtype=torch.int64)
    if host.dim() != 1 or host.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with S+1 >= 1 entries, got {tuple(host.shape)}")
    if host[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(host[0])}")
    if total is not None and host[-1] != total:
        raise ValueError(f"cu_seqlens must end at T={total}, got {int(host[-1])}")
    if host.numel() > 1 and bool((host[1:] < host[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return host


def build_tiles(cu: torch.Tensor, num_heads: int, block_m: int) -> torch.Tensor:
    """(seg_start, seg_end, q_start, head) int32 rows, longest segment first (stable)."""
    lens = cu[1:] - cu[:-1]
    _, order = torch.sort(-lens, stable=True)
    nblk = (lens[order] + block_m - 1) // block_m
    counts = nblk * num_heads
    seg = torch.repeat_interleave(order, counts)
    nb = torch.repeat_interleave(nblk, counts)
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(seg.numel(), dtype=torch.int64) - torch.repeat_interleave(first, counts)
    start = cu[seg]
    tiles = torch.stack([start, cu[seg + 1], start + (j % nb) * block_m, j // nb], dim=1)
    return tiles.to(torch.int32).contiguous()


@dataclass(frozen=True)
class VitAttentionPlan:
    """A host-built LPT work list for one cu_seqlens, reused by every layer of a vision pass."""

    tiles: torch.Tensor  # int32 [num_tiles, 4] on the run device
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    total_tokens: int
    max_seqlen: int
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


def plan_vit_attention(cu_seqlens: torch.Tensor | Sequence[int], num_heads: int, head_dim: int,
                       *, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str | None = None) -> VitAttentionPlan:
    """Plan tiles for `vit_attention(..., plan=plan)` from a host copy of cu_seqlens.

    The work list and block config do not depend on the budget, so one plan serves every split.
    """
    require_int("num_heads", num_heads)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not (
            1 <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"head_dim must be an int in 1..{MAX_HEAD_DIM}, got {head_dim!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    cu = host_cu_seqlens(cu_seqlens, None)
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    block_m = block_config(head_dim, dtype, dev)["BLOCK_M"]
    tiles = build_tiles(cu, num_heads, block_m).to(dev)
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return VitAttentionPlan(tiles, num_heads, head_dim, dtype, int(cu[-1]), max_len, block_m)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """Validate q, k, v (``[T, H, D]``, one dtype and device); returns (T, H, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] tensor")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name} dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v must be on one device")
    total, heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head dim D={head_dim} must be in 1..{MAX_HEAD_DIM}")
    return total, heads, head_dim


def check_rotary(cos: torch.Tensor | None, sin: torch.Tensor | None, q: torch.Tensor) -> int:
    """Validate fused-rotary tables; returns their column count (0 when no rotary)."""
    if cos is None and sin is None:
        return 0
    if cos is None or sin is None:
        raise ValueError("cos and sin must be given together")
    total, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got D={head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}")
        if t.dim() != 2 or t.shape[0] != total or t.shape[1] not in (head_dim, head_dim // 2):
            raise ValueError(f"{name} must be [T, D] or [T, D/2] = [{total}, {head_dim}] or "
                             f"[{total}, {head_dim // 2}], got {tuple(t.shape)}")
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError("sin must have the shape and strides of cos")
    return cos.shape[1]
