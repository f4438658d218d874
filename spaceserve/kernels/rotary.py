"""Rotary position embeddings for Qwen2-VL: cos/sin tables and a persistent apply kernel.

All three flavours reduce to per-token cos/sin rows of width D (the head dim), laid out for the
rotate-half convention (`x * cos + rotate_half(x) * sin`, rotate_half(x) = [-x2, x1]):

- `rope_cos_sin`: 1D RoPE, as Qwen2's LM rotary embedding.
- `mrope_cos_sin`: Qwen2-VL's multimodal RoPE; frequency section i takes its positions from
  axis i (temporal, height, width), as transformers' M-RoPE recomposition does.
- `vision_rotary_cos_sin`: the vision tower's 2D RoPE; the first half of the frequencies rotate
  by row, the second by column, with patches in the 2x2 spatial-merge order.

The table builders are plain torch on the positions' device, with no host sync (the inverse
frequencies are computed once per (dim, theta, device), on the CPU like transformers, and
cached). `apply_rotary` rotates q and k **in place** in fp32 and casts back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spaceserve.checks import require_int, require_number
from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

MAX_HEAD_DIM = 256
TILE_ELEMS = 2048  # target elements per half block (BLOCK_T * BLOCK_H * BLOCK_HALF)
MAX_BLOCK_H = 16

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_INV_FREQ: dict[tuple[int, float, str], torch.Tensor] = {}


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """1 / theta^(2i / dim) for i < dim/2 in fp32, computed on the CPU as transformers does."""
    device = torch.device(device if device is not None else "cpu")
    key = (dim, float(theta), str(device))
    cached = _INV_FREQ.get(key)
    if cached is None:
        freqs = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        cached = _INV_FREQ[key] = freqs.to(device)
    return cached


def _check_table_args(head_dim: int, theta: float, multiple: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 \
            or head_dim % multiple:
        raise ValueError(f"head_dim must be a positive multiple of {multiple}, got {head_dim!r}")
    require_number("theta", theta)


def _check_positions(name: str, positions: torch.Tensor) -> None:
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() \
            or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got "
                         f"{getattr(positions, 'dtype', type(positions).__name__)}")


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, *,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """1D RoPE tables: positions [...] (integer) -> cos, sin [..., head_dim]."""
    _check_table_args(head_dim, theta, 2)
    _check_positions("positions", positions)
    freqs = positions[..., None].float() * inv_freq(head_dim, theta, positions.device)
    return _cos_sin(freqs, dtype)


def mrope_cos_sin(positions_3d: torch.Tensor, head_dim: int, theta: float,
                  mrope_section: Sequence[int], *,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL M-RoPE tables: positions_3d [3, ...] (t, h, w ids) -> cos, sin [..., head_dim].

    Frequency i belongs to section j (sections of `mrope_section`, summing to head_dim / 2) and
    takes its position from axis j; text tokens have three equal ids, which gives 1D RoPE.
    """
    _check_table_args(head_dim, theta, 2)
    _check_positions("positions_3d", positions_3d)
    if positions_3d.dim() < 1 or positions_3d.shape[0] != 3:
        raise ValueError(f"positions_3d must have shape [3, ...], got {tuple(positions_3d.shape)}")
    section = [int(s) for s in mrope_section]
    if len(section) != 3 or min(section) < 0 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section must be 3 sizes summing to head_dim / 2 = "
                         f"{head_dim // 2}, got {list(mrope_section)}")
    freqs = positions_3d[..., None].float() * inv_freq(head_dim, theta, positions_3d.device)
    freqs = torch.cat([part[i] for i, part in enumerate(freqs.split(section, dim=-1))], dim=-1)
    return _cos_sin(freqs, dtype)


def vision_position_ids(grid_thw: torch.Tensor | Sequence[Sequence[int]],
                        spatial_merge_size: int = 2,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """(row, column) of every patch, [N, 2] int64, in the vision tower's patch order.

    Each image is t frames of h x w patches; within a frame the patches come in spatial-merge
    blocks (row-major over blocks, row-major inside a block). `grid_thw` is host metadata: a
    list of (t, h, w) or a CPU tensor [num_images, 3].
    """
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.device.type != "cpu":
            raise ValueError("grid_thw must be host metadata (a list or a CPU tensor); reading "
                             f"a {grid_thw.device.type} tensor would sync the host")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [num_images, 3], got "
                             f"{tuple(grid_thw.shape)}")
        grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    else:
        grid = [tuple(int(v) for v in row) for row in grid_thw]
        if any(len(row) != 3 for row in grid):
            raise ValueError(f"grid_thw must hold (t, h, w) triples, got {grid_thw!r}")
    m = spatial_merge_size
    require_int("spatial_merge_size", m)
    parts = []
    for t, h, w in grid:
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(f"grid_thw entry {(t, h, w)} must be positive with h and w "
                             f"multiples of spatial_merge_size={m}")
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        ids = torch.stack((rows, cols), dim=-1)  # [h, w, 2]
        ids = ids.reshape(h // m, m, w // m, m, 2).permute(0, 2, 1, 3, 4).reshape(h * w, 2)
        parts.append(ids.repeat(t, 1))
    if not parts:
        return torch.empty((0, 2), dtype=torch.int64, device=device)
    return torch.cat(parts, dim=0)


def vision_rotary_cos_sin(grid_thw: torch.Tensor | Sequence[Sequence[int]], head_dim: int,
                          theta: float = 10000.0, spatial_merge_size: int = 2, *,
                          device: torch.device | str | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL vision 2D RoPE tables, cos, sin [N, head_dim] fp32, N = sum of t*h*w.

    The head dim is split in quarters of frequencies 1/theta^(4i/head_dim): row frequencies,
    column frequencies, then the same two again (rotate-half layout).
    """
    _check_table_args(head_dim, theta, 4)
    ids = vision_position_ids(grid_thw, spatial_merge_size, device)
    freqs = ids[..., None].float() * inv_freq(head_dim // 2, theta, ids.device)  # [N, 2, D/4]
    return _cos_sin(freqs.flatten(1), torch.float32)


# ---------------------------------------------------------------------------------------------
# Apply
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rotate_heads(x_ptr, H, stride_t, stride_h, t64, t_mask, d, d_mask, c_lo, c_hi, s_lo, s_hi,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate heads [0, H) of BLOCK_T tokens in place: lo' = lo*c - hi*s, hi' = hi*c + lo*s."""
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ptr = x_ptr + t64[:, None, None] * stride_t + h[None, :, None] * stride_h \
            + d[None, None, :]
        mask = t_mask[:, None, None] & (h < H)[None, :, None] & d_mask[None, None, :]
        lo = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        new_lo = lo * c_lo[:, None, :] - hi * s_lo[:, None, :]
        new_hi = hi * c_hi[:, None, :] + lo * s_hi[:, None, :]
        tl.store(ptr, new_lo.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + HALF, new_hi.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, T, HQ, HK,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """Tiles are blocks of BLOCK_T tokens; each rotates all q heads then all k heads."""
    num_tiles = tl.cdiv(T, BLOCK_T)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = t < T
        t64 = t.to(tl.int64)
        cs_mask = t_mask[:, None] & d_mask[None, :]
        c_ptr = cos_ptr + t64[:, None] * stride_ct + d[None, :]
        s_ptr = sin_ptr + t64[:, None] * stride_st + d[None, :]
        c_lo = tl.load(c_ptr, mask=cs_mask, other=0.0)
        c_hi = tl.load(c_ptr + HALF, mask=cs_mask, other=0.0)
        s_lo = tl.load(s_ptr, mask=cs_mask, other=0.0)
        s_hi = tl.load(s_ptr + HALF, mask=cs_mask, other=0.0)
        _rotate_heads(q_ptr, HQ, stride_qt, stride_qh, t64, t_mask, d, d_mask,
                      c_lo, c_hi, s_lo, s_hi, HALF, BLOCK_H)
        _rotate_heads(k_ptr, HK, stride_kt, stride_kh, t64, t_mask, d, d_mask,
                      c_lo, c_hi, s_lo, s_hi, HALF, BLOCK_H)


def rotary_config(head_dim: int, num_heads: int) -> dict[str, int]:
    """Default block configuration for a head dim and the larger of the q / k head counts."""
    block_half = triton.next_power_of_2(max(head_dim // 2, 1))
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(max(num_heads, 1)))
    block_t = max(1, TILE_ELEMS // (block_half * block_h))
    num_warps = 8 if block_t * block_h * block_half >= TILE_ELEMS else 4  # ~60 regs at 8
    return {"BLOCK_HALF": block_half, "BLOCK_T": block_t, "BLOCK_H": block_h,
            "num_warps": num_warps, "num_stages": 1}


def _check_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [T, H, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: fp32, fp16, bf16")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dim (rotated in place)")
    T, _, D = q.shape
    if D % 2 or D > MAX_HEAD_DIM:
        raise ValueError(f"q head dim {D} must be even and <= {MAX_HEAD_DIM}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in T and D")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k is {k.dtype} on {k.device}; q is {q.dtype} on {q.device}")
    if q.numel() and k.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError("k must not alias q (both are rotated in place)")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, D):
            raise ValueError(f"{name} must have shape [{T}, {D}] (T and D of q), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
        if t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name} must be fp32 on {q.device}, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dim")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] **in place** by cos/sin [T, D] (fp32); returns them.

    Rotate-half convention, computed in fp32 and cast back to q's dtype (transformers'
    apply_rotary_pos_emb_vision). q and k may be strided views (e.g. of a fused qkv output) as
    long as their last dim is contiguous. Any even D <= 256, GQA head counts allowed.
    """
    _check_apply(q, k, cos, sin)
    budget = resolve_num_sms(num_sms, q.device)
    T, Hq, D = q.shape
    Hk = k.shape[1]
    if T == 0 or D == 0 or Hq + Hk == 0:
        return q, k
    cfg = kernel_config("rotary", budget, rotary_config(D, max(Hq, Hk)))
    launch_persistent(
        _rotary_kernel, "rotary", triton.cdiv(T, cfg["BLOCK_T"]), budget,
        (q, k, cos, sin, T, Hq, Hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
         cos.stride(0), sin.stride(0)),
        config=cfg, HALF=D // 2,
    )
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (out of place): x * cos + rotate_half(x) * sin in max(dtype, fp32), cast back."""
    out = []
    for x in (q, k):
        acc = torch.promote_types(x.dtype, torch.float32)
        c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
        xf = x.to(acc)
        out.append((xf * c + _rotate_half(xf) * s).to(x.dtype))
    return out[0], out[1]


def compile_specs() -> list[CompileSpec]:
    """Kernel configurations a GPU launch can pick, for the ahead-of-time sm_90 compile check."""
    specs = []
    # (label, D, max(Hq, Hk)): the Qwen2-VL vision tower (16 heads, D=80) and the 7B LM (28/4).
    for label, D, heads in (("vision", 80, 16), ("lm", 128, 28), ("d64", 64, 4)):
        cfg = rotary_config(D, heads)
        for dtype in (torch.bfloat16, torch.float16):
            t = "*" + _TRITON_TYPE[dtype]
            specs.append(CompileSpec(
                name=f"rotary_{_TRITON_TYPE[dtype]}_{label}_D{D}",
                kernel=_rotary_kernel,
                signature={"q_ptr": t, "k_ptr": t, "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                           "T": "i32", "HQ": "i32", "HK": "i32", "stride_qt": "i32",
                           "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32",
                           "stride_ct": "i32", "stride_st": "i32"},
                constexprs={"HALF": D // 2, **{k: cfg[k] for k in
                                               ("BLOCK_HALF", "BLOCK_T", "BLOCK_H")}},
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return specs
