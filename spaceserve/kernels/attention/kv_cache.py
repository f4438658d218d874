"""store_kv: scatter new K/V tokens into a layer's paged cache, persistently, in place.

The caches are [num_blocks, block_size, Hkv, D]; token t goes to slot ``slot_mapping[t]`` =
block * block_size + offset. A negative slot is skipped (padding tokens of a captured batch). A
tile is BLOCK_T tokens x BLOCK_HD elements of the flattened (Hkv, D) row; the grid depends only on
the token count, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spaceserve.kernels.attention.paged_plan import cdiv, check_caches, check_index, next_pow2
from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import launch_persistent

STORE_DEFAULT = {"BLOCK_ELEMS": 4096, "num_warps": 4, "num_stages": 1}


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    num_tiles, num_tokens, num_slots, num_hd_tiles,
    sk_t, sk_h, sv_t, sv_h, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
    HEAD_DIM: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    tt = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_HD)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        t = (tile // num_hd_tiles) * BLOCK_T + tt
        hd = (tile % num_hd_tiles) * BLOCK_HD + e
        h = hd // HEAD_DIM
        d = hd % HEAD_DIM
        t_ok = t < num_tokens
        slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        blk = slot // PAGE
        off = slot % PAGE
        m = ok[:, None] & (hd < HD)[None, :]
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64[:, None] * sk_t + (h * sk_h + d)[None, :], mask=m)
        v = tl.load(v_ptr + t64[:, None] * sv_t + (h * sv_h + d)[None, :], mask=m)
        kc = blk * skc_b + off * skc_o
        vc = blk * svc_b + off * svc_o
        tl.store(kc_ptr + kc[:, None] + (h * skc_h + d)[None, :], k, mask=m)
        tl.store(vc_ptr + vc[:, None] + (h * svc_h + d)[None, :], v, mask=m)


def _check_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    nb, bs, hkv, d = check_caches(k_cache, v_cache)
    if k.dim() != 3 or k.shape[1:] != (hkv, d):
        raise ValueError(f"k must be [T, {hkv}, {d}] to match k_cache, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {x.dtype} != cache dtype {k_cache.dtype}")
        if x.device != k_cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {k_cache.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    check_index(slot_mapping, "slot_mapping", (k.shape[0],), k.device,
                (torch.int32, torch.int64))
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        if int(slot_mapping.max()) >= nb * bs:
            raise ValueError(f"slot_mapping names slot {int(slot_mapping.max())} beyond the "
                             f"cache's {nb * bs} slots")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, num_sms: int | None = None) -> None:
    """Write k, v [T, Hkv, D] into the caches at `slot_mapping` (int32/int64 [T]; < 0 = skip).

    In place. Slots past the cache are skipped on the device and refused when the slots are on
    the CPU (checking them on a GPU would need a host sync).
    """
    _check_store(k, v, k_cache, v_cache, slot_mapping)
    budget = resolve_num_sms(num_sms, k.device)
    t = k.shape[0]
    if t == 0:
        return
    nb, bs, hkv, d = k_cache.shape
    cfg = dict(kernel_config("store_kv", budget, STORE_DEFAULT))
    elems = cfg.pop("BLOCK_ELEMS")
    block_hd = min(next_pow2(hkv * d), max(16, next_pow2(elems)))
    block_t = max(1, next_pow2(elems) // block_hd)
    hd_tiles = cdiv(hkv * d, block_hd)
    num_tiles = cdiv(t, block_t) * hd_tiles
    args = (k, v, k_cache, v_cache, slot_mapping, num_tiles, t, nb * bs, hd_tiles,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
            *v_cache.stride()[:3])
    launch_persistent(_store_kv_kernel, "store_kv", num_tiles, budget, args, config=cfg,
                      HEAD_DIM=d, HD=hkv * d, PAGE=bs, BLOCK_T=block_t, BLOCK_HD=block_hd)


def ref_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Torch reference of `store_kv` (in place)."""
    bs = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    k_cache[blk, off] = k[keep]
    v_cache[blk, off] = v[keep]
