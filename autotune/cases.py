"""Tuning cases: for each kernel config name, a representative call of the model's shapes, its
fp64 reference (the kernel module's ``ref_*``), and the candidate configs to try.

A candidate only sets keys its launcher honours (`spaceserve.kernels.configs.HONOURED`); the
tuner splits it into whole-device and per-budget parts. Candidates are curated around each
launcher's H200 default (a handful per kernel, so a harness section can afford them); on CPU
(the interpreter, tests) a couple of small-tile ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class TuneShapes:
    """Dimensions the cases are built from (a model's, plus the batch sizes to tune for)."""

    vit_tokens: int
    vit_segments: tuple[int, ...]
    vit_embed: int
    vit_heads: int
    vit_mlp: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    prefill_tokens: int
    decode_batch: int
    decode_context: int
    block_size: int = 16

    @classmethod
    def qwen2_vl_7b(cls) -> TuneShapes:
        """Qwen2-VL-7B (its preset): a 4096-patch vision batch, 2048-token prefill, decode
        batch 32 at 2k."""
        from spaceserve.models.presets import get_preset

        p = get_preset("qwen2-vl-7b")
        v, t = p.vision, p.text
        return cls(4096, (1024, 3072), v.embed, v.heads, v.intermediate, t.hidden,
                   t.intermediate, t.heads, t.kv_heads, t.head_dim, 2048, 32, 2048)

    @classmethod
    def tiny(cls) -> TuneShapes:
        """Interpreter-sized shapes (CPU tests): M=80 is a large GEMM, M=3 a skinny one."""
        return cls(80, (30, 50), 32, 2, 48, 64, 48, 4, 2, 16, 80, 3, 40, 8)


@dataclass
class Case:
    """One tuning case: `run(num_sms)` calls the kernel(s) and returns the output; `timed`
    (default `run`) is what gets timed, for in-place kernels whose `run` must start from fresh
    inputs; `reference()` the fp64 expectation; `setup()` runs after each config change."""

    name: str
    dtype: torch.dtype
    run: Callable[[int], Tensor]
    reference: Callable[[], Tensor]
    default: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[], None] = field(default=lambda: None)
    timed: Callable[[int], Any] | None = None


def _randn(gen: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype,
           std: float = 1.0) -> Tensor:
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)


def _flat(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _gemm_case(name: str, problems: list[tuple[int, int, int, str | None]], dev: torch.device,
               dtype: torch.dtype) -> Case:
    from spaceserve.kernels.linear import linear, ref_linear

    gen = torch.Generator(device=dev).manual_seed(1)
    ops = [(_randn(gen, m, k, device=dev, dtype=dtype),
            _randn(gen, n, k, device=dev, dtype=dtype, std=k ** -0.5),
            _randn(gen, n, device=dev, dtype=dtype), act) for m, k, n, act in problems]

    def run(num_sms: int) -> Tensor:
        return _flat(*(linear(x, w, b, activation=a, num_sms=num_sms) for x, w, b, a in ops))

    def reference() -> Tensor:
        return _flat(*(ref_linear(x.double(), w.double(), b.double(), a) for x, w, b, a in ops))

    desc = ", ".join(f"{m}x{k}x{n}" for m, k, n, _ in problems)
    return Case(f"{name} [{desc}]", dtype, run, reference)


def linear_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    """ViT fc1 (quick_gelu) and the LLM's fused QKV projection of a prefill chunk."""
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return _gemm_case("linear", [(s.vit_tokens, s.vit_embed, s.vit_mlp, "quick_gelu"),
                                 (s.prefill_tokens, s.hidden, qkv, None)], dev, dtype)


def linear_skinny_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    """A decode step's QKV and output projections (M = batch)."""
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return _gemm_case("linear_skinny", [(s.decode_batch, s.hidden, qkv, None),
                                        (s.decode_batch, s.heads * s.head_dim, s.hidden, None)],
                      dev, dtype)


def _mlp_case(name: str, m: int, s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    from spaceserve.kernels.gated_mlp import gated_mlp, ref_gated_mlp

    gen = torch.Generator(device=dev).manual_seed(2)
    x = _randn(gen, m, s.hidden, device=dev, dtype=dtype)
    wgu = _randn(gen, 2 * s.inter, s.hidden, device=dev, dtype=dtype, std=s.hidden ** -0.5)
    wd = _randn(gen, s.hidden, s.inter, device=dev, dtype=dtype, std=s.inter ** -0.5)
    return Case(f"{name} [{m}x{s.hidden}, I={s.inter}]", dtype,
                lambda n: gated_mlp(x, wgu, wd, num_sms=n),
                lambda: ref_gated_mlp(x.double(), wgu.double(), wd.double()))


def gated_mlp_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    return _mlp_case("gated_mlp", s.prefill_tokens, s, dev, dtype)


def gated_mlp_skinny_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    return _mlp_case("gated_mlp_skinny", s.decode_batch, s, dev, dtype)


def _paged(s: TuneShapes, dev: torch.device, dtype: torch.dtype, lens: list[int], seed: int
           ) -> tuple[Tensor, Tensor, Tensor]:
    """Caches holding `lens` tokens per sequence over scattered blocks, and the tables."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    per = [-(-n // s.block_size) for n in lens]
    nb = sum(per)
    shape = (nb, s.block_size, s.kv_heads, s.head_dim)
    kc, vc = (_randn(gen, *shape, device=dev, dtype=dtype) for _ in range(2))
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for i, p in enumerate(per):
        tables[i, :p] = perm[at:at + p].to(torch.int32)
        at += p
    return kc, vc, tables.to(dev)


def paged_decode_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    from spaceserve.kernels.attention.paged_decode import (
        paged_decode_attention,
        ref_paged_decode_attention,
    )

    lens = [s.decode_context - (i * 7) % max(1, s.decode_context // 4)
            for i in range(s.decode_batch)]
    kc, vc, tables = _paged(s, dev, dtype, lens, 3)
    gen = torch.Generator(device=dev).manual_seed(4)
    q = _randn(gen, s.decode_batch, s.heads, s.head_dim, device=dev, dtype=dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    return Case(f"paged_decode [B={s.decode_batch}, ctx~{s.decode_context}]", dtype,
                lambda n: paged_decode_attention(q, kc, vc, tables, seq, num_sms=n),
                lambda: ref_paged_decode_attention(q.double(), kc.double(), vc.double(),
                                                   tables, seq))


def paged_prefill_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    from spaceserve.kernels.attention.paged_prefill import (
        paged_prefill_attention,
        ref_paged_prefill_attention,
    )

    total = s.prefill_tokens + s.decode_context  # a chunk after a cached prefix
    kc, vc, tables = _paged(s, dev, dtype, [total], 5)
    gen = torch.Generator(device=dev).manual_seed(6)
    q = _randn(gen, s.prefill_tokens, s.heads, s.head_dim, device=dev, dtype=dtype)
    cu = torch.tensor([0, s.prefill_tokens], dtype=torch.int32, device=dev)
    seq = torch.tensor([total], dtype=torch.int32, device=dev)
    return Case(f"paged_prefill [{s.prefill_tokens} after {s.decode_context}]", dtype,
                lambda n: paged_prefill_attention(q, kc, vc, tables, cu, seq, num_sms=n),
                lambda: ref_paged_prefill_attention(q.double(), kc.double(), vc.double(),
                                                    tables, cu, seq))


def vit_attention_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    from spaceserve.kernels.attention.vit import (
        plan_vit_attention,
        ref_vit_attention,
        vit_attention,
    )

    d = s.vit_embed // s.vit_heads
    total = sum(s.vit_segments)
    cu_host = [0]
    for n in s.vit_segments:
        cu_host.append(cu_host[-1] + n)
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (_randn(gen, total, s.vit_heads, d, device=dev, dtype=dtype) for _ in range(3))
    cu = torch.tensor(cu_host, dtype=torch.int32, device=dev)
    state: dict[str, Any] = {}

    def setup() -> None:  # the plan's tiles follow the installed BLOCK_M
        state["plan"] = plan_vit_attention(cu_host, s.vit_heads, d, dtype=dtype, device=dev)

    def run(n: int) -> Tensor:
        return vit_attention(q, k, v, cu, max(s.vit_segments), num_sms=n, plan=state["plan"])

    return Case(f"vit_attention [{s.vit_segments}, H={s.vit_heads}, D={d}]", dtype, run,
                lambda: ref_vit_attention(q.double(), k.double(), v.double(), cu.cpu()),
                setup=setup)


def _norm_case(name: str, m: int, k: int, dev: torch.device, dtype: torch.dtype) -> Case:
    from spaceserve.kernels import norms

    gen = torch.Generator(device=dev).manual_seed(8)
    x, w, b = (_randn(gen, *shp, device=dev, dtype=dtype) for shp in ((m, k), (k,), (k,)))
    if name == "rms_norm":
        run = lambda n: norms.rms_norm(x, w, 1e-6, num_sms=n)  # noqa: E731
        ref = lambda: norms.ref_rms_norm(x.double(), w.double(), 1e-6)  # noqa: E731
    else:
        run = lambda n: norms.layer_norm(x, w, b, 1e-6, num_sms=n)  # noqa: E731
        ref = lambda: norms.ref_layer_norm(x.double(), w.double(), b.double(), 1e-6)  # noqa: E731
    return Case(f"{name} [{m}x{k}]", dtype, run, ref, default=norms.norm_config(k))


def rms_norm_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    return _norm_case("rms_norm", s.prefill_tokens, s.hidden, dev, dtype)


def layer_norm_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    return _norm_case("layer_norm", s.vit_tokens, s.vit_embed, dev, dtype)


def rotary_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    """M-RoPE-style rotation of a prefill chunk's q and k (in place)."""
    from spaceserve.kernels.rotary import apply_rotary, ref_apply_rotary, rotary_config

    gen = torch.Generator(device=dev).manual_seed(9)
    t, d = s.prefill_tokens, s.head_dim
    q = _randn(gen, t, s.heads, d, device=dev, dtype=dtype)
    k = _randn(gen, t, s.kv_heads, d, device=dev, dtype=dtype)
    ang = _randn(gen, t, d // 2, device=dev, dtype=torch.float32)
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).contiguous() for f in (torch.cos, torch.sin))
    work = [q.clone(), k.clone()]

    def run(n: int) -> Tensor:
        qq, kk = q.clone(), k.clone()
        return _flat(*apply_rotary(qq, kk, cos, sin, num_sms=n))

    return Case(f"rotary [{t}x({s.heads}+{s.kv_heads})x{d}]", dtype, run,
                lambda: _flat(*ref_apply_rotary(q.double(), k.double(), cos.double(),
                                                sin.double())),
                default=rotary_config(d, max(s.heads, s.kv_heads)),
                timed=lambda n: apply_rotary(work[0], work[1], cos, sin, num_sms=n))


def store_kv_case(s: TuneShapes, dev: torch.device, dtype: torch.dtype) -> Case:
    """A prefill chunk's K/V written to scattered cache slots (in place)."""
    from spaceserve.kernels.attention.kv_cache import ref_store_kv, store_kv

    gen = torch.Generator(device=dev).manual_seed(10)
    t = s.prefill_tokens
    k, v = (_randn(gen, t, s.kv_heads, s.head_dim, device=dev, dtype=dtype) for _ in range(2))
    blocks = -(-t // s.block_size) + 1
    shape = (blocks, s.block_size, s.kv_heads, s.head_dim)
    kc, vc = (torch.zeros(shape, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(blocks * s.block_size, generator=torch.Generator().manual_seed(10))
    slots = slots[:t].to(dev)

    def run(n: int) -> Tensor:
        kc.zero_()
        vc.zero_()
        store_kv(k, v, kc, vc, slots, num_sms=n)
        return _flat(kc, vc)

    def reference() -> Tensor:
        rk, rv = (torch.zeros(shape, device=dev, dtype=torch.float64) for _ in range(2))
        ref_store_kv(k.double(), v.double(), rk, rv, slots)
        return _flat(rk, rv)

    return Case(f"store_kv [{t}x{s.kv_heads}x{s.head_dim}]", dtype, run, reference,
                timed=lambda n: store_kv(k, v, kc, vc, slots, num_sms=n))


CaseFn = Callable[[TuneShapes, torch.device, torch.dtype], Case]
CASES: dict[str, CaseFn] = {
    "linear": linear_case, "linear_skinny": linear_skinny_case,
    "gated_mlp": gated_mlp_case, "gated_mlp_skinny": gated_mlp_skinny_case,
    "splitk_reduce": linear_skinny_case,
    "paged_decode": paged_decode_case, "paged_prefill": paged_prefill_case,
    "vit_attention": vit_attention_case,
    "rms_norm": rms_norm_case, "layer_norm": layer_norm_case,
    "rotary": rotary_case, "store_kv": store_kv_case,
}

_G = dict(GROUP_M=8)
GPU_CANDIDATES: dict[str, list[dict[str, int]]] = {
    "linear": [dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3, **_G),
               dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, **_G),
               dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, **_G),
               dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, **_G),
               dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_M=16)],
    "linear_skinny": [dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, **_G),
                      dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4, **_G),
                      dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=3, **_G),
                      dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=5, **_G),
                      dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, **_G)],
    "gated_mlp": [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=5, **_G),
                  dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, **_G),
                  dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, **_G),
                  dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4, **_G),
                  dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3, **_G)],
    "splitk_reduce": [dict(BLOCK=512, num_warps=4), dict(BLOCK=2048, num_warps=8),
                      dict(BLOCK=4096, num_warps=8)],
    "paged_decode": [dict(BLOCK_N=64, num_warps=4, num_stages=3),
                     dict(BLOCK_N=128, num_warps=8, num_stages=3),
                     dict(BLOCK_N=64, num_warps=4, num_stages=4),
                     dict(BLOCK_N=32, num_warps=4, num_stages=4),
                     dict(BLOCK_N=128, num_warps=4, num_stages=2)],
    "paged_prefill": [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
                      dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                      dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3),
                      dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)],
    "vit_attention": [dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
                      dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                      dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
                      dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                      dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)],
}
GPU_CANDIDATES["gated_mlp_skinny"] = GPU_CANDIDATES["linear_skinny"]
CPU_CANDIDATES: dict[str, list[dict[str, int]]] = {
    "linear": [dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2, num_warps=4, num_stages=1)],
    "linear_skinny": [dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2, num_warps=4, num_stages=1)],
    "gated_mlp": [dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2, num_warps=4, num_stages=1)],
    "gated_mlp_skinny": [dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2, num_warps=4, num_stages=1)],
    "splitk_reduce": [dict(BLOCK=64, num_warps=4)],
    "paged_decode": [dict(BLOCK_N=16, num_warps=4, num_stages=2)],
    "paged_prefill": [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)],
    "vit_attention": [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)],
}


def _norm_candidates(case: Case) -> list[dict[str, int]]:
    bm, warps = int(case.default["BLOCK_M"]), int(case.default["num_warps"])
    out = []
    for m in sorted({max(1, bm // 2), bm, min(32, bm * 2)}):
        for w in sorted({warps, min(16, warps * 2)}):
            for stages in (1, 2):
                if (m, w, stages) != (bm, warps, 1):
                    out.append(dict(BLOCK_M=m, num_warps=w, num_stages=stages))
    return out


def _rotary_candidates(case: Case) -> list[dict[str, int]]:
    bt, warps = int(case.default["BLOCK_T"]), int(case.default["num_warps"])
    return [dict(BLOCK_T=t, num_warps=w) for t in sorted({max(1, bt // 2), bt * 2})
            for w in (4, 8) if (t, w) != (bt, warps)]


STORE_CANDIDATES = [dict(BLOCK_ELEMS=e, num_warps=w) for e in (2048, 8192, 16384)
                    for w in (4, 8)]


def candidates(name: str, case: Case, device: torch.device) -> list[dict[str, int]]:
    """Configs to try for kernel `name` (the launcher's default is always tried as well)."""
    relative = {"rms_norm": _norm_candidates, "layer_norm": _norm_candidates,
                "rotary": _rotary_candidates, "store_kv": lambda c: list(STORE_CANDIDATES)}
    if name in relative:
        cands = relative[name](case)
        return cands if device.type == "cuda" else cands[:2]
    table = GPU_CANDIDATES if device.type == "cuda" else CPU_CANDIDATES
    return [dict(c) for c in table.get(name, [])]
