"""Attention-backend cases: every registered backend (`spaceserve.models.attention.backends`)
on the same problems, through the backend interface the models use.

Three operations: ``vit`` (varlen bidirectional attention of a vision batch), ``paged_decode``
(a decode-only LM step over the paged cache) and ``paged_prefill`` (a chunked-prefill LM step).
The plan (`plan_vit`, `plan_step(..., backend=...)`) is made once, outside the timed call, as the
engine does. Only the triton backend takes the SM budget; the others are bounded by green-context
partitions where the suite runs them (see conftest.py). flash_attn's paged kernels need KV pages
of 256 tokens, so its paged cases use that block size (recorded in the dims).
"""

from __future__ import annotations

from .cases import (
    Case,
    Work,
    decode_cost,
    esize,
    paged_cache,
    prefill_cost,
    rand,
    vision_towers,
    vit_cost,
)
from .shapes import models, workload

OPS = ("vit", "paged_decode", "paged_prefill")


def backend_unavailable(name: str) -> str | None:
    """Why backend `name` cannot run here (None when it can); names the backend."""
    from spaceserve.models import BackendUnavailable, get_backend

    try:
        get_backend(name)
    except (BackendUnavailable, ValueError) as exc:
        return str(exc)
    return None


def registered_backends() -> list[str]:
    from spaceserve.models import known_backends

    return known_backends()


def _block_size(backend: str, default: int) -> int:
    return 256 if backend == "flash_attn" else default


def vit_case(backend: str, name: str, model: str, segments: tuple[int, ...], h: int, d: int
             ) -> Case:
    def build(dtype, device):
        from spaceserve.models import get_backend

        be = get_backend(backend)
        cu_host = [0]
        for n in segments:
            cu_host.append(cu_host[-1] + n)
        q, k, v = (rand(cu_host[-1], h, d, dtype=dtype, device=device) for _ in range(3))
        meta = be.plan_vit(cu_host, h, d, dtype, device)
        nbytes, flops = vit_cost(segments, h, d, esize(dtype))
        return Work(lambda s: be.vit_attention(q, k, v, meta, num_sms=s), nbytes, flops,
                    dict(segments=list(segments), H=h, D=d), f"{backend}.vit_attention",
                    budgeted=backend == "triton")

    return Case("vit", name, model, build, dict(T=sum(segments), H=h, D=d))


def step_case(backend: str, op: str, name: str, model: str, new: tuple[int, ...],
              total: tuple[int, ...], hq: int, hkv: int, d: int, bs: int) -> Case:
    """An LM step: `new` tokens per sequence atop `total - new` cached ones."""

    def build(dtype, device):
        from spaceserve.models import get_backend, plan_step

        be = get_backend(backend)
        be.bind_lm(hq, hkv, d)
        block = _block_size(backend, bs)
        kc, vc, tables = paged_cache(total, hkv, d, block, dtype, device)
        cached = [t - n for n, t in zip(new, total, strict=True)]
        ctx = plan_step(cached, list(new), tables, block_size=block, device=device, backend=be)
        q = rand(sum(new), hq, d, dtype=dtype, device=device)
        es = esize(dtype)
        if op == "paged_decode":
            nbytes, flops = decode_cost(total, hq, hkv, d, es)
        else:
            nbytes, flops = prefill_cost(new, total, hq, hkv, d, es)
        return Work(lambda s: be.paged_attention(q, kc, vc, ctx, num_sms=s), nbytes, flops,
                    dict(new=list(new), cached=list(total), Hq=hq, Hkv=hkv, D=d,
                         block_size=block), f"{backend}.paged_attention",
                    budgeted=backend == "triton")

    return Case(op, name, model, build, dict(T=sum(new)))


def backend_cases(profile: str, backend: str) -> dict[str, list[Case]]:
    """One backend's cases in `profile`, by operation."""
    dims = models(profile)
    wl = workload(profile)
    out: dict[str, list[Case]] = {op: [] for op in OPS}
    for prefix, vis in vision_towers(dims).items():
        segments = tuple(t * h * w for t, h, w in wl.grids(vis.patch_size))
        out["vit"].append(vit_case(backend, f"{prefix}vit",
                                   f"{vis.name.split('-vl-')[0]}-vl-vit", segments,
                                   vis.vision_heads, vis.vision_head_dim))
    batch = len(wl.decode_lens)
    for short, m in dims.items():
        geo = (m.heads, m.kv_heads, m.head_dim, wl.block_size)
        out["paged_decode"].append(step_case(
            backend, "paged_decode", f"{short}-b{batch}-ctx{sum(wl.decode_lens) // batch}", m.name,
            (1,) * batch, wl.decode_lens, *geo))
        out["paged_prefill"].append(step_case(
            backend, "paged_prefill", f"{short}-chunk{sum(wl.chunk_new)}", m.name, wl.chunk_new,
            wl.chunk_total, *geo))
    return out
