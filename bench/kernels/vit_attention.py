"""The "vit-attention" section: varlen ViT attention on Qwen2-VL vision heads, bf16, H=16, D=80.

Workloads (vision tokens = 14-px patches): one 448x448 image (1024), one 1024x1024 (5476), one
1920x1080 (10764), a mixed batch of 8 images, and 1920x1080 cut in 64-token windows (Qwen2.5-VL).

- at the whole device: `vit_attention` with a host plan (LPT work list) and with the device-only
  work list, against torch SDPA (flash backend) looped over the segments and torch's varlen flash
  attention where the installed torch has one; `speedup_vs_best_peer` = best peer ms / ours;
- an SM sweep (8..132) of latency and TFLOP/s (4 * sum(L^2) * H * D flops);
- fused rotary against `apply_rotary` + attention on 1920x1080.

Every output is checked against an fp32 SDPA reference before it is timed; medians come from
triton.testing.do_bench; work is skipped, and marked so, once the time budget is spent. Nothing
runs without CUDA.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import bench_ms, plot_lines, section_rows, tflops, write_json
from spaceserve.models.presets import get_preset

_VISION = get_preset("qwen2-vl-7b").vision  # every Qwen2-VL / Qwen2.5-VL tower's heads
HEADS, DIM = _VISION.heads, _VISION.embed // _VISION.heads  # 16, 80
SWEEP = (8, 16, 32, 48, 64, 96, 132)
BF16_RTOL = 1.6e-2
WORKLOADS: dict[str, list[int]] = {
    "448x448": [1024],
    "1024x1024": [5476],
    "1920x1080": [10764],
    "mixed8": [1024, 4784, 5476, 10764, 1024, 2304, 4784, 1024],
    "1920x1080_win64": [64] * 168 + [12],
}


class Budget:
    """Soft time budget: `ok(reserve)` turns False once less than `reserve` seconds remain."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def ok(self, reserve: float = 0.0) -> bool:
        return time.perf_counter() + reserve < self.deadline


def attention_flops(lens: list[int]) -> float:
    return 4.0 * sum(n * n for n in lens) * HEADS * DIM


class Case:
    """Inputs of one workload on the GPU, its host cu_seqlens and an fp32 reference."""

    def __init__(self, name: str, lens: list[int], device: torch.device) -> None:
        self.name, self.lens = name, lens
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        self.cu_host = torch.tensor(offsets, dtype=torch.int32)
        self.cu = self.cu_host.to(device)
        self.max_len = max(lens)
        total = offsets[-1]
        gen = torch.Generator(device=device).manual_seed(0)
        self.q, self.k, self.v = (torch.randn(total, HEADS, DIM, device=device, generator=gen,
                                              dtype=torch.bfloat16) for _ in range(3))
        self.out = torch.empty_like(self.q)
        self.flops = attention_flops(lens)

    def segments(self):
        bounds = self.cu_host.tolist()
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def reference(self, q=None, k=None) -> torch.Tensor:
        q = self.q if q is None else q
        k = self.k if k is None else k
        out = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        for s, e in self.segments():
            qs, ks, vs = (t[s:e].float().transpose(0, 1)[None] for t in (q, k, self.v))
            out[s:e] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)[0].transpose(
                0, 1)
        return out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _sdpa_loop(c: Case) -> Callable[[], Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    views = [tuple(t[s:e].transpose(0, 1)[None] for t in (c.q, c.k, c.v))
             for s, e in c.segments()]

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return [torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    for q, k, v in views]

    def gather() -> torch.Tensor:
        return torch.cat([o[0].transpose(0, 1) for o in run()], 0)

    run.gather = gather  # type: ignore[attr-defined]
    return run


def _varlen_peer(c: Case) -> tuple[str, Callable[[], torch.Tensor]] | None:
    """torch's varlen flash attention: torch.nn.attention.varlen, else the aten op."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        def run():
            return varlen_attn(c.q, c.k, c.v, c.cu, c.cu, c.max_len, c.max_len)

        run()
        return "torch varlen_attn", run
    except Exception:  # absent or unsupported here: try the aten op
        pass
    try:
        op = torch.ops.aten._flash_attention_forward

        def run_op():
            return op(c.q, c.k, c.v, c.cu, c.cu, c.max_len, c.max_len, 0.0, False, False)[0]

        run_op()
        return "aten _flash_attention_forward", run_op
    except Exception:
        return None


def _ours(c: Case, plan, sms: int, **kw) -> Callable[[], torch.Tensor]:
    from spaceserve.kernels.attention.vit import vit_attention

    return lambda: vit_attention(c.q, c.k, c.v, c.cu, c.max_len, num_sms=sms, plan=plan,
                                 out=c.out, **kw)


def full_device(c: Case, rows: list, budget: Budget, full: int, plan) -> None:
    """Ours (plan, device work list) against the peers at the whole device."""
    ref = c.reference()
    base = {"workload": c.name, "tokens": sum(c.lens), "segments": len(c.lens), "num_sms": full}
    mine: dict[str, float] = {}
    for label, fn in (("spaceserve plan", _ours(c, plan, full)),
                      ("spaceserve device worklist", _ours(c, None, full, device_worklist=True))):
        err = _rel(fn(), ref)
        ms = bench_ms(fn, warmup_ms=10, rep_ms=50)
        mine[label] = ms
        rows.append({**base, "impl": label, "ms": ms, "tflops": tflops(c.flops, ms),
                     "rel_err": err, "status": "ok" if err <= BF16_RTOL else "WRONG"})
    peers: dict[str, float] = {}
    try:
        sdpa = _sdpa_loop(c)
        err = _rel(sdpa.gather(), ref)
        peers["torch sdpa flash loop"] = bench_ms(sdpa, warmup_ms=10, rep_ms=50)
        rows.append({**base, "impl": "torch sdpa flash loop", "ms": peers["torch sdpa flash loop"],
                     "tflops": tflops(c.flops, peers["torch sdpa flash loop"]), "rel_err": err,
                     "status": "ok"})
    except Exception as e:
        rows.append({**base, "impl": "torch sdpa flash loop", "status": f"unavailable: {e}"[:120]})
    varlen = _varlen_peer(c) if budget.ok(3) else None
    if varlen is not None:
        name, fn = varlen
        peers[name] = bench_ms(fn, warmup_ms=10, rep_ms=50)
        rows.append({**base, "impl": name, "ms": peers[name],
                     "tflops": tflops(c.flops, peers[name]), "rel_err": _rel(fn(), ref),
                     "status": "ok"})
    else:
        rows.append({**base, "impl": "torch varlen", "status": "unavailable or skipped"})
    ours = mine["spaceserve plan"]
    if peers:
        best = min(peers, key=peers.get)
        ratio = peers[best] / ours
        rows.append({**base, "impl": "summary", "ms": ours, "tflops": tflops(c.flops, ours),
                     "best_peer": best, "best_peer_ms": peers[best],
                     "speedup_vs_best_peer": ratio,
                     "headline": f"vit_attention {c.name}: {ours:.3f} ms "
                                 f"({tflops(c.flops, ours):.0f} TFLOP/s), {ratio:.2f}x {best}"})


def sm_sweep(c: Case, rows: list, budget: Budget, full: int, plan,
             sweep: tuple[int, ...] = SWEEP) -> dict[int, float]:
    times: dict[int, float] = {}
    for sms in sweep:
        if sms > full:
            continue
        if not budget.ok(2):
            rows.append({"workload": c.name, "impl": "sweep", "num_sms": sms,
                         "status": "skipped (time)"})
            continue
        times[sms] = bench_ms(_ours(c, plan, sms), warmup_ms=5, rep_ms=30)
    if times:
        top = max(times)
        for sms in sorted(times):
            rows.append({"workload": c.name, "impl": "sweep", "num_sms": sms, "ms": times[sms],
                         "tflops": tflops(c.flops, times[sms]),
                         "scaling_eff": times[top] * top / (sms * times[sms]), "status": "ok"})
    return times


def rotary_fused_vs_separate(c: Case, rows: list, full: int, plan) -> None:
    """Fused rotate-half RoPE in the attention loads against apply_rotary + attention."""
    from spaceserve.kernels.attention.vit import vit_attention
    from spaceserve.kernels.rotary import apply_rotary

    total = c.q.shape[0]
    angles = torch.rand(total, DIM // 2, device=c.q.device) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q2, k2 = c.q.clone(), c.k.clone()

    def separate():
        q2.copy_(c.q)
        k2.copy_(c.k)
        apply_rotary(q2, k2, cos, sin, num_sms=full)
        return vit_attention(q2, k2, c.v, c.cu, c.max_len, num_sms=full, plan=plan, out=c.out)

    fused = _ours(c, plan, full, cos=cos, sin=sin)
    err = _rel(fused(), c.reference(*_rope(c, cos, sin)))
    sep = separate().clone()
    same = _rel(fused(), sep.float())
    copy_ms = bench_ms(lambda: (q2.copy_(c.q), k2.copy_(c.k)), warmup_ms=5, rep_ms=20)
    sep_ms = bench_ms(separate, warmup_ms=10, rep_ms=50) - copy_ms
    fused_ms = bench_ms(fused, warmup_ms=10, rep_ms=50)
    rows.append({"workload": c.name, "impl": "rotary fused vs separate", "num_sms": full,
                 "fused_ms": fused_ms, "separate_ms": sep_ms, "fused_speedup": sep_ms / fused_ms,
                 "rel_err": err, "rel_diff_fused_vs_separate": same,
                 "status": "ok" if err <= BF16_RTOL else "WRONG",
                 "headline": f"vit_attention rotary {c.name}: fused {fused_ms:.3f} ms vs "
                             f"apply_rotary+attention {sep_ms:.3f} ms"})


def _rope(c: Case, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = DIM // 2
    out = []
    for x in (c.q, c.k):
        xf = x.float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        out.append((xf * cos[:, None] + rot * sin[:, None]).to(x.dtype))
    return out[0], out[1]


def run(results_dir: str | Path, time_budget_s: float) -> list[dict]:
    """Measure the section; writes vit_attention.json and an SM-sweep PNG into results_dir."""
    if not torch.cuda.is_available():
        return [{"section": "vit-attention", "skipped": "needs a CUDA device"}]
    dev = torch.device("cuda")
    full = torch.cuda.get_device_properties(dev).multi_processor_count
    return measure(Path(results_dir), time_budget_s, dev, full, WORKLOADS, SWEEP)


def measure(results_dir: Path, time_budget_s: float, dev: torch.device, full: int,
            workloads: dict[str, list[int]], sweep: tuple[int, ...],
            rotary_case: str = "1920x1080") -> list[dict]:
    """The measurements of `run` on `dev` with `full` SMs (separate so shapes can shrink)."""
    from spaceserve.kernels.attention.vit import plan_vit_attention

    budget = Budget(time_budget_s)
    rows = section_rows()  # saved after every row
    cases: dict[str, tuple[Case, Any]] = {}
    for name, lens in workloads.items():
        if not budget.ok(6):
            rows.append({"workload": name, "status": "skipped (time)"})
            continue
        c = Case(name, lens, dev)
        plan = plan_vit_attention(c.cu_host, HEADS, DIM, dtype=torch.bfloat16, device=dev)
        cases[name] = (c, plan)
        try:
            full_device(c, rows, budget, full, plan)
        except Exception as e:  # keep the other workloads
            rows.append({"workload": name, "status": f"error: {e}"[:200]})
    sweeps: dict[str, dict[int, float]] = {}
    for name, (c, plan) in cases.items():
        if name.endswith("win64"):
            continue
        sweeps[name] = sm_sweep(c, rows, budget, full, plan, sweep)
    if rotary_case in cases and budget.ok(8):
        try:
            rotary_fused_vs_separate(cases[rotary_case][0], rows, full, cases[rotary_case][1])
        except Exception as e:
            rows.append({"workload": rotary_case, "impl": "rotary fused vs separate",
                         "status": f"error: {e}"[:200]})
    series = {}
    for name, times in sweeps.items():
        if times:
            c = cases[name][0]
            xs = sorted(times)
            series[name] = (xs, [tflops(c.flops, times[s]) for s in xs])
            rows.append({"workload": name, "impl": "sweep summary",
                         "headline": f"vit_attention {name} TFLOP/s by SMs: " + ", ".join(
                             f"{s}:{tflops(c.flops, times[s]):.0f}" for s in xs)})
    if series:
        plot_lines(results_dir / "vit_attention_sm_sweep.png", series,
                   xlabel="SM budget (programs)", ylabel="TFLOP/s",
                   title=f"vit_attention bf16 H={HEADS} D={DIM}: TFLOP/s vs SM budget")
    write_json(results_dir / "vit_attention.json", rows)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="bench/results")
    parser.add_argument("--time-budget-s", type=float, default=60.0)
    args = parser.parse_args()
    for row in run(args.results_dir, args.time_budget_s):
        print({k: (f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else v)
               for k, v in row.items()})
