"""The "kernels" section: GEMM and norm kernels on Qwen2-VL-7B shapes in bf16.

- linear and gated_mlp at the whole device against cuBLAS (F.linear) for M=4096 (TFLOP/s) and
  skinny M in {1, 16, 64} (GB/s of weights read, against the device copy bandwidth);
- SM sweeps (8..132 programs) of a compute-bound and a memory-bound GEMM: latency and scaling
  efficiency t(full) * full / (budget * t(budget)) (1.0 = linear in SMs; > 1 = saturates early);
- rms_norm / layer_norm against torch, at a prefill shape and a decode shape (M=32).

Every kernel row says how it was timed: decode shapes (M <= 64) and multi-launch ops (split-K
+ reduce, gated MLP) replay from a CUDA graph (``graph`` true: `bench.common.time_call`, no
launch gaps), the rest through do_bench; the torch reference of a row is timed the same way.
``host_us`` is the host time of one eager call: the launcher's own cost, which a graph hides.
Every kernel output is checked against an fp32 torch result before it is timed. Work is skipped,
and marked so, once the time budget is spent. The dry run (`dry_run`) runs the same code on tiny
shapes through the Triton interpreter on the CPU, so its rows show the columns.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    copy_bandwidth_gbs,
    gbps,
    graph_timed,
    launch_count,
    plot_lines,
    section_rows,
    tflops,
    time_call,
)

MODEL = "qwen2-vl-7b"  # the preset whose shapes the GPU run measures


def preset_dims(key: str = MODEL) -> tuple[int, int, int, int]:
    """(LLM hidden, LLM intermediate, vision width, vision MLP width) of a model preset."""
    from spaceserve.models.presets import get_preset

    p = get_preset(key)
    return p.text.hidden, p.text.intermediate, p.vision.embed, p.vision.intermediate


HIDDEN, INTER, V_EMBED, V_MLP = preset_dims()  # Qwen2-VL-7B: 3584, 18944, 1280, 5120
# (label, N, K) of the projections: LLM o_proj, gate_up, down; vision fc1, fc2.
LINEAR_SHAPES = [("llm_o", HIDDEN, HIDDEN), ("llm_gate_up", 2 * INTER, HIDDEN),
                 ("llm_down", HIDDEN, INTER), ("vis_fc1", V_MLP, V_EMBED),
                 ("vis_fc2", V_EMBED, V_MLP)]
SKINNY_M = (1, 16, 64)
SWEEP = (8, 16, 32, 48, 64, 96, 132)
BF16_RTOL = 1.6e-2


@dataclass(frozen=True)
class Shapes:
    """What a run measures: the GPU's Qwen2-VL-7B shapes in bf16, or tiny ones on the CPU."""

    device: str
    dtype: torch.dtype
    linear: tuple[tuple[str, int, int], ...]
    big_m: int
    skinny_m: tuple[int, ...]
    mlp: tuple[int, int]  # hidden, intermediate
    mlp_m: tuple[int, ...]
    norm_rows: tuple[int, ...]  # rms_norm at (rows, hidden), layer_norm at (rows, vision)
    norm_k: tuple[int, int]
    sweep: tuple[int, ...]
    sweep_cases: tuple[tuple[str, int, int, int], ...]
    rep_ms: float
    copy_bytes: int
    rtol: float


GPU = Shapes("cuda", torch.bfloat16, tuple(LINEAR_SHAPES), 4096, SKINNY_M, (HIDDEN, INTER),
             (4096, *SKINNY_M), (4096, 32), (HIDDEN, V_EMBED), SWEEP,
             (("M=4096 gate_up", 4096, 2 * INTER, HIDDEN), ("M=16 down", 16, HIDDEN, INTER)),
             40, 1 << 28, BF16_RTOL)
CPU = Shapes("cpu", torch.float32, (("llm_down", 32, 96),), 96, (16,), (16, 24), (4,), (8,),
             (32, 24), (4, 132), (("M=16 down", 16, 32, 96),), 1, 1 << 16, 1e-4)


def _kernels() -> dict[str, Any]:
    import spaceserve.kernels as K

    return {name: getattr(K, name) for name in ("linear", "gated_mlp", "rms_norm", "layer_norm")
            if getattr(K, name, None) is not None}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


class Budget:
    """Soft time budget: `ok()` turns False once the deadline has passed."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def ok(self, reserve: float = 0.0) -> bool:
        return time.perf_counter() + reserve < self.deadline


def timed(ours, ref, m: int, sh: Shapes) -> dict[str, Any]:
    """Our call and its torch reference timed the same way (graph for decode shapes and
    multi-launch ops): ms, torch_ms, speedup, graph, launches, host_us, torch_host_us."""
    launches = launch_count(ours)
    graph = graph_timed(m, launches)
    a = time_call(ours, graph=graph, rep_ms=sh.rep_ms, device=sh.device)
    b = time_call(ref, graph=graph, rep_ms=sh.rep_ms, device=sh.device)
    row = {"ms": a["ms"], "torch_ms": b["ms"], "speedup": b["ms"] / a["ms"],
           "graph": a["graph"], "timing": a["timing"], "launches": launches,
           "host_us": a["host_us"], "torch_host_us": b["host_us"]}
    if "graph_error" in a:
        row["graph_error"] = a["graph_error"]
    return row


def bench_linear(fn, rows: list, budget: Budget, copy_gbs: float, sh: Shapes) -> None:
    for label, n, k in sh.linear:
        w = torch.randn(n, k, device=sh.device, dtype=sh.dtype) * k**-0.5
        for m in (sh.big_m, *sh.skinny_m):
            row: dict[str, Any] = {"kernel": "linear", "shape": label, "M": m, "N": n, "K": k}
            if not budget.ok(5 if sh is GPU else 0.5):
                rows.append({**row, "status": "skipped (time)"})
                continue
            x = torch.randn(m, k, device=sh.device, dtype=sh.dtype)
            err = _rel(fn(x, w), F.linear(x.float(), w.float()))
            row.update(timed(lambda x=x, w=w: fn(x, w), lambda x=x, w=w: F.linear(x, w), m, sh))
            row.update(rel_err=err, status="ok" if err <= sh.rtol else "WRONG")
            ours, ref = row["ms"], row["torch_ms"]
            if m == sh.big_m:  # the compute-bound row
                row.update(tflops=tflops(2.0 * m * n * k, ours),
                           torch_tflops=tflops(2.0 * m * n * k, ref))
            else:
                item = torch.empty((), dtype=sh.dtype).element_size()
                row.update(weight_gbs=gbps(item * n * k, ours),
                           torch_weight_gbs=gbps(item * n * k, ref),
                           frac_of_copy=gbps(item * n * k, ours) / copy_gbs)
            rows.append(row)


def bench_gated_mlp(fn, rows: list, budget: Budget, sh: Shapes) -> None:
    hidden, inter = sh.mlp
    wgu = torch.randn(2 * inter, hidden, device=sh.device, dtype=sh.dtype) * hidden**-0.5
    wd = torch.randn(hidden, inter, device=sh.device, dtype=sh.dtype) * inter**-0.5

    def torch_mlp(x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, wgu).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, wd)

    item = torch.empty((), dtype=sh.dtype).element_size()
    for m in sh.mlp_m:
        row: dict[str, Any] = {"kernel": "gated_mlp", "shape": "llm_mlp", "M": m, "N": hidden,
                               "K": hidden}
        if not budget.ok(8 if sh is GPU else 0.5):
            rows.append({**row, "status": "skipped (time)"})
            continue
        x = torch.randn(m, hidden, device=sh.device, dtype=sh.dtype)
        gf, uf = F.linear(x.float(), wgu.float()).chunk(2, dim=-1)
        err = _rel(fn(x, wgu, wd), F.linear(F.silu(gf) * uf, wd.float()))
        row.update(timed(lambda x=x: fn(x, wgu, wd), lambda x=x: torch_mlp(x), m, sh))
        flops = 2.0 * m * hidden * inter * 3
        row.update(rel_err=err, tflops=tflops(flops, row["ms"]),
                   weight_gbs=gbps(item * 3 * hidden * inter, row["ms"]),
                   status="ok" if err <= sh.rtol else "WRONG")
        rows.append(row)


def sm_sweep(fn, rows: list, budget: Budget, results_dir: Path, sh: Shapes) -> None:
    """Latency vs budget of a compute-bound and a memory-bound GEMM."""
    from spaceserve.kernels.budget import device_num_sms

    total = device_num_sms(sh.device)
    sweep = sorted({b for b in sh.sweep if b < total} | {total}, reverse=True)
    series = {}
    for label, m, n, k in sh.sweep_cases:
        x = torch.randn(m, k, device=sh.device, dtype=sh.dtype)
        w = torch.randn(n, k, device=sh.device, dtype=sh.dtype) * k**-0.5
        launches = launch_count(lambda x=x, w=w: fn(x, w))
        times: dict[int, dict[str, Any]] = {}
        for b in sweep:  # the whole device first: the reference point
            if not budget.ok(3 if sh is GPU else 0.3):
                rows.append({"kernel": "linear_sweep", "shape": label, "budget": b,
                             "status": "skipped (time)"})
                continue
            times[b] = time_call(lambda b=b, x=x, w=w: fn(x, w, num_sms=b),
                                 graph=graph_timed(m, launches), rep_ms=sh.rep_ms * 0.75,
                                 device=sh.device)
        full = max(times) if times else None
        for b in sorted(times):
            t = times[b]
            eff = times[full]["ms"] * full / (b * t["ms"])
            rows.append({"kernel": "linear_sweep", "shape": label, "M": m, "N": n, "K": k,
                         "budget": b, "ms": t["ms"], "scaling_eff": eff, "graph": t["graph"],
                         "timing": t["timing"], "launches": launches, "host_us": t["host_us"],
                         "status": "ok"})
        if times:
            ms = {b: times[b]["ms"] for b in times}
            series[label] = (sorted(ms), [ms[full] * full / (b * ms[b]) for b in sorted(ms)])
            rows.append({"kernel": "linear_sweep", "shape": label, "headline":
                         f"linear {label}: " + ", ".join(f"{b}SM {ms[b]:.3f}ms"
                                                         for b in sorted(ms))})
    if series:
        plot_lines(results_dir / "kernels_sm_sweep.png", series, xlabel="SM budget (programs)",
                   ylabel="scaling efficiency  t(full)*full / (b*t(b))",
                   title=f"linear: latency scaling with the SM budget ({sh.dtype})")


def bench_norms(found: dict, rows: list, budget: Budget, sh: Shapes) -> None:
    k_llm, k_vis = sh.norm_k
    item = torch.empty((), dtype=sh.dtype).element_size()
    for m in sh.norm_rows:
        if "rms_norm" in found and budget.ok(3 if sh is GPU else 0.3):
            x = torch.randn(m, k_llm, device=sh.device, dtype=sh.dtype)
            w = torch.randn(k_llm, device=sh.device, dtype=sh.dtype)

            def torch_rms(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                v = x.float()
                return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

            err = _rel(found["rms_norm"](x, w, 1e-6), torch_rms())
            row = {"kernel": "rms_norm", "shape": "llm", "M": m, "K": k_llm, "rel_err": err,
                   **timed(lambda x=x, w=w: found["rms_norm"](x, w, 1e-6), torch_rms, m, sh)}
            row.update(gbs=gbps(2 * item * x.numel(), row["ms"]),
                       status="ok" if err <= sh.rtol else "WRONG")
            rows.append(row)
        if "layer_norm" in found and budget.ok(3 if sh is GPU else 0.3):
            rows_vis = m * 4  # vision tokens: four per LLM token
            x = torch.randn(rows_vis, k_vis, device=sh.device, dtype=sh.dtype)
            w = torch.randn(k_vis, device=sh.device, dtype=sh.dtype)
            b = torch.randn(k_vis, device=sh.device, dtype=sh.dtype)
            err = _rel(found["layer_norm"](x, w, b, 1e-6),
                       F.layer_norm(x.float(), (k_vis,), w.float(), b.float(), 1e-6))
            row = {"kernel": "layer_norm", "shape": "vision", "M": rows_vis, "K": k_vis,
                   "rel_err": err,
                   **timed(lambda x=x, w=w, b=b: found["layer_norm"](x, w, b, 1e-6),
                           lambda x=x, w=w, b=b: F.layer_norm(x, (k_vis,), w, b, 1e-6),
                           rows_vis, sh)}
            row.update(gbs=gbps(2 * item * x.numel(), row["ms"]),
                       status="ok" if err <= sh.rtol else "WRONG")
            rows.append(row)


def _headlines(rows: list[dict], sh: Shapes) -> list[dict]:
    out = []
    big = [r for r in rows if r.get("kernel") == "linear" and r.get("M") == sh.big_m
           and "ms" in r]
    if big:
        out.append({"kernel": "linear", "headline": f"linear M={sh.big_m} TFLOP/s ours/cuBLAS: "
                    + ", ".join(f"{r['shape']} {r['tflops']:.3g}/{r['torch_tflops']:.3g}"
                                for r in big)})
    skinny = [r for r in rows if r.get("kernel") == "linear" and r.get("M") == 16 and "ms" in r]
    if skinny:
        how = "graph-timed" if all(r["graph"] for r in skinny) else "timed as 'timing' says"
        out.append({"kernel": "linear", "headline": f"linear M=16 weight GB/s ours/cuBLAS "
                    f"({how}; host us per call): " + ", ".join(
                        f"{r['shape']} {r['weight_gbs']:.3g}/{r['torch_weight_gbs']:.3g} "
                        f"({r['host_us']:.0f} us)" for r in skinny)})
    other = [r for r in rows if r.get("kernel") in ("gated_mlp", "rms_norm", "layer_norm")
             and "ms" in r]
    if other:
        out.append({"kernel": "misc", "headline": "speedup vs torch: " + ", ".join(
            f"{r['kernel']} M={r['M']}{' (graph)' if r['graph'] else ''} {r['speedup']:.2f}x"
            for r in other)})
    wrong = [r for r in rows if r.get("status") == "WRONG"]
    if wrong:
        out.append({"kernel": "check", "headline": "WRONG results: " + ", ".join(
            f"{r['kernel']} {r.get('shape')} M={r.get('M')}" for r in wrong)})
    return out


def measure(results_dir: Path, time_budget_s: float, sh: Shapes) -> list[dict[str, Any]]:
    """Every part of the section on the shapes `sh`; rows saved as they come."""
    results_dir = Path(results_dir)
    budget = Budget(time_budget_s)
    found = _kernels()
    rows = section_rows()  # saved after every row
    missing = [k for k in ("linear", "gated_mlp", "rms_norm", "layer_norm") if k not in found]
    if missing:
        rows.append({"kernel": ",".join(missing), "status": "not available"})
    copy_gbs = copy_bandwidth_gbs(sh.copy_bytes, device=sh.device, rep_ms=50 if sh is GPU
                                  else 5)["gbs_read_write"]
    rows.append({"kernel": "copy", "gbs": copy_gbs, "status": "ok"})
    parts = []
    if "linear" in found:
        parts.append(lambda: bench_linear(found["linear"], rows, budget, copy_gbs, sh))
    if "gated_mlp" in found:
        parts.append(lambda: bench_gated_mlp(found["gated_mlp"], rows, budget, sh))
    parts.append(lambda: bench_norms(found, rows, budget, sh))
    if "linear" in found:
        parts.append(lambda: sm_sweep(found["linear"], rows, budget, results_dir, sh))
    for part in parts:
        try:
            part()
        except Exception as exc:  # one failing part must not lose the others' rows
            rows.append({"kernel": "kernels", "status": f"error: {exc!r}"[:300]})
    return rows + _headlines(rows, sh)


def run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return [{"section": "kernels", "skipped": "needs a CUDA device"}]
    return measure(Path(results_dir), time_budget_s, GPU)


def dry_run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The dry run: the same parts on tiny fp32 shapes through the Triton interpreter (set here,
    before the kernels are imported; this is the section's own process)."""
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    return measure(Path(results_dir), time_budget_s, CPU)
