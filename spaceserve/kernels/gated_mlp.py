"""Persistent SwiGLU MLP `down(silu(gate) * up)` in two GEMM launches.

Launch 1 multiplies x by both halves of `w_gate_up` [2I, K] (gate rows 0..I-1, up rows I..2I-1)
in one kernel: each tile computes a BLOCK_N slice of gate and the matching slice of up, so its
epilogue can write h = silu(gate + b_gate) * (up + b_up) directly in x.dtype. Launch 2 is the down
projection through `linear`'s kernel. Both use a split-K fixed by the shape when M is skinny; the
gate-up split writes fp32 partials [SPLIT_K, M, 2I] that the shared reduce sums in split order
before applying the gate, so results are bitwise identical for every budget.

Configs: `kernel_config("gated_mlp", ...)` (M > 64) / `kernel_config("gated_mlp_skinny", ...)`
for the gate-up kernel; the down projection uses "linear" / "linear_skinny".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.kernels.gemm import (
    block_meta,
    check_input,
    check_operand,
    choose_split_k,
    gemm_config,
    gemm_grid,
    gemm_signature,
    gemm_tile,
    k_contiguous,
    mma,
    row_align,
)
from spaceserve.kernels.linear import default_config, linear_into, reduce_spec, splitk_reduce
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

# Two accumulators per tile: half the N width of `linear`'s tiles at the same register cost.
GPU_CONFIGS: dict[str, dict[str, Any]] = {
    "large": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "mid": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "small": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
}
CPU_CONFIGS: dict[str, dict[str, Any]] = {
    "large": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
    "mid": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
    "small": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
}


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, ALIGN: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """h[M, N] = silu(x @ w[:N].T + b[:N]) * (x @ w[N:].T + b[N:]), N = I (see module doc)."""
    K, k_per_split, stride_xm, stride_wn, num_m, num_n, num_tiles = gemm_grid(
        M, N, K, stride_xm, stride_wn, split_k, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K, ALIGN)
    up_offset = N * stride_wn
    rk = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        s, rm, rn, k_lo, k_hi, a_ptrs, g_ptrs = gemm_tile(
            tile, x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, k_per_split, num_m, num_n, rk,
            BLOCK_M, BLOCK_N, GROUP_M)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_ok = rk < k_hi - k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(g_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            acc_g = mma(a, g, acc_g, UPCAST)
            acc_u = mma(a, u, acc_u, UPCAST)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT:
            ws = ws_ptr + (s * M + rm).to(tl.int64)[:, None] * (2 * N) + rn[None, :]
            tl.store(ws, acc_g, mask=mask)
            tl.store(ws + N, acc_u, mask=mask)
        else:
            if HAS_BIAS:
                acc_g += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
                acc_u += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
            tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


def gate_up_into(x: torch.Tensor, w_gate_up: torch.Tensor, b_gate_up: torch.Tensor | None,
                 h: torch.Tensor, num_sms: int) -> None:
    """Launch the fused gate-up GEMM (and its split-K reduce) into a contiguous h [M, I]."""
    m, k = x.shape
    inter = h.shape[1]
    default = default_config(m, x.device, GPU_CONFIGS, CPU_CONFIGS)
    cfg = gemm_config("gated_mlp", m, num_sms, default, x.device)
    split = choose_split_k(m, inter, k, default, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split) * cfg["BLOCK_K"]
    ws = (torch.empty((split, m, 2 * inter), device=x.device, dtype=torch.float32)
          if split > 1 else h)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(inter, cfg["BLOCK_N"]) * split
    launch_persistent(
        _gate_up_kernel, "gated_mlp.gate_up", tiles, num_sms,
        (x, w_gate_up, b_gate_up if b_gate_up is not None else w_gate_up, h, ws, m, inter, k,
         x.stride(0), w_gate_up.stride(0), h.stride(0), split, k_per_split),
        config=cfg, ALIGN=row_align(k, x, w_gate_up), SPLIT=split > 1,
        HAS_BIAS=b_gate_up is not None and split == 1,
        UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda,
    )
    if split > 1:
        splitk_reduce(ws, b_gate_up, h, split, 0, True, num_sms, "gated_mlp.gate_up.reduce")


def gated_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
              b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
              num_sms: int | None = None) -> torch.Tensor:
    """SwiGLU MLP: x [M, K], w_gate_up [2I, K] (gate rows first), w_down [K, I] -> [M, K] in
    x.dtype, under a budget of `num_sms` SMs (None = whole device)."""
    check_input(x)
    m, k = x.shape
    if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 2:
        raise ValueError("w_gate_up must be a 2-D tensor [2I, K]")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up has {w_gate_up.shape[0]} rows, expected an even 2I")
    inter = w_gate_up.shape[0] // 2
    check_operand("w_gate_up", w_gate_up, x, (2 * inter, k))
    check_operand("w_down", w_down, x, (k, inter))
    if b_gate_up is not None:
        check_operand("b_gate_up", b_gate_up, x, (2 * inter,))
    if b_down is not None:
        check_operand("b_down", b_down, x, (k,))
    budget = resolve_num_sms(num_sms, x.device)
    out = torch.empty((m, k), device=x.device, dtype=x.dtype)
    if m == 0 or k == 0:
        return out
    x, w_gate_up, w_down = k_contiguous(x), k_contiguous(w_gate_up), k_contiguous(w_down)
    b_gate_up = k_contiguous(b_gate_up) if b_gate_up is not None else None
    b_down = k_contiguous(b_down) if b_down is not None else None
    h = torch.empty((m, inter), device=x.device, dtype=x.dtype)
    if inter > 0:
        gate_up_into(x, w_gate_up, b_gate_up, h, budget)
    linear_into(h, w_down, b_down, out, 0, budget, "gated_mlp.down")
    return out


def ref_gated_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Reference in max(x.dtype, fp32) (pass fp64 tensors for an fp64 reference); x.dtype out."""
    ct = torch.promote_types(x.dtype, torch.float32)
    gu = x.to(ct) @ w_gate_up.to(ct).T
    if b_gate_up is not None:
        gu = gu + b_gate_up.to(ct)
    gate, up = gu.chunk(2, dim=-1)
    y = (F.silu(gate) * up) @ w_down.to(ct).T
    if b_down is not None:
        y = y + b_down.to(ct)
    return y.to(x.dtype)


def compile_specs(full: bool = False) -> list[CompileSpec]:
    """GPU configurations of the gate-up kernel (bf16, fp16; each shape class, both split paths,
    with and without bias) and of the gated split-K reduce. The down projection runs `linear`'s
    kernels, listed by `linear.compile_specs`. `full` is accepted for symmetry (this list is
    already the whole cross product)."""
    del full
    specs = []
    for dt in ("bf16", "fp16"):
        for cls, cfg in GPU_CONFIGS.items():
            for split in (False, True):
                for has_bias in (False,) if split else (True, False):  # split: bias in reduce
                    specs.append(CompileSpec(
                        f"gated_mlp.gate_up[{dt},{cls},split={split},bias={has_bias}]",
                        _gate_up_kernel, gemm_signature(dt, split),
                        block_meta(cfg) | dict(ALIGN=8, SPLIT=split, HAS_BIAS=has_bias,
                                               UPCAST=False),
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                        expect_wgmma=cfg["BLOCK_M"] >= 64))
        for has_bias in (True, False):
            specs.append(reduce_spec(dt, 0, True, has_bias))
    return specs
