"""The "kernels" section: GEMM and norm kernels on Qwen2-VL-7B shapes in bf16.

- linear and gated_mlp at the whole device against cuBLAS (F.linear) for M=4096 (TFLOP/s) and
  skinny M in {1, 16, 64} (GB/s of weights read, against the device copy bandwidth);
- SM sweeps (8..132 programs) of a compute-bound and a memory-bound GEMM: latency and scaling
  efficiency t(full) * full / (budget * t(budget)) (1.0 = linear in SMs; > 1 = saturates early);
- rms_norm / layer_norm against torch.

Every kernel output is checked against an fp32 torch result before it is timed. Work is skipped,
and marked so, once the time budget is spent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import bench_ms, copy_bandwidth_gbs, gbps, plot_lines, section_rows, tflops

HIDDEN, INTER, V_EMBED, V_MLP = 3584, 18944, 1280, 5120
# (label, N, K) of the projections: LLM o_proj, gate_up, down; vision fc1, fc2.
LINEAR_SHAPES = [("llm_o", HIDDEN, HIDDEN), ("llm_gate_up", 2 * INTER, HIDDEN),
                 ("llm_down", HIDDEN, INTER), ("vis_fc1", V_MLP, V_EMBED),
                 ("vis_fc2", V_EMBED, V_MLP)]
SKINNY_M = (1, 16, 64)
SWEEP = (8, 16, 32, 48, 64, 96, 132)
BF16_RTOL = 1.6e-2


def _kernels() -> dict[str, Any]:
    import spaceserve.kernels as K

    found = {}
    for name, module in (("linear", "linear"), ("gated_mlp", "gated_mlp"),
                         ("rms_norm", "norms"), ("layer_norm", "norms")):
        fn = getattr(K, name, None)
        if fn is None:
            try:
                import importlib

                fn = getattr(importlib.import_module(f"spaceserve.kernels.{module}"), name, None)
            except ImportError:
                fn = None
        if fn is not None:
            found[name] = fn
    return found


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


class Budget:
    """Soft time budget: `ok()` turns False once the deadline has passed."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def ok(self, reserve: float = 0.0) -> bool:
        return time.perf_counter() + reserve < self.deadline


def bench_linear(fn, rows: list, budget: Budget, copy_gbs: float) -> None:
    dev = "cuda"
    for label, n, k in LINEAR_SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        for m in (4096, *SKINNY_M):
            row: dict[str, Any] = {"kernel": "linear", "shape": label, "M": m, "N": n, "K": k}
            if not budget.ok(5):
                rows.append({**row, "status": "skipped (time)"})
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            err = _rel(fn(x, w), F.linear(x.float(), w.float()))
            ours = bench_ms(lambda x=x, w=w: fn(x, w), rep_ms=40)
            torch_ms = bench_ms(lambda x=x, w=w: F.linear(x, w), rep_ms=40)
            row.update(rel_err=err, ms=ours, torch_ms=torch_ms, speedup=torch_ms / ours,
                       status="ok" if err <= BF16_RTOL else "WRONG")
            if m >= 1024:
                row.update(tflops=tflops(2.0 * m * n * k, ours),
                           torch_tflops=tflops(2.0 * m * n * k, torch_ms))
            else:
                row.update(weight_gbs=gbps(2.0 * n * k, ours),
                           torch_weight_gbs=gbps(2.0 * n * k, torch_ms),
                           frac_of_copy=gbps(2.0 * n * k, ours) / copy_gbs)
            rows.append(row)


def bench_gated_mlp(fn, rows: list, budget: Budget) -> None:
    dev = "cuda"
    wgu = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * HIDDEN**-0.5
    wd = torch.randn(HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * INTER**-0.5

    def torch_mlp(x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, wgu).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, wd)

    for m in (4096, *SKINNY_M):
        row: dict[str, Any] = {"kernel": "gated_mlp", "shape": "llm_mlp", "M": m, "N": HIDDEN,
                               "K": HIDDEN}
        if not budget.ok(8):
            rows.append({**row, "status": "skipped (time)"})
            continue
        x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
        gf, uf = F.linear(x.float(), wgu.float()).chunk(2, dim=-1)
        err = _rel(fn(x, wgu, wd), F.linear(F.silu(gf) * uf, wd.float()))
        ours = bench_ms(lambda x=x: fn(x, wgu, wd), rep_ms=40)
        torch_ms = bench_ms(lambda x=x: torch_mlp(x), rep_ms=40)
        flops = 2.0 * m * HIDDEN * INTER * 3
        row.update(rel_err=err, ms=ours, torch_ms=torch_ms, speedup=torch_ms / ours,
                   tflops=tflops(flops, ours), weight_gbs=gbps(2.0 * 3 * HIDDEN * INTER, ours),
                   status="ok" if err <= BF16_RTOL else "WRONG")
        rows.append(row)


def sm_sweep(fn, rows: list, budget: Budget, results_dir: Path) -> None:
    """Latency vs budget of a compute-bound (M=4096 gate_up) and a memory-bound (M=16 down) GEMM."""
    dev = "cuda"
    cases = [("M=4096 gate_up", 4096, 2 * INTER, HIDDEN), ("M=16 down", 16, HIDDEN, INTER)]
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = sorted({b for b in SWEEP if b < total} | {total}, reverse=True)
    series = {}
    for label, m, n, k in cases:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        times: dict[int, float] = {}
        for b in sweep:  # the whole device first: the reference point
            if not budget.ok(3):
                rows.append({"kernel": "linear_sweep", "shape": label, "budget": b,
                             "status": "skipped (time)"})
                continue
            times[b] = bench_ms(lambda b=b, x=x, w=w: fn(x, w, num_sms=b), rep_ms=30)
        full = max(times) if times else None
        for b in sorted(times):
            eff = times[full] * full / (b * times[b])
            rows.append({"kernel": "linear_sweep", "shape": label, "M": m, "N": n, "K": k,
                         "budget": b, "ms": times[b], "scaling_eff": eff, "status": "ok"})
        if times:
            series[label] = (sorted(times), [times[full] * full / (b * times[b])
                                             for b in sorted(times)])
            rows.append({"kernel": "linear_sweep", "shape": label, "headline":
                         f"linear {label}: " + ", ".join(f"{b}SM {times[b]:.3f}ms"
                                                         for b in sorted(times))})
    if series:
        plot_lines(results_dir / "kernels_sm_sweep.png", series, xlabel="SM budget (programs)",
                   ylabel="scaling efficiency  t(132)*132 / (b*t(b))",
                   title="linear: latency scaling with the SM budget (bf16)")


def bench_norms(found: dict, rows: list, budget: Budget) -> None:
    dev = "cuda"
    if "rms_norm" in found and budget.ok(3):
        x = torch.randn(4096, HIDDEN, device=dev, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)

        def torch_rms(x: torch.Tensor) -> torch.Tensor:
            v = x.float()
            return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        err = _rel(found["rms_norm"](x, w, 1e-6), torch_rms(x))
        ours = bench_ms(lambda: found["rms_norm"](x, w, 1e-6), rep_ms=30)
        ref = bench_ms(lambda: torch_rms(x), rep_ms=30)
        rows.append({"kernel": "rms_norm", "shape": "llm", "M": 4096, "K": HIDDEN, "ms": ours,
                     "torch_ms": ref, "speedup": ref / ours, "rel_err": err,
                     "gbs": gbps(2 * 2 * x.numel(), ours),
                     "status": "ok" if err <= BF16_RTOL else "WRONG"})
    if "layer_norm" in found and budget.ok(3):
        x = torch.randn(16384, V_EMBED, device=dev, dtype=torch.bfloat16)
        w = torch.randn(V_EMBED, device=dev, dtype=torch.bfloat16)
        b = torch.randn(V_EMBED, device=dev, dtype=torch.bfloat16)
        err = _rel(found["layer_norm"](x, w, b, 1e-6),
                   F.layer_norm(x.float(), (V_EMBED,), w.float(), b.float(), 1e-6))
        ours = bench_ms(lambda: found["layer_norm"](x, w, b, 1e-6), rep_ms=30)
        ref = bench_ms(lambda: F.layer_norm(x, (V_EMBED,), w, b, 1e-6), rep_ms=30)
        rows.append({"kernel": "layer_norm", "shape": "vision", "M": 16384, "K": V_EMBED,
                     "ms": ours, "torch_ms": ref, "speedup": ref / ours, "rel_err": err,
                     "gbs": gbps(2 * 2 * x.numel(), ours),
                     "status": "ok" if err <= BF16_RTOL else "WRONG"})


def _headlines(rows: list[dict]) -> list[dict]:
    out = []
    big = [r for r in rows if r.get("kernel") == "linear" and r.get("M") == 4096 and "ms" in r]
    if big:
        out.append({"kernel": "linear", "headline": "linear M=4096 TFLOP/s ours/cuBLAS: " +
                    ", ".join(f"{r['shape']} {r['tflops']:.0f}/{r['torch_tflops']:.0f}"
                              for r in big)})
    skinny = [r for r in rows if r.get("kernel") == "linear" and r.get("M") == 16 and "ms" in r]
    if skinny:
        out.append({"kernel": "linear", "headline": "linear M=16 weight GB/s ours/cuBLAS: " +
                    ", ".join(f"{r['shape']} {r['weight_gbs']:.0f}/{r['torch_weight_gbs']:.0f}"
                              for r in skinny)})
    other = [r for r in rows if r.get("kernel") in ("gated_mlp", "rms_norm", "layer_norm")
             and "ms" in r]
    if other:
        out.append({"kernel": "misc", "headline": "speedup vs torch: " + ", ".join(
            f"{r['kernel']} M={r['M']} {r['speedup']:.2f}x" for r in other)})
    wrong = [r for r in rows if r.get("status") == "WRONG"]
    if wrong:
        out.append({"kernel": "check", "headline": "WRONG results: " + ", ".join(
            f"{r['kernel']} {r.get('shape')} M={r.get('M')}" for r in wrong)})
    return out


def run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return [{"section": "kernels", "skipped": "needs a CUDA device"}]
    results_dir = Path(results_dir)
    budget = Budget(time_budget_s)
    found = _kernels()
    rows = section_rows()  # saved after every row
    missing = [k for k in ("linear", "gated_mlp", "rms_norm", "layer_norm") if k not in found]
    if missing:
        rows.append({"kernel": ",".join(missing), "status": "not available"})
    copy_gbs = copy_bandwidth_gbs(1 << 28, rep_ms=50)["gbs_read_write"]
    rows.append({"kernel": "copy", "gbs": copy_gbs, "status": "ok"})
    if "linear" in found:
        bench_linear(found["linear"], rows, budget, copy_gbs)
    if "gated_mlp" in found:
        bench_gated_mlp(found["gated_mlp"], rows, budget)
    bench_norms(found, rows, budget)
    if "linear" in found:
        sm_sweep(found["linear"], rows, budget, results_dir)
    return rows + _headlines(rows)
