"""RMSNorm (with vLLM's fused residual add) and LayerNorm as persistent Triton kernels.

A tile is a block of `BLOCK_M` rows. A row of up to `MAX_BLOCK_K` elements is held in one block
(one load, one reduction); a longer row is reduced in chunks of `CHUNK_K` in a fixed order and
then normalized in a second pass. Statistics are fp32 whatever the input dtype.

Results do not depend on the budget: every row is reduced by the same code in the same order
whichever program owns it. The block shape and warp count set that order (they decide how a row
is spread over threads), so they are read from the kernel-config table at the full-device bucket,
never at the launch's budget; only `num_stages` follows the budget.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spaceserve.checks import require_number
from spaceserve.kernels.budget import device_num_sms, resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

MAX_BLOCK_K = 8192  # longest row kept whole in one block
CHUNK_K = 4096  # chunk width for longer rows
TILE_ELEMS = 4096  # target elements per block (BLOCK_M * BLOCK_K) for short rows
MAX_BLOCK_M = 32

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Keys that decide each row's reduction order: looked up budget-independently.
_NUMERICS_KEYS = ("BLOCK_M", "num_warps")


@triton.jit
def _load_input(x_ptr, r_ptr, s_ptr, rows64, cols, mask, stride_x, stride_r, stride_s,
                HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] block of x (or of x + residual rounded to x's dtype) in fp32."""
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(s_ptr + rows64[:, None] * stride_s + cols[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, M, K,
                     stride_x, stride_r, stride_y, stride_s, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     SINGLE_PASS: tl.constexpr):
    """y = w * (v * rsqrt(mean(v^2) + eps)).to(dtype), v = x (+ residual, also stored to s)."""
    dtype = y_ptr.dtype.element_ty
    num_tiles = tl.cdiv(M, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        if SINGLE_PASS:
            cmask = cols0 < K
            mask = row_mask[:, None] & cmask[None, :]
            v = _load_input(x_ptr, r_ptr, s_ptr, rows64, cols0, mask, stride_x, stride_r,
                            stride_s, HAS_RESIDUAL, True)
            rstd = tl.math.rsqrt(tl.sum(v * v, axis=1) / K + eps)
            w = tl.load(w_ptr + cols0, mask=cmask, other=0.0).to(tl.float32)
            n = (v * rstd[:, None]).to(dtype).to(tl.float32)
            tl.store(y_ptr + rows64[:, None] * stride_y + cols0[None, :],
                     (n * w[None, :]).to(dtype), mask=mask)
        else:
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + cols0
                mask = row_mask[:, None] & (cols < K)[None, :]
                v = _load_input(x_ptr, r_ptr, s_ptr, rows64, cols, mask, stride_x, stride_r,
                                stride_s, HAS_RESIDUAL, True)
                acc += tl.sum(v * v, axis=1)
            rstd = tl.math.rsqrt(acc / K + eps)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + cols0
                cmask = cols < K
                mask = row_mask[:, None] & cmask[None, :]
                v = _load_input(x_ptr, r_ptr, s_ptr, rows64, cols, mask, stride_x, stride_r,
                                stride_s, HAS_RESIDUAL, False)
                w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                n = (v * rstd[:, None]).to(dtype).to(tl.float32)
                tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :],
                         (n * w[None, :]).to(dtype), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, stride_x, stride_y, eps,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       SINGLE_PASS: tl.constexpr):
    """y = (x - mean) * rsqrt(var + eps) * w + b with fp32 mean and biased variance."""
    dtype = y_ptr.dtype.element_ty
    num_tiles = tl.cdiv(M, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        if SINGLE_PASS:
            cmask = cols0 < K
            mask = row_mask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols0[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / K
            d = tl.where(mask, x - mean[:, None], 0.0)
            rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / K + eps)
            y = d * rstd[:, None] * tl.load(w_ptr + cols0, mask=cmask).to(tl.float32)[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + cols0, mask=cmask).to(tl.float32)[None, :]
            tl.store(y_ptr + rows64[:, None] * stride_y + cols0[None, :], y.to(dtype), mask=mask)
        else:
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + cols0
                mask = row_mask[:, None] & (cols < K)[None, :]
                x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                acc += tl.sum(x, axis=1)
            mean = acc / K
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + cols0
                mask = row_mask[:, None] & (cols < K)[None, :]
                x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                d = tl.where(mask, x - mean[:, None], 0.0)
                acc += tl.sum(d * d, axis=1)
            rstd = tl.math.rsqrt(acc / K + eps)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + cols0
                cmask = cols < K
                mask = row_mask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                y = (x - mean[:, None]) * rstd[:, None]
                y = y * tl.load(w_ptr + cols, mask=cmask).to(tl.float32)[None, :]
                if HAS_BIAS:
                    y += tl.load(b_ptr + cols, mask=cmask).to(tl.float32)[None, :]
                tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(dtype),
                         mask=mask)


def norm_config(K: int) -> dict[str, int | bool]:
    """Default block configuration for rows of length `K` (a function of the shape only)."""
    single = K <= MAX_BLOCK_K
    block_k = triton.next_power_of_2(max(K, 1)) if single else CHUNK_K
    block_m = max(1, min(MAX_BLOCK_M, TILE_ELEMS // block_k)) if single else 1
    elems = block_m * block_k
    num_warps = 4 if elems <= 2048 else 8 if elems <= 4096 else 16  # <= ~120 regs on sm_90
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "SINGLE_PASS": single,
            "num_warps": num_warps, "num_stages": 1}


def _launch_config(name: str, K: int, num_sms: int, device: torch.device) -> dict:
    """Shape default, numerics keys from the full-device bucket, `num_stages` per budget."""
    default = norm_config(K)
    full = kernel_config(name, device_num_sms(device), default)
    cfg = dict(default)
    cfg.update({k: full[k] for k in _NUMERICS_KEYS if k in full})
    cfg["num_stages"] = kernel_config(name, num_sms, default).get("num_stages", 1)
    return cfg


def _new_output(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Allocate an output (one place, so tests can hand out poisoned buffers)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_common(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got shape "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported: fp32, fp16, bf16")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must have shape [{x.shape[1]}] (K of x), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight is {weight.dtype} on {weight.device}; x is {x.dtype} on "
                         f"{x.device}")
    require_number("eps", eps, zero_ok=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None,
             num_sms: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Qwen2 RMSNorm of x [M, K]; with `residual`, returns `(rms_norm(x + residual), x + residual)`.

    Matches transformers' Qwen2RMSNorm cast order: statistics in fp32, the normalized row cast to
    the input dtype, then multiplied by `weight`. The residual sum is rounded to the input dtype
    before it is normalized, as the unfused model adds in its own dtype.
    """
    _check_common(x, weight, eps)
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got "
                             f"{tuple(getattr(residual, 'shape', ())) or residual!r}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual is {residual.dtype} on {residual.device}; x is "
                             f"{x.dtype} on {x.device}")
    budget = resolve_num_sms(num_sms, x.device)
    M, K = x.shape
    y = _new_output((M, K), x)
    s = _new_output((M, K), x) if residual is not None else None
    if M == 0 or K == 0:
        return (y, s) if s is not None else y
    x = _row_major(x)
    weight = weight.contiguous()
    r = _row_major(residual) if residual is not None else x
    s_buf = s if s is not None else y
    cfg = _launch_config("rms_norm", K, budget, x.device)
    launch_persistent(
        _rms_norm_kernel, "rms_norm", triton.cdiv(M, cfg["BLOCK_M"]), budget,
        (x, r, weight, y, s_buf, M, K, x.stride(0), r.stride(0), y.stride(0), s_buf.stride(0),
         float(eps)),
        config=cfg, HAS_RESIDUAL=residual is not None,
    )
    return (y, s) if s is not None else y


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *,
               num_sms: int | None = None) -> torch.Tensor:
    """torch LayerNorm over the last dim of x [M, K] with fp32 statistics; `bias` may be None."""
    _check_common(x, weight, eps)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != weight.shape:
            raise ValueError(f"bias must have shape [{x.shape[1]}] (K of x), got "
                             f"{tuple(getattr(bias, 'shape', ())) or bias!r}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias is {bias.dtype} on {bias.device}; x is {x.dtype} on "
                             f"{x.device}")
    budget = resolve_num_sms(num_sms, x.device)
    M, K = x.shape
    y = _new_output((M, K), x)
    if M == 0 or K == 0:
        return y
    x = _row_major(x)
    weight = weight.contiguous()
    b = bias.contiguous() if bias is not None else weight
    cfg = _launch_config("layer_norm", K, budget, x.device)
    launch_persistent(
        _layer_norm_kernel, "layer_norm", triton.cdiv(M, cfg["BLOCK_M"]), budget,
        (x, weight, b, y, M, K, x.stride(0), y.stride(0), float(eps)),
        config=cfg, HAS_BIAS=bias is not None,
    )
    return y


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference RMSNorm: Qwen2RMSNorm's math in max(dtype, fp32); fp64 inputs stay fp64."""
    dtype = x.dtype
    acc = torch.promote_types(dtype, torch.float32)
    s = (x.to(acc) + residual.to(acc)).to(dtype) if residual is not None else x
    v = s.to(acc)
    n = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = (weight.to(acc) * n.to(acc)).to(dtype)
    return (y, s) if residual is not None else y


def ref_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """Reference LayerNorm in max(dtype, fp32) with biased variance; fp64 inputs stay fp64."""
    acc = torch.promote_types(x.dtype, torch.float32)
    v = x.to(acc)
    mean = v.mean(-1, keepdim=True)
    var = (v - mean).pow(2).mean(-1, keepdim=True)
    y = (v - mean) * torch.rsqrt(var + eps) * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def compile_specs() -> list[CompileSpec]:
    """Kernel configurations a GPU launch can pick, for the ahead-of-time sm_90 compile check."""
    specs = []
    for dtype in (torch.bfloat16, torch.float16):
        t = "*" + _TRITON_TYPE[dtype]
        for K in (1280, 3584, 8192, 16384):
            cfg = norm_config(K)
            blocks = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_K", "SINGLE_PASS")}
            for has_res in (False, True):
                specs.append(CompileSpec(
                    name=f"rms_norm_{_TRITON_TYPE[dtype]}_K{K}{'_res' if has_res else ''}",
                    kernel=_rms_norm_kernel,
                    signature={"x_ptr": t, "r_ptr": t, "w_ptr": t, "y_ptr": t, "s_ptr": t,
                               "M": "i32", "K": "i32", "stride_x": "i32", "stride_r": "i32",
                               "stride_y": "i32", "stride_s": "i32", "eps": "fp32"},
                    constexprs={"HAS_RESIDUAL": has_res, **blocks},
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
            specs.append(CompileSpec(
                name=f"layer_norm_{_TRITON_TYPE[dtype]}_K{K}",
                kernel=_layer_norm_kernel,
                signature={"x_ptr": t, "w_ptr": t, "b_ptr": t, "y_ptr": t, "M": "i32",
                           "K": "i32", "stride_x": "i32", "stride_y": "i32", "eps": "fp32"},
                constexprs={"HAS_BIAS": True, **blocks},
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return specs
