"""Paged KV attention: the public surface and the ahead-of-time compile specs.

- `store_kv` (kv_cache.py): scatter new K/V tokens into the paged cache.
- `paged_decode_attention`, `DecodePlan` (paged_decode.py): persistent split-KV decode with GQA
  packing and a log-sum-exp merge pass.
- `paged_prefill_attention`, `PrefillPlan` (paged_prefill.py): causal prefill of the newest tokens
  of each sequence, exact under chunked prefill.
- work lists and argument checks (paged_plan.py).

`compile_specs()` lists every kernel configuration a GPU launch can pick, for the sm_90
ahead-of-time compile check.
"""

from __future__ import annotations

from spaceserve.kernels.attention.kv_cache import (
    STORE_DEFAULT,
    _store_kv_kernel,
    ref_store_kv,
    store_kv,
)
from spaceserve.kernels.attention.paged_decode import (
    DECODE_CHUNK,
    DECODE_DEFAULT,
    MERGE_DEFAULT,
    DecodePlan,
    _paged_decode_kernel,
    _paged_merge_kernel,
    paged_decode_attention,
    ref_paged_decode_attention,
)
from spaceserve.kernels.attention.paged_plan import next_pow2
from spaceserve.kernels.attention.paged_prefill import (
    PREFILL_DEFAULT,
    PrefillPlan,
    _paged_prefill_kernel,
    paged_prefill_attention,
    prefill_default,
    ref_paged_prefill_attention,
)
from spaceserve.kernels.persistent import CompileSpec

__all__ = [
    "DecodePlan",
    "PrefillPlan",
    "compile_specs",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_store_kv",
    "store_kv",
]

_TYPES = {"bf16": "*bf16", "fp16": "*fp16"}
# Strides of q, out and the caches are multiples of 16 elements for D in {64, 128}; the JIT then
# specializes them as divisible by 16, which is what lets the K/V gathers become async copies.
# "i32:16" gives the ahead-of-time compile the same hint. Block-table strides get none.
S16 = "i32:16"


def _shapes() -> list[tuple[str, int, int, int]]:
    """(dtype, head_dim, block_size, GQA group): the full grid at group 7, other groups at one."""
    grid = [(dt, d, bs, 7) for dt in ("bf16", "fp16") for d in (64, 128) for bs in (16, 32)]
    return grid + [("bf16", 128, 16, g) for g in (1, 4, 8)]


def _decode_specs(dt: str, d: int, bs: int, g: int) -> list[CompileSpec]:
    p, i = _TYPES[dt], "i32"
    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "bt_ptr": "*i32", "lens_ptr": "*i32",
           "work_ptr": "*i32", "out_ptr": p, "po_ptr": "*fp32", "plse_ptr": "*fp32",
           "num_tiles": i, "scale": "fp32", "max_chunks": i, "num_q_heads": i}
    sig.update({n: S16 for n in ("sq_b", "sq_h", "sk_b", "sk_o", "sk_h", "sv_b", "sv_o", "sv_h")})
    sig.update({"sbt": i, "so_b": S16, "so_h": S16})
    tag = f"{dt}_d{d}_bs{bs}_g{g}"
    dec = CompileSpec(
        f"paged_decode_{tag}", _paged_decode_kernel, sig,
        dict(GROUP=g, GROUP_PAD=max(16, next_pow2(g)), HEAD_DIM=d, D_PAD=max(16, next_pow2(d)),
             PAGE=bs, BLOCK_N=DECODE_DEFAULT["BLOCK_N"], CHUNK=DECODE_CHUNK, PRECISION="tf32"),
        num_warps=DECODE_DEFAULT["num_warps"], num_stages=DECODE_DEFAULT["num_stages"])
    msig = {"lens_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": p,
            "num_tiles": i, "num_kv_heads": i, "max_chunks": i, "num_q_heads": i,
            "so_b": S16, "so_h": S16}
    merge = CompileSpec(
        f"paged_decode_merge_{dt}_d{d}_g{g}", _paged_merge_kernel, msig,
        dict(GROUP=g, GROUP_PAD=next_pow2(g), HEAD_DIM=d, D_PAD=next_pow2(d), CHUNK=DECODE_CHUNK),
        num_warps=MERGE_DEFAULT["num_warps"], num_stages=MERGE_DEFAULT["num_stages"])
    return [dec] if bs != 16 else [dec, merge]


def _prefill_spec(dt: str, d: int, bs: int, g: int) -> CompileSpec:
    p, i = _TYPES[dt], "i32"
    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "bt_ptr": "*i32", "cu_ptr": "*i32",
           "lens_ptr": "*i32", "work_ptr": "*i32", "out_ptr": p, "num_tiles": i, "scale": "fp32"}
    sig.update({n: S16 for n in ("sq_t", "sq_h", "sk_b", "sk_o", "sk_h", "sv_b", "sv_o", "sv_h")})
    sig.update({"sbt": i, "so_t": S16, "so_h": S16})
    gpad = next_pow2(g)
    block_q = PREFILL_DEFAULT["BLOCK_M"] // gpad
    return CompileSpec(
        f"paged_prefill_{dt}_d{d}_bs{bs}_g{g}", _paged_prefill_kernel, sig,
        dict(GROUP=g, GROUP_PAD=gpad, HEAD_DIM=d, D_PAD=max(16, next_pow2(d)), PAGE=bs,
             BLOCK_Q=block_q, BLOCK_N=PREFILL_DEFAULT["BLOCK_N"], PRECISION="tf32"),
        num_warps=prefill_default(d)["num_warps"], num_stages=PREFILL_DEFAULT["num_stages"],
        expect_wgmma=True)


def _store_spec(dt: str, d: int, bs: int, hkv: int, slot: str) -> CompileSpec:
    p, i = _TYPES[dt], "i32"
    sig = {"k_ptr": p, "v_ptr": p, "kc_ptr": p, "vc_ptr": p, "slot_ptr": slot,
           "num_tiles": i, "num_tokens": i, "num_slots": i, "num_hd_tiles": i}
    sig.update({n: S16 for n in ("sk_t", "sk_h", "sv_t", "sv_h", "skc_b", "skc_o", "skc_h",
                                 "svc_b", "svc_o", "svc_h")})
    elems = STORE_DEFAULT["BLOCK_ELEMS"]
    block_hd = min(next_pow2(hkv * d), elems)
    return CompileSpec(
        f"store_kv_{dt}_d{d}_bs{bs}_h{hkv}_{slot[1:]}", _store_kv_kernel, sig,
        dict(HEAD_DIM=d, HD=hkv * d, PAGE=bs, BLOCK_T=max(1, elems // block_hd),
             BLOCK_HD=block_hd),
        num_warps=STORE_DEFAULT["num_warps"], num_stages=STORE_DEFAULT["num_stages"])


def compile_specs() -> list[CompileSpec]:
    """Every paged-attention kernel configuration a GPU launch with default configs can pick."""
    specs: list[CompileSpec] = []
    for dt, d, bs, g in _shapes():
        specs += _decode_specs(dt, d, bs, g)
        specs.append(_prefill_spec(dt, d, bs, g))
    for dt in ("bf16", "fp16"):
        for d in (64, 128):
            for slot in ("*i32", "*i64"):
                specs.append(_store_spec(dt, d, 16, 4, slot))
    return specs
