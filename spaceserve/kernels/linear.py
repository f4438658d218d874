"""Persistent GEMM `y = act(x @ weight.T + bias)` with a fixed split-K for skinny (decode) M.

One tile = a BLOCK_M x BLOCK_N block of the output and one K-slice of the reduction. Tiles are
visited in grouped order (L2 reuse of weight columns) by at most `num_sms` programs. When the
output has too few tiles to spread over the GPU (decode: M = batch, 3584 / 64 = 56 tiles), K is cut
into a split chosen from (M, N, K) alone; each split writes fp32 partials to a workspace
[SPLIT_K, M, N] and a second persistent pass sums them in split order, adds the bias, applies the
activation and casts. No atomics, so the result is bitwise identical for every budget.

Loads are pointer based (any row stride; Qwen2.5-VL's 6840-byte rows rule out TMA descriptors; an
operand strided along K is copied first). ALIGN tells the compiler the largest power-of-two
dividing K and the row strides, so such rows still get vectorized, pipelined loads. Accumulation
is fp32; fp32 inputs use exact (IEEE) dots, fp16/bf16 the tensor cores.

Configs come from `kernel_config("linear", ...)` (M > 64) or `kernel_config("linear_skinny", ...)`
(M <= 64) and `kernel_config("splitk_reduce", ...)`. A tuned table may change GROUP_M and
num_stages per budget; BLOCK_M, BLOCK_N and num_warps (which pick the tensor-core instructions)
only at the whole-device bucket; BLOCK_K and the split stay fixed by the shape, because they set
the reduction order.

The tile set-up, dots, activations, split and config policy and operand checks that `gated_mlp`
shares live in `gemm.py`; the split-K reduce, which serves both GEMMs, lives here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.gemm import (
    ACTIVATIONS,
    apply_activation,
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
    ref_activation,
    row_align,
    shape_class,
)
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

# GPU defaults (H200). Skinny M streams weights: narrow N tiles, deep K, more stages.
GPU_CONFIGS: dict[str, dict[str, Any]] = {
    "large": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "mid": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "small": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
}
# Interpreter defaults: small tiles so small test shapes still span several tiles.
CPU_CONFIGS: dict[str, dict[str, Any]] = {
    "large": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
    "mid": dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
    "small": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1),
}
REDUCE_CONFIG = {"cuda": dict(BLOCK=1024, num_warps=4), "cpu": dict(BLOCK=256, num_warps=4)}


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, ALIGN: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, UPCAST: tl.constexpr,
):
    K, k_per_split, stride_xm, stride_wn, num_m, num_n, num_tiles = gemm_grid(
        M, N, K, stride_xm, stride_wn, split_k, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K, ALIGN)
    rk = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        s, rm, rn, k_lo, k_hi, a_ptrs, b_ptrs = gemm_tile(
            tile, x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, k_per_split, num_m, num_n, rk,
            BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_ok = rk < k_hi - k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = mma(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT:
            ws = ws_ptr + (s * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(ws, acc, mask=mask)
        else:
            if HAS_BIAS:
                bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
                acc = acc + bias[None, :]
            acc = apply_activation(acc, ACT)
            o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, b_ptr, out_ptr,
    M, N, split_k,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
):
    """Sum the fp32 partials [split_k, M, W] in split order, then bias, activation and cast.

    GATED: W = 2N with gate columns [0, N) and up columns [N, 2N); out = silu(gate) * up.
    Otherwise W = N and out = act(sum). `out` is a contiguous [M, N]. Elements are independent,
    so any BLOCK gives the same bits.
    """
    total = M * N
    if GATED:
        width = 2 * N
    else:
        width = N
    plane = M * width
    num_tiles = tl.cdiv(total, BLOCK)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        idx = tile * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        m = (idx // N).to(tl.int64)
        n = idx % N
        src = ws_ptr + m * width + n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for _ in range(0, split_k):
            acc += tl.load(src, mask=ok, other=0.0)
            if GATED:
                up += tl.load(src + N, mask=ok, other=0.0)
            src += plane
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
            if GATED:
                up += tl.load(b_ptr + N + n, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            y = acc * tl.sigmoid(acc) * up
        else:
            y = apply_activation(acc, ACT)
        tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=ok)


def default_config(m: int, device: torch.device, gpu: dict[str, dict[str, Any]] = GPU_CONFIGS,
                   cpu: dict[str, dict[str, Any]] = CPU_CONFIGS) -> dict[str, Any]:
    """Default block config for `m` rows on `device` (GPU: H200 sizes; CPU: interpreter sizes)."""
    return dict((gpu if device.type == "cuda" else cpu)[shape_class(m)])


def splitk_reduce(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split_k: int,
                  act: int, gated: bool, num_sms: int, name: str) -> None:
    """Second pass of a split-K GEMM: fixed-order sum of `ws` into `out` (see the kernel)."""
    m, n = out.shape
    cfg = dict(kernel_config("splitk_reduce", num_sms,
                             REDUCE_CONFIG["cuda" if out.is_cuda else "cpu"]))
    tiles = triton.cdiv(m * n, cfg["BLOCK"])
    launch_persistent(
        _splitk_reduce_kernel, name, tiles, num_sms,
        (ws, bias if bias is not None else out, out, m, n, split_k),
        config=cfg, HAS_BIAS=bias is not None, ACT=act, GATED=gated,
    )


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor, act: int, num_sms: int, name: str) -> None:
    """Launch the GEMM (and its split-K reduce) into a contiguous `out` [M, N]; operands are
    validated and K-contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    default = default_config(m, x.device)
    cfg = gemm_config("linear", m, num_sms, default, x.device)
    split = choose_split_k(m, n, k, default, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split) * cfg["BLOCK_K"]
    ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * split
    launch_persistent(
        _linear_kernel, name, tiles, num_sms,
        (x, weight, bias if bias is not None else weight, out, ws, m, n, k,
         x.stride(0), weight.stride(0), out.stride(0), split, k_per_split),
        config=cfg, ALIGN=row_align(k, x, weight), SPLIT=split > 1,
        HAS_BIAS=bias is not None and split == 1, ACT=act if split == 1 else 0,
        UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda,
    )
    if split > 1:
        splitk_reduce(ws, bias, out, split, act, False, num_sms, f"{name}.reduce")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None, num_sms: int | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias): x [M, K], weight [N, K] (torch Linear layout) -> [M, N] in
    x.dtype, under a budget of `num_sms` SMs (None = whole device)."""
    check_input(x)
    m, k = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor [N, K]")
    n = weight.shape[0]
    check_operand("weight", weight, x, (n, k))
    if bias is not None:
        check_operand("bias", bias, x, (n,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {list(ACTIVATIONS)}")
    budget = resolve_num_sms(num_sms, x.device)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    x, weight = k_contiguous(x), k_contiguous(weight)
    bias = k_contiguous(bias) if bias is not None else None
    linear_into(x, weight, bias, out, ACTIVATIONS[activation], budget, "linear")
    return out


def ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
    """Reference in max(x.dtype, fp32) (pass fp64 tensors for an fp64 reference); x.dtype out."""
    ct = torch.promote_types(x.dtype, torch.float32)
    y = x.to(ct) @ weight.to(ct).T
    if bias is not None:
        y = y + bias.to(ct)
    return ref_activation(y, activation).to(x.dtype)


def epilogue_combos(full: bool, index: int, acts: list[int]) -> list[tuple[int, bool]]:
    """(ACT, HAS_BIAS) pairs for the `index`-th unsplit GEMM variant: all pairs when `full`;
    else every activation for the first variant, one pair in rotation for the others."""
    if full:
        return [(a, b) for a in acts for b in (True, False)]
    if index == 0:
        return [(a, a % 2 == 0) for a in acts]
    return [(acts[index % len(acts)], index % 2 == 1)]


def reduce_spec(dt: str, act: int, gated: bool, has_bias: bool) -> CompileSpec:
    """Compile spec of the split-K reduce writing `dt`."""
    cfg = REDUCE_CONFIG["cuda"]
    sig = {"ws_ptr": "*fp32", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}", "M": "i32", "N": "i32",
           "split_k": "i32"}
    return CompileSpec(
        f"splitk_reduce[{dt},act={act},gated={gated},bias={has_bias}]", _splitk_reduce_kernel,
        sig, dict(BLOCK=cfg["BLOCK"], HAS_BIAS=has_bias, ACT=act, GATED=gated),
        num_warps=cfg["num_warps"], num_stages=1)


def gemm_variants() -> list[tuple[str, bool, int]]:
    """(shape class, split, ALIGN) of every GEMM compile spec: each class with and without a
    split at 16-byte rows, plus 8-byte rows (Qwen2.5-VL's I=3420 down projection) for large M."""
    variants = [(cls, split, 8) for cls in GPU_CONFIGS for split in (False, True)]
    return variants + [("large", False, 4), ("large", True, 4)]


def compile_specs(full: bool = False) -> list[CompileSpec]:
    """GPU configurations of `linear`'s kernels: bf16 and fp16, each shape class, both split
    paths, and the reduce. By default the epilogue (activation, bias) rotates so that each dtype
    compiles every activation and both bias paths; `full=True` gives the whole cross product."""
    specs = []
    acts = sorted(set(ACTIVATIONS.values()))
    for dt in ("bf16", "fp16"):
        unsplit = 0
        for cls, split, align in gemm_variants():
            cfg = GPU_CONFIGS[cls]
            # With a split the epilogue runs in the reduce: the GEMM has none.
            combos = [(0, False)] if split else epilogue_combos(full, unsplit, acts)
            unsplit += not split
            for act, has_bias in combos:
                specs.append(CompileSpec(
                    f"linear[{dt},{cls},split={split},align={align},act={act},bias={has_bias}]",
                    _linear_kernel, gemm_signature(dt, split),
                    block_meta(cfg) | dict(ALIGN=align, SPLIT=split, HAS_BIAS=has_bias, ACT=act,
                                           UPCAST=False),
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                    expect_wgmma=cfg["BLOCK_M"] >= 64))
        for act in acts:
            for has_bias in (True, False) if full or act == 0 else (act % 2 == 1,):
                specs.append(reduce_spec(dt, act, False, has_bias))
    return specs
