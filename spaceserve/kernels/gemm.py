"""What the persistent GEMMs (`linear`, `gated_mlp`) share: tile set-up, dots, epilogue
activations, the split-K and config policy, and operand checks.

Device side: `gemm_grid` rounds the sizes a split-K GEMM walks (so the compiler sees ALIGN-aligned
rows), `gemm_tile` places one tile (its split, grouped output block, K range and first pointers),
`mma` accumulates in fp32 (IEEE for fp32 inputs, tensor cores otherwise) and `apply_activation`
is the fused epilogue, with `ref_activation` its torch reference. Host side: which shape class
and split-K a GEMM of a given shape takes (never the budget: results are bitwise identical for
every budget), which tuned config applies, and the argument checks both launchers run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spaceserve.kernels.budget import device_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import grouped_tile

ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "silu": 4}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SKINNY_M = 64

# Split-K policy (target tiles, min K blocks per split, max split): shape and device type only.
# 264 = two tiles per SM of a whole H200; on CPU a small target exercises both paths cheaply.
SPLIT_POLICY = {"cuda": (264, 4, 16), "cpu": (8, 1, 16)}


@triton.jit
def apply_activation(y, ACT: tl.constexpr):
    """Epilogue activation on an fp32 tile (codes in `ACTIVATIONS`)."""
    if ACT == 1:  # gelu (erf)
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == 2:  # gelu_tanh: 0.5 * (1 + tanh(z)) == sigmoid(2z)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    elif ACT == 3:  # quick_gelu
        y = y * tl.sigmoid(1.702 * y)
    elif ACT == 4:  # silu
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc += a @ b in fp32: IEEE for fp32 inputs, tensor cores for fp16/bf16.

    UPCAST (interpreter only) runs bf16 dots in fp32, which is exact and avoids its bf16 bug.
    """
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gemm_grid(M, N, K, stride_xm, stride_wn, split_k, k_per_split, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """(K, k_per_split, stride_xm, stride_wn, num_m, num_n, num_tiles) of a split-K GEMM.

    K and the row strides are multiples of ALIGN elements (the launcher checks) and k_per_split
    of BLOCK_K; rounding them says so, which lets the compiler vectorize and pipeline loads of
    rows that are not 16-byte multiples. num_tiles counts output tiles times splits.
    """
    K = K // ALIGN * ALIGN
    k_per_split = k_per_split // BLOCK_K * BLOCK_K
    stride_xm = stride_xm // ALIGN * ALIGN
    stride_wn = stride_wn // ALIGN * ALIGN
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    return K, k_per_split, stride_xm, stride_wn, num_m, num_n, num_m * num_n * split_k


@triton.jit
def gemm_tile(tile, x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, k_per_split, num_m, num_n, rk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(s, rm, rn, k_lo, k_hi, a_ptrs, b_ptrs) of GEMM tile `tile`: its split, output rows and
    columns (grouped order), K range, and pointers to the first K-slice of x [BLOCK_M, BLOCK_K]
    and of w^T [BLOCK_K, BLOCK_N] (`rk` = arange(BLOCK_K))."""
    num_mn = num_m * num_n
    s = tile // num_mn
    pid_m, pid_n = grouped_tile(tile % num_mn, num_m, num_n, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge re-read valid ones (wrap) and are never stored.
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    k_lo = s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    a_ptrs = x_ptr + am[:, None] * stride_xm + (k_lo + rk)[None, :]
    b_ptrs = w_ptr + bn[None, :] * stride_wn + (k_lo + rk)[:, None]
    return s, rm, rn, k_lo, k_hi, a_ptrs, b_ptrs


def ref_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Torch reference of the fused activations."""
    if activation is None:
        return y
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation == "quick_gelu":
        return y * torch.sigmoid(1.702 * y)
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"activation={activation!r} is not one of {list(ACTIVATIONS)}")


def shape_class(m: int) -> str:
    """Config class of a GEMM with `m` rows: "small" (M <= 16), "mid" (M <= 64), "large"."""
    return "small" if m <= 16 else "mid" if m <= SKINNY_M else "large"


def choose_split_k(m: int, n: int, k: int, cfg: dict[str, Any], device: torch.device) -> int:
    """Fixed split of K for an M x N x K GEMM: from the shape (and device type) only, never the
    budget, so every budget reduces in the same order. Only skinny M (<= 64) is split: for larger
    M the workspace traffic would cost about what the idle SMs do."""
    if m > SKINNY_M:
        return 1
    target, min_blocks, max_split = SPLIT_POLICY["cuda" if device.type == "cuda" else "cpu"]
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    k_blocks = triton.cdiv(k, cfg["BLOCK_K"])
    split = min(triton.cdiv(target, tiles), k_blocks // min_blocks, max_split)
    if split <= 1:
        return 1
    per_split = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, per_split)  # no empty splits


def gemm_config(kind: str, m: int, num_sms: int, default: dict[str, Any],
                device: torch.device) -> dict[str, Any]:
    """Tuned config of kernel `kind` ("linear" or "gated_mlp"; "<kind>_skinny" for M <= 64).

    The tile shape and warps decide which tensor-core instructions compute each output, so they
    come from the whole-device bucket (identical bits under every budget); only the tile order
    (GROUP_M) and the pipelining depth follow `num_sms`. BLOCK_K is always the default's: the
    reduction order is fixed by the shape.
    """
    name = kind if m > SKINNY_M else f"{kind}_skinny"
    cfg = dict(kernel_config(name, device_num_sms(device), default))
    per_budget = kernel_config(name, num_sms, default)
    for key in ("GROUP_M", "num_stages"):
        if key in per_budget:
            cfg[key] = per_budget[key]
    cfg["BLOCK_K"] = default["BLOCK_K"]
    return cfg


def check_operand(name: str, t: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, ...]
                  ) -> None:
    """Raise ValueError unless `t` is a tensor of `shape` with x's dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != x.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x is on {x.device}")


def k_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its last dim (the kernels' K / bias axis); copies otherwise."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def row_align(k: int, *ts: torch.Tensor) -> int:
    """Largest power-of-two element count (up to 16 bytes) dividing `k` and every row stride of
    `ts`: the kernels' ALIGN."""
    align = 16 // ts[0].element_size()
    while align > 1 and (k % align or any(t.stride(0) % align for t in ts)):
        align //= 2
    return align


def check_input(x: torch.Tensor) -> None:
    """Raise ValueError unless `x` is a 2-D fp32/fp16/bf16 tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [M, K]")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of fp32, fp16, bf16")


def gemm_signature(dt: str, split: bool) -> dict[str, str]:
    """Signature shared by the linear and gate-up GEMM kernels (`dt`: "bf16", "fp16", ...).

    Without a split the workspace argument is the output itself (never read or written)."""
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}",
           "ws_ptr": "*fp32" if split else f"*{dt}"}
    return sig | {a: "i32" for a in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                     "split_k", "k_per_split")}


def block_meta(cfg: dict[str, Any]) -> dict[str, Any]:
    """The constexpr part of a config (all but num_warps, num_stages)."""
    return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
