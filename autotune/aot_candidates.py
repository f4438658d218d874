"""sm_90a compile specs of every GPU tuning candidate, for the ahead-of-time check:

    python -m spaceserve.kernels.aot --module autotune/aot_candidates.py

Each candidate of `autotune.cases.GPU_CANDIDATES` is applied to the bf16 compile spec its
launcher would use for the tuned shapes (Qwen2-VL: GEMM classes, ViT D=80 with and without the
fused rotary, paged attention at D=128, block 16, GQA 7), so a candidate that does not compile
or does not fit the H200's shared memory is caught without a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from autotune.cases import GPU_CANDIDATES
from spaceserve.kernels.persistent import CompileSpec


def _spec(module: str, name: str) -> CompileSpec:
    """The compile spec of `spaceserve.kernels.<module>` whose name starts with `name`."""
    specs = importlib.import_module(f"spaceserve.kernels.{module}").compile_specs()
    for s in specs:
        if s.name.startswith(name):
            return s
    raise LookupError(f"{module}: no compile spec named {name}...")


def _apply(base: CompileSpec, tag: str, cand: dict[str, Any],
           constexprs: dict[str, Any] | None = None) -> CompileSpec:
    const = dict(base.constexprs)
    const.update({k: v for k, v in cand.items() if k in const})
    const.update(constexprs or {})
    wgmma = base.expect_wgmma and const.get("BLOCK_M", 64) >= 64
    return dataclasses.replace(
        base, name=f"{tag} {sorted(cand.items())}", constexprs=const,
        num_warps=cand.get("num_warps", base.num_warps),
        num_stages=cand.get("num_stages", base.num_stages), expect_wgmma=wgmma)


BASES: dict[str, list[tuple[str, str]]] = {
    "linear": [("linear", "linear[bf16,large,split=False,align=8")],
    "linear_skinny": [("linear", "linear[bf16,small,split=True,align=8"),
                      ("linear", "linear[bf16,mid,split=True,align=8")],
    "gated_mlp": [("gated_mlp", "gated_mlp.gate_up[bf16,large,split=False")],
    "gated_mlp_skinny": [("gated_mlp", "gated_mlp.gate_up[bf16,small,split=True"),
                         ("gated_mlp", "gated_mlp.gate_up[bf16,mid,split=True")],
    "splitk_reduce": [("linear", "splitk_reduce[bf16,act=0,gated=False"),
                      ("gated_mlp", "splitk_reduce[bf16,act=0,gated=True")],
    "paged_decode": [("attention.paged", "paged_decode_bf16_d128_bs16_g7")],
    "paged_prefill": [("attention.paged", "paged_prefill_bf16_d128_bs16_g7")],
    "vit_attention": [("attention.vit", "vit_attention[bf16,d80,tiles]"),
                      ("attention.vit", "vit_attention[bf16,d80,tiles,rotary]")],
}


def compile_specs() -> list[CompileSpec]:
    """One spec per (kernel, candidate, launcher variant)."""
    out = []
    for kernel, bases in BASES.items():
        for module, prefix in bases:
            base = _spec(module, prefix)
            for i, cand in enumerate(GPU_CANDIDATES[kernel]):
                extra = None
                if kernel == "paged_prefill":  # query rows per tile = BLOCK_M / padded group
                    extra = {"BLOCK_Q": cand["BLOCK_M"] // base.constexprs["GROUP_PAD"]}
                out.append(_apply(base, f"{kernel}#{i} {base.name}", cand, extra))
    return out
