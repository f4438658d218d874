"""Kernel cases: for each kernel of `spaceserve.kernels`, the problems the suite times.

A `Case` builds its inputs once (`build(dtype, device) -> Work`); `Work.call(num_sms)` runs
the kernel under a budget. `Work.bytes` is the compulsory traffic (every input read once, every
output written once) and `Work.flops` the arithmetic of the maths (2 per multiply-add;
element-wise ops counted nominally), so GB/s and TFLOP/s are comparable across implementations.
Attention kernels run through their plan objects (`plan_vit_attention`, `DecodePlan`,
`PrefillPlan`), as the runtime calls them: the timed call only launches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .shapes import ModelDims, Workload, models, workload

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Work:
    """One benchmarked call and its cost model."""

    call: Callable[[int], Any]
    bytes: int
    flops: int
    dims: dict[str, Any]
    api: str
    budgeted: bool = True  # takes the SM budget (else only a green context bounds it)


@dataclass(frozen=True)
class Case:
    """A named problem of one kernel: `build(dtype, device)` makes its inputs and call."""

    kernel: str
    name: str
    model: str
    build: Callable[[torch.dtype, torch.device], Work]
    dims: dict[str, Any] = field(default_factory=dict)


def rand(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0
         ) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_cache(lens: tuple[int, ...], hkv: int, d: int, bs: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V caches whose pages are shuffled over the pool; per-sequence block lists."""
    need = [cdiv(n, bs) for n in lens]
    pool = sum(need) + 2
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(pool, generator=gen).tolist()
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos:pos + n])
        pos += n
    kc = rand(pool, bs, hkv, d, dtype=dtype, device=device)
    vc = rand(pool, bs, hkv, d, dtype=dtype, device=device)
    return kc, vc, tables


def table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max([len(t) for t in tables] + [1])
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)


def causal_pairs(new: tuple[int, ...], total: tuple[int, ...]) -> int:
    """(query, key) pairs a causal prefill of `new` tokens atop `total - new` cached ones sees."""
    return sum(n * (t - n) + n * (n + 1) // 2 for n, t in zip(new, total, strict=True))


def decode_cost(lens: tuple[int, ...], hq: int, hkv: int, d: int, es: int) -> tuple[int, int]:
    toks = sum(lens)
    return es * (2 * toks * hkv * d + 2 * len(lens) * hq * d), 4 * toks * hq * d


def prefill_cost(new: tuple[int, ...], total: tuple[int, ...], hq: int, hkv: int, d: int,
                 es: int) -> tuple[int, int]:
    return (es * (2 * sum(total) * hkv * d + 2 * sum(new) * hq * d),
            4 * causal_pairs(new, total) * hq * d)


def vit_cost(segments: tuple[int, ...], h: int, d: int, es: int) -> tuple[int, int]:
    return es * 4 * sum(segments) * h * d, 4 * h * d * sum(n * n for n in segments)


# -- the kernels ------------------------------------------------------------------------------

def linear_case(name: str, model: str, m: int, k: int, n: int, act: str | None,
                bias: bool) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import linear

        x = rand(m, k, dtype=dtype, device=device)
        w = rand(n, k, dtype=dtype, device=device, scale=k ** -0.5)
        b = rand(n, dtype=dtype, device=device) if bias else None
        es = esize(dtype)
        return Work(lambda s: linear(x, w, b, activation=act, num_sms=s),
                    es * (m * k + n * k + m * n + (n if bias else 0)), 2 * m * n * k,
                    dict(M=m, K=k, N=n, activation=act, bias=bias), "linear")

    return Case("linear", name, model, build, dict(M=m, K=k, N=n))


def gated_mlp_case(name: str, model: str, m: int, k: int, inter: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import gated_mlp

        x = rand(m, k, dtype=dtype, device=device)
        wgu = rand(2 * inter, k, dtype=dtype, device=device, scale=k ** -0.5)
        wd = rand(k, inter, dtype=dtype, device=device, scale=inter ** -0.5)
        es = esize(dtype)
        return Work(lambda s: gated_mlp(x, wgu, wd, num_sms=s),
                    es * (2 * m * k + 3 * inter * k), 6 * m * k * inter,
                    dict(M=m, K=k, I=inter), "gated_mlp")

    return Case("gated_mlp", name, model, build, dict(M=m, K=k, I=inter))


def rms_norm_case(name: str, model: str, m: int, k: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import rms_norm

        x, res = rand(m, k, dtype=dtype, device=device), rand(m, k, dtype=dtype, device=device)
        w = rand(k, dtype=dtype, device=device)
        return Work(lambda s: rms_norm(x, w, 1e-6, residual=res, num_sms=s),
                    esize(dtype) * (4 * m * k + k), 5 * m * k,
                    dict(M=m, K=k, residual=True), "rms_norm(residual=...)")

    return Case("rms_norm", name, model, build, dict(M=m, K=k))


def layer_norm_case(name: str, model: str, m: int, k: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import layer_norm

        x = rand(m, k, dtype=dtype, device=device)
        w, b = rand(k, dtype=dtype, device=device), rand(k, dtype=dtype, device=device)
        return Work(lambda s: layer_norm(x, w, b, 1e-6, num_sms=s),
                    esize(dtype) * (2 * m * k + 2 * k), 8 * m * k, dict(M=m, K=k), "layer_norm")

    return Case("layer_norm", name, model, build, dict(M=m, K=k))


def rotary_case(name: str, model: str, t: int, hq: int, hk: int, d: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import apply_rotary

        q, k = rand(t, hq, d, dtype=dtype, device=device), rand(t, hk, d, dtype=dtype,
                                                               device=device)
        ang = torch.rand(t, d // 2, device=device) * 6.28
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return Work(lambda s: apply_rotary(q, k, cos, sin, num_sms=s),
                    esize(dtype) * 2 * t * (hq + hk) * d + 4 * 2 * t * d, 3 * t * (hq + hk) * d,
                    dict(T=t, Hq=hq, Hk=hk, D=d), "apply_rotary (in place)")

    return Case("apply_rotary", name, model, build, dict(T=t, Hq=hq, Hk=hk, D=d))


def rotary_table_case(name: str, model: str, kind: str, t: int, d: int,
                      section: tuple[int, ...] = (), grids: tuple = ()) -> Case:
    """The cos/sin table builders (torch ops: no SM budget of their own)."""

    def build(dtype, device):
        from spaceserve.kernels import mrope_cos_sin, rope_cos_sin, vision_rotary_cos_sin

        pos = torch.arange(t, device=device)
        if kind == "rope":
            call = lambda s: rope_cos_sin(pos, d, 1e6)  # noqa: E731
        elif kind == "mrope":
            pos3 = pos[None].expand(3, t).contiguous()
            call = lambda s: mrope_cos_sin(pos3, d, 1e6, section)  # noqa: E731
        else:
            call = lambda s: vision_rotary_cos_sin(grids, d, device=device)  # noqa: E731
        reads = 0 if kind == "vision" else 8 * t * (3 if kind == "mrope" else 1)
        return Work(call, reads + 2 * 4 * t * d, 0, dict(T=t, D=d, table=kind),
                    f"{kind}_cos_sin (fp32 tables)", budgeted=False)

    return Case("rotary_tables", name, model, build, dict(T=t, D=d))


def vit_attention_case(name: str, model: str, segments: tuple[int, ...], h: int, d: int
                       ) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import plan_vit_attention, vit_attention

        cu_host = [0]
        for n in segments:
            cu_host.append(cu_host[-1] + n)
        t = cu_host[-1]
        q, k, v = (rand(t, h, d, dtype=dtype, device=device) for _ in range(3))
        cu = torch.tensor(cu_host, dtype=torch.int32).to(device)
        plan = plan_vit_attention(cu_host, h, d, dtype=dtype, device=device)
        nbytes, flops = vit_cost(segments, h, d, esize(dtype))
        return Work(lambda s: vit_attention(q, k, v, cu, max(segments), num_sms=s, plan=plan),
                    nbytes, flops, dict(segments=list(segments), H=h, D=d),
                    "vit_attention(plan=plan_vit_attention(...))")

    return Case("vit_attention", name, model, build, dict(T=sum(segments), H=h, D=d))


def paged_decode_case(name: str, model: str, lens: tuple[int, ...], hq: int, hkv: int, d: int,
                      bs: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import DecodePlan

        kc, vc, tables = paged_cache(lens, hkv, d, bs, dtype, device)
        table = table_tensor(tables, device)
        q = rand(len(lens), hq, d, dtype=dtype, device=device)
        sl = torch.tensor(lens, dtype=torch.int32).to(device)
        plan = DecodePlan(len(lens), table.shape[1], hq, hkv, d, bs, device=device)
        plan.plan(list(lens))
        nbytes, flops = decode_cost(lens, hq, hkv, d, esize(dtype))
        return Work(lambda s: plan.run(q, kc, vc, table, sl, num_sms=s), nbytes, flops,
                    dict(B=len(lens), mean_context=sum(lens) / len(lens), Hq=hq, Hkv=hkv, D=d,
                         block_size=bs), "DecodePlan.run")

    return Case("paged_decode_attention", name, model, build,
                dict(B=len(lens), context=sum(lens) // len(lens)))


def paged_prefill_case(name: str, model: str, new: tuple[int, ...], total: tuple[int, ...],
                       hq: int, hkv: int, d: int, bs: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import PrefillPlan

        kc, vc, tables = paged_cache(total, hkv, d, bs, dtype, device)
        table = table_tensor(tables, device)
        cu_host = [0]
        for n in new:
            cu_host.append(cu_host[-1] + n)
        q = rand(cu_host[-1], hq, d, dtype=dtype, device=device)
        cu = torch.tensor(cu_host, dtype=torch.int32).to(device)
        sl = torch.tensor(total, dtype=torch.int32).to(device)
        plan = PrefillPlan(cu_host[-1], len(new), hq, hkv, d, device=device)
        plan.plan(cu_host, list(total))
        nbytes, flops = prefill_cost(new, total, hq, hkv, d, esize(dtype))
        return Work(lambda s: plan.run(q, kc, vc, table, cu, sl, num_sms=s), nbytes, flops,
                    dict(new=list(new), cached=list(total), Hq=hq, Hkv=hkv, D=d,
                         block_size=bs), "PrefillPlan.run")

    return Case("paged_prefill_attention", name, model, build, dict(T=sum(new)))


def store_kv_case(name: str, model: str, t: int, hkv: int, d: int, bs: int) -> Case:
    def build(dtype, device):
        from spaceserve.kernels import store_kv

        k, v = rand(t, hkv, d, dtype=dtype, device=device), rand(t, hkv, d, dtype=dtype,
                                                                device=device)
        blocks = cdiv(t, bs) + 1
        kc = torch.zeros(blocks, bs, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        gen = torch.Generator().manual_seed(0)
        slots = torch.randperm(blocks * bs, generator=gen)[:t].to(torch.int32).to(device)
        return Work(lambda s: store_kv(k, v, kc, vc, slots, num_sms=s),
                    esize(dtype) * 4 * t * hkv * d + 4 * t, 0,
                    dict(T=t, Hkv=hkv, D=d, block_size=bs), "store_kv")

    return Case("store_kv", name, model, build, dict(T=t, Hkv=hkv, D=d))


def vision_towers(dims: dict[str, ModelDims]) -> dict[str, ModelDims]:
    """One model per distinct vision tower, by case-name prefix: the first tower's cases keep
    their plain names (``vit``), a later one's are prefixed by its model's short name
    (``q3-8b-vit``)."""
    out: dict[str, ModelDims] = {}
    seen: set[tuple] = set()
    for short, m in dims.items():
        key = (m.vision_embed, m.vision_heads, m.vision_mlp, m.patch_size, m.vision_act)
        if key not in seen:
            seen.add(key)
            out["" if not out else f"{short}-"] = m
    return out


def kernel_cases(profile: str) -> dict[str, list[Case]]:
    """Every kernel's cases in `profile`, by kernel name (the test function's suffix)."""
    dims: dict[str, ModelDims] = models(profile)
    wl: Workload = workload(profile)
    out: dict[str, list[Case]] = {k: [] for k in (
        "linear", "gated_mlp", "rms_norm", "layer_norm", "apply_rotary", "rotary_tables",
        "vit_attention", "paged_decode_attention", "paged_prefill_attention", "store_kv")}
    for prefix, vis in vision_towers(dims).items():
        vit = f"{vis.name.split('-vl-')[0]}-vl-vit"  # qwen2-vl-vit, qwen3-vl-vit
        grids = wl.grids(vis.patch_size)
        segments = tuple(t * h * w for t, h, w in grids)
        patches, vd = sum(segments), vis.vision_head_dim
        out["linear"].append(linear_case(f"{prefix}vit-fc1", vit, patches, vis.vision_embed,
                                         vis.vision_mlp, vis.vision_act, True))
        out["layer_norm"].append(layer_norm_case(f"{prefix}vit", vit, patches, vis.vision_embed))
        out["apply_rotary"].append(rotary_case(f"{prefix}vit", vit, patches, vis.vision_heads,
                                               vis.vision_heads, vd))
        out["rotary_tables"].append(rotary_table_case(f"{prefix}vision", vit, "vision", patches,
                                                      vd, grids=grids))
        out["vit_attention"].append(vit_attention_case(f"{prefix}vit", vit, segments,
                                                       vis.vision_heads, vd))
        if vis.deepstack:  # a DeepStack merger's MLP: merged patches 4x wide, then to the LLM
            wide = vis.vision_embed * 4
            out["linear"] += [
                linear_case(f"{prefix}vit-merger-fc1", vit, patches // 4, wide, wide, "gelu",
                            True),
                linear_case(f"{prefix}vit-merger-fc2", vit, patches // 4, wide, vis.hidden,
                            None, True)]
    batch, tok = len(wl.decode_lens), wl.prefill_tokens
    for short, m in dims.items():
        h, hq, hkv, d, bs = m.hidden, m.heads, m.kv_heads, m.head_dim, wl.block_size
        out["linear"] += [
            linear_case(f"{short}-qkv-prefill", m.name, tok, h, m.qkv_out, None, True),
            linear_case(f"{short}-o-decode", m.name, batch, hq * d, h, None, False)]
        out["gated_mlp"] += [gated_mlp_case(f"{short}-decode", m.name, batch, h, m.intermediate),
                             gated_mlp_case(f"{short}-prefill", m.name, tok, h, m.intermediate)]
        out["rms_norm"].append(rms_norm_case(f"{short}-prefill", m.name, tok, h))
        if m.qk_norm:  # one RMSNorm per q and k head (Qwen3)
            out["rms_norm"].append(rms_norm_case(f"{short}-qk-norm-prefill", m.name,
                                                 tok * (hq + hkv), d))
        out["apply_rotary"].append(rotary_case(short, m.name, tok, hq, hkv, d))
        out["paged_decode_attention"].append(paged_decode_case(
            f"{short}-b{batch}-ctx{sum(wl.decode_lens) // batch}", m.name, wl.decode_lens, hq,
            hkv, d, bs))
        out["paged_prefill_attention"].append(paged_prefill_case(
            f"{short}-chunk{sum(wl.chunk_new)}", m.name, wl.chunk_new, wl.chunk_total, hq, hkv,
            d, bs))
        out["store_kv"].append(store_kv_case(f"{short}-T{tok}", m.name, tok, hkv, d, bs))
    first = next(iter(dims.values()))
    out["rotary_tables"] += [
        rotary_table_case("mrope", first.name, "mrope", tok, first.head_dim, first.mrope_section),
        rotary_table_case("rope", first.name, "rope", tok, first.head_dim)]
    return out
