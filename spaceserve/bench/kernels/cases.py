"""The kernel demo's cases: for each kernel, inputs of a CPU-small or Qwen2-VL-7B-like shape, the
call at an SM budget, its fp64 torch reference, and the checks of one run (`run_case`).

A case names its kernel module; a module not in the tree yet is reported as "not available"
rather than failing the demo. Import this module only after TRITON_INTERPRET is decided (the
demo does so when there is no CUDA device): the kernel modules are imported when a case runs.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spaceserve.bench.measure import bench_ms, sync
from spaceserve.models.presets import get_preset

_7B = get_preset("qwen2-vl-7b").text  # the big (GPU) shapes: Qwen2-VL-7B's LLM

Outputs = list[torch.Tensor]
# make(device, dtype, big) -> (shape text, call(num_sms) -> outputs, reference() -> fp64 outputs)
Make = Callable[[torch.device, torch.dtype, bool, dict], tuple[str, Callable[[int], Outputs],
                                                                Callable[[], Outputs]]]


@dataclass(frozen=True)
class Case:
    name: str
    module: str
    fn: str
    ref: str
    make: Make


def _r(*shape: int, dev: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dtype)


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.double() if t is not None and t.is_floating_point() else t


def _as_list(out) -> Outputs:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def make_linear(dev, dtype, big, f):
    m, k, n = (1024, _7B.hidden, _7B.hidden) if big else (130, 96, 272)
    x, w, b = _r(m, k, dev=dev, dtype=dtype), _r(n, k, dev=dev, dtype=dtype, scale=k**-0.5), \
        _r(n, dev=dev, dtype=dtype)
    return (f"M={m} K={k} N={n} silu", lambda s: [f["fn"](x, w, b, activation="silu", num_sms=s)],
            lambda: [f["ref"](_d(x), _d(w), _d(b), activation="silu")])


def make_gated_mlp(dev, dtype, big, f):
    m, k, i = (256, _7B.hidden, _7B.intermediate) if big else (19, 64, 96)
    x = _r(m, k, dev=dev, dtype=dtype)
    wgu, wd = _r(2 * i, k, dev=dev, dtype=dtype, scale=k**-0.5), _r(k, i, dev=dev, dtype=dtype,
                                                                   scale=i**-0.5)
    return (f"M={m} K={k} I={i}", lambda s: [f["fn"](x, wgu, wd, num_sms=s)],
            lambda: [f["ref"](_d(x), _d(wgu), _d(wd))])


def make_rms_norm(dev, dtype, big, f):
    m, k = (4096, _7B.hidden) if big else (301, 200)
    x, res, w = _r(m, k, dev=dev, dtype=dtype), _r(m, k, dev=dev, dtype=dtype), \
        _r(k, dev=dev, dtype=dtype)
    return (f"M={m} K={k} +residual",
            lambda s: _as_list(f["fn"](x, w, 1e-6, residual=res, num_sms=s)),
            lambda: _as_list(f["ref"](_d(x), _d(w), 1e-6, residual=_d(res))))


def make_layer_norm(dev, dtype, big, f):
    m, k = (4096, 1280) if big else (301, 200)
    x, w, b = _r(m, k, dev=dev, dtype=dtype), _r(k, dev=dev, dtype=dtype), \
        _r(k, dev=dev, dtype=dtype)
    return (f"M={m} K={k}", lambda s: [f["fn"](x, w, b, 1e-6, num_sms=s)],
            lambda: [f["ref"](_d(x), _d(w), _d(b), 1e-6)])


def make_apply_rotary(dev, dtype, big, f):
    t, hq, hk, d = (4096, 16, 16, 80) if big else (129, 4, 2, 64)
    q, k = _r(t, hq, d, dev=dev, dtype=dtype), _r(t, hk, d, dev=dev, dtype=dtype)
    ang = torch.rand(t, d // 2, device=dev) * 6.28
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return (f"T={t} Hq={hq} Hk={hk} D={d}",
            lambda s: _as_list(f["fn"](q.clone(), k.clone(), cos, sin, num_sms=s)),
            lambda: _as_list(f["ref"](_d(q), _d(k), _d(cos), _d(sin))))


def make_vit_attention(dev, dtype, big, f):
    lens, h, d = ([1024, 1024, 2048, 512], 16, 80) if big else ([37, 63, 5], 2, 80)
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (_r(t, h, d, dev=dev, dtype=dtype) for _ in range(3))
    cu_dev = cu.to(dev)
    return (f"segments={lens} H={h} D={d}",
            lambda s: [f["fn"](q, k, v, cu_dev, max(lens), num_sms=s, cu_seqlens_cpu=cu)
                       if "cu_seqlens_cpu" in f["params"] else
                       f["fn"](q, k, v, cu_dev, max(lens), num_sms=s)],
            lambda: [f["ref"](_d(q), _d(k), _d(v), cu)])


def _paged_cache(lens: list[int], hkv: int, d: int, bs: int, dev, dtype):
    """Caches with shuffled pages; block table int32 [B, max_blocks] (unused entries 0)."""
    blocks = [(n + bs - 1) // bs for n in lens]
    nb = sum(blocks) + 2
    perm = torch.randperm(nb)[: sum(blocks)].tolist()
    table = torch.zeros(len(lens), max(max(blocks), 1), dtype=torch.int32)
    pos = 0
    for i, nblk in enumerate(blocks):
        table[i, :nblk] = torch.tensor(perm[pos: pos + nblk], dtype=torch.int32)
        pos += nblk
    kc, vc = _r(nb, bs, hkv, d, dev=dev, dtype=dtype), _r(nb, bs, hkv, d, dev=dev, dtype=dtype)
    return kc, vc, table.to(dev)


def make_paged_decode(dev, dtype, big, f):
    lens, hq, hkv, d, bs = ([1500, 4000, 700, 0] * 8, 28, 4, 128, 16) if big else \
        ([1, 40, 0, 77], 4, 2, 64, 16)
    kc, vc, table = _paged_cache(lens, hkv, d, bs, dev, dtype)
    q = _r(len(lens), hq, d, dev=dev, dtype=dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    return (f"B={len(lens)} Hq={hq} Hkv={hkv} D={d} page={bs}",
            lambda s: [f["fn"](q, kc, vc, table, sl, num_sms=s)],
            lambda: [f["ref"](_d(q), _d(kc), _d(vc), table, sl)])


def make_paged_prefill(dev, dtype, big, f):
    new, total, hq, hkv, d, bs = ([512, 300], [1024, 300], 28, 4, 128, 16) if big else \
        ([5, 11], [20, 11], 4, 2, 64, 16)
    kc, vc, table = _paged_cache(total, hkv, d, bs, dev, dtype)
    q = _r(sum(new), hq, d, dev=dev, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    sl = torch.tensor(total, dtype=torch.int32, device=dev)
    return (f"new={new} cached={total} Hq={hq} Hkv={hkv} D={d}",
            lambda s: [f["fn"](q, kc, vc, table, cu, sl, num_sms=s)],
            lambda: [f["ref"](_d(q), _d(kc), _d(vc), table, cu, sl)])


def make_store_kv(dev, dtype, big, f):
    t, hkv, d, nb, bs = (256, 4, 128, 64, 16) if big else (45, 2, 64, 4, 16)
    k, v = _r(t, hkv, d, dev=dev, dtype=dtype), _r(t, hkv, d, dev=dev, dtype=dtype)
    slots = torch.randperm(nb * bs)[:t].to(torch.int32)
    slots[::4] = -1
    slots = slots.to(dev)
    kc0, vc0 = torch.zeros(nb, bs, hkv, d, device=dev, dtype=dtype), \
        torch.zeros(nb, bs, hkv, d, device=dev, dtype=dtype)

    def call(s: int) -> Outputs:
        kc, vc = kc0.clone(), vc0.clone()
        f["fn"](k, v, kc, vc, slots, num_sms=s)
        return [kc, vc]

    def ref() -> Outputs:
        kc, vc = _d(kc0).clone(), _d(vc0).clone()
        f["ref"](_d(k), _d(v), kc, vc, slots)
        return [kc, vc]

    return f"T={t} Hkv={hkv} D={d} (every 4th slot skipped)", call, ref


CASES: list[Case] = [
    Case("linear", "linear", "linear", "ref_linear", make_linear),
    Case("gated_mlp", "gated_mlp", "gated_mlp", "ref_gated_mlp", make_gated_mlp),
    Case("rms_norm", "norms", "rms_norm", "ref_rms_norm", make_rms_norm),
    Case("layer_norm", "norms", "layer_norm", "ref_layer_norm", make_layer_norm),
    Case("apply_rotary", "rotary", "apply_rotary", "ref_apply_rotary", make_apply_rotary),
    Case("vit_attention", "attention.vit", "vit_attention", "ref_vit_attention",
         make_vit_attention),
    Case("paged_decode", "attention.paged_decode", "paged_decode_attention",
         "ref_paged_decode_attention", make_paged_decode),
    Case("paged_prefill", "attention.paged_prefill", "paged_prefill_attention",
         "ref_paged_prefill_attention", make_paged_prefill),
    Case("store_kv", "attention.kv_cache", "store_kv", "ref_store_kv", make_store_kv),
]


def resolve(case: Case) -> dict | str:
    """{fn, ref, params} of a case, or why it is not available."""
    import inspect

    import spaceserve.kernels as pkg

    fn, ref = getattr(pkg, case.fn, None), getattr(pkg, case.ref, None)
    if fn is None or ref is None:
        try:
            mod = importlib.import_module(f"spaceserve.kernels.{case.module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"spaceserve.kernels.{case.module}":
                return f"not available (no spaceserve/kernels/{case.module.replace('.', '/')}.py)"
            return f"import error: {exc}"
        except Exception as exc:
            return f"import error: {type(exc).__name__}: {exc}"
        fn, ref = getattr(mod, case.fn, fn), getattr(mod, case.ref, ref)
    if fn is None or ref is None:
        return f"not available ({case.fn} or {case.ref} missing)"
    return {"fn": fn, "ref": ref, "params": set(inspect.signature(fn).parameters)}


def run_case(case: Case, budgets: list[int], device: torch.device, dtype: torch.dtype,
             big: bool) -> list[dict]:
    from spaceserve.kernels import record_launches
    from spaceserve.kernels.testing import RTOL, rel_error

    found = resolve(case)
    if isinstance(found, str):
        return [{"kernel": case.name, "status": found}]
    torch.manual_seed(0)
    try:
        shape, call, reference = case.make(device, dtype, big, found)
        refs = reference()
    except Exception as exc:
        return [{"kernel": case.name, "status": f"setup error: {type(exc).__name__}: {exc}"}]
    rows, first = [], None
    for b in budgets:
        row = {"kernel": case.name, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
               "budget": b}
        try:
            with record_launches() as recs:
                t0 = time.perf_counter()
                outs = call(b)
                sync(device)
                row["ms"] = (time.perf_counter() - t0) * 1e3
            if device.type == "cuda":
                row["ms"] = bench_ms(lambda b=b: call(b), rep_ms=50, device=device)
        except Exception as exc:
            rows.append({**row, "status": f"error: {type(exc).__name__}: {exc}"[:160]})
            continue
        err = max(rel_error(o, r) for o, r in zip(outs, refs, strict=True))
        same = first is None or all(torch.equal(o, p) for o, p in zip(outs, first, strict=True))
        first = first if first is not None else outs
        over = [r for r in recs if not r.within_budget or r.num_sms > b]
        problems = [f"err>{RTOL[dtype]:.0e}"] if not err <= RTOL[dtype] else []
        problems += ["differs across budgets"] if not same else []
        problems += ["over budget"] if over else []
        problems += ["no launch recorded"] if not recs else []
        row.update(programs="+".join(str(r.programs) for r in recs), launches=len(recs),
                   rel_err=err, bitwise_same=same, status="; ".join(problems) or "ok")
        rows.append(row)
    return rows
