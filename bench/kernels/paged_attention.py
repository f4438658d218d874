"""The "paged-attention" section: paged decode / prefill attention on Qwen2-VL-7B heads, bf16.

Hq=28, Hkv=4, D=128, block size 16. Decode is memory-bound, so it is judged in GB/s (K/V bytes
read + q + out) against the device-to-device copy bandwidth measured in the same run:

- batch {1, 8, 32, 128} x context {512, 4096, 32768} at the whole device and at 66 SMs (combos
  over the cache memory cap are skipped);
- an SM sweep (8..132) for batch 32 x 4096;
- a planned decode step replayed from a CUDA graph against the same step launched eagerly;
- causal prefill of a 4096-token prompt against torch SDPA (flash backend).

Every kernel output is checked against a torch reference before it is timed. A decode call is
two launches (split-KV decode, then the merge), so decode rows are timed from a CUDA graph
(``graph`` true: triton.testing.do_bench_cudagraph, no launch gap between the two; replays back
to back, L2 not flushed between them) and carry the host time of one eager call (``host_us``);
prefill rows come from triton.testing.do_bench. Work is skipped, and marked so, once the time
budget is spent.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    bench_ms,
    copy_bandwidth_gbs,
    gbps,
    graph_timed,
    launch_count,
    plot_lines,
    section_rows,
    tflops,
    time_call,
)
from spaceserve.models.presets import get_preset

_TEXT = get_preset("qwen2-vl-7b").text
HQ, HKV, DIM, PAGE = _TEXT.heads, _TEXT.kv_heads, _TEXT.head_dim, 16  # 28, 4, 128
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)
SWEEP = (8, 16, 32, 48, 64, 96, 132)
HALF = 66  # the other budget of the table: half an H200
MAX_CACHE_TOKENS = 1 << 22  # 4M tokens: 8.6 GB of bf16 K+V per layer at these heads
PREFILL_TOKENS = 4096
BF16_RTOL = 1.6e-2


class Budget:
    """Soft time budget: `ok()` turns False once the deadline has passed."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def ok(self, reserve: float = 0.0) -> bool:
        return time.perf_counter() + reserve < self.deadline


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


class Workload:
    """One shared bf16 cache; per case a batch whose pages are scattered over it at random."""

    def __init__(self, cache_tokens: int, device: torch.device, dtype=torch.bfloat16) -> None:
        self.device, self.dtype = device, dtype
        self.num_blocks = cache_tokens // PAGE
        shape = (self.num_blocks, PAGE, HKV, DIM)
        self.k_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def batch(self, lens: list[int]) -> dict[str, Any]:
        pages = [math.ceil(n / PAGE) for n in lens]
        width = max(pages)
        perm = torch.randperm(self.num_blocks, device=self.device, generator=self.gen)
        tables = torch.zeros(len(lens), width, dtype=torch.int32, device=self.device)
        at = 0
        for i, p in enumerate(pages):
            tables[i, :p] = perm[at: at + p].to(torch.int32)
            at += p
        q = torch.randn(len(lens), HQ, DIM, dtype=self.dtype, device=self.device,
                        generator=self.gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return {"q": q, "block_tables": tables, "seq_lens": seq_lens, "lens": lens}


def decode_bytes(lens: list[int], itemsize: int = 2) -> float:
    """K/V bytes read plus q read and out written."""
    return float(sum(lens) * HKV * DIM * 2 * itemsize + 2 * len(lens) * HQ * DIM * itemsize)


def _decode_plan(w: Workload, b: dict[str, Any]):
    from spaceserve.kernels.attention.paged import DecodePlan

    plan = DecodePlan(len(b["lens"]), b["block_tables"].shape[1], HQ, HKV, DIM, PAGE,
                      device=w.device)
    plan.plan(b["lens"])
    return plan


def check_decode(w: Workload, b: dict[str, Any], plan) -> float:
    out = plan.run(b["q"], w.k_cache, w.v_cache, b["block_tables"], b["seq_lens"])
    return _rel(out, _ref_decode(w, b))


def _ref_decode(w: Workload, b: dict[str, Any]) -> torch.Tensor:
    """fp32 reference, one sequence at a time (gathers only that sequence's pages)."""
    out = torch.zeros(b["q"].shape, dtype=torch.float32, device=w.device)
    for i, n in enumerate(b["lens"]):
        pages = b["block_tables"][i, : math.ceil(n / PAGE)].long()
        k = w.k_cache[pages].reshape(-1, HKV, DIM)[:n].float().repeat_interleave(HQ // HKV, 1)
        v = w.v_cache[pages].reshape(-1, HKV, DIM)[:n].float().repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,nhd->hn", b["q"][i].float(), k) / math.sqrt(DIM)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out


def _decode_row(batch: int, ctx: int, sms: int, t: dict[str, Any], copy_gbs: float
                ) -> dict[str, Any]:
    moved, ms = decode_bytes([ctx] * batch), t["ms"]
    return {"kernel": "paged_decode", "batch": batch, "context": ctx, "num_sms": sms, "ms": ms,
            "gbs": gbps(moved, ms), "frac_of_copy": gbps(moved, ms) / copy_gbs, "status": "ok",
            **{k: t[k] for k in ("graph", "timing", "launches", "host_us", "graph_error")
               if k in t}}


def _time_decode(run, batch: int) -> dict[str, Any]:
    """A decode call timed from a CUDA graph (decode + merge are two launches)."""
    launches = launch_count(run)
    return {**time_call(run, graph=graph_timed(batch, launches), warmup_ms=10, rep_ms=25),
            "launches": launches}


def decode_table(w: Workload, rows: list, budget: Budget, copy_gbs: float, full: int) -> None:
    """Every batch x context at the whole device and at 66 SMs."""
    for ctx in CONTEXTS:
        for batch in BATCHES:
            base = {"kernel": "paged_decode", "batch": batch, "context": ctx}
            if batch * ctx > MAX_CACHE_TOKENS:
                rows.append({**base, "status": "skipped (memory cap)"})
                continue
            if not budget.ok(4):
                rows.append({**base, "status": "skipped (time)"})
                continue
            b = w.batch([ctx] * batch)
            plan = _decode_plan(w, b)
            err = check_decode(w, b, plan) if batch * ctx <= (1 << 18) else None
            out = torch.empty_like(b["q"])
            for sms in (full, min(HALF, full)):
                t = _time_decode(lambda sms=sms, b=b, plan=plan, out=out: plan.run(
                    b["q"], w.k_cache, w.v_cache, b["block_tables"], b["seq_lens"], out=out,
                    num_sms=sms), batch)
                row = _decode_row(batch, ctx, sms, t, copy_gbs)
                if err is not None:
                    row.update(rel_err=err, status="ok" if err <= BF16_RTOL else "WRONG")
                rows.append(row)


def decode_sweep(w: Workload, rows: list, budget: Budget, copy_gbs: float, full: int,
                 results_dir: Path) -> None:
    """Latency and GB/s of batch 32 x 4096 as the SM budget shrinks."""
    b = w.batch([4096] * 32)
    plan = _decode_plan(w, b)
    out = torch.empty_like(b["q"])
    timed: dict[int, dict[str, Any]] = {}
    for sms in sorted(SWEEP, reverse=True):
        if sms > full:
            continue
        if not budget.ok(2):
            rows.append({"kernel": "paged_decode_sweep", "num_sms": sms,
                         "status": "skipped (time)"})
            continue
        timed[sms] = _time_decode(lambda sms=sms: plan.run(
            b["q"], w.k_cache, w.v_cache, b["block_tables"], b["seq_lens"], out=out,
            num_sms=sms), 32)
    if not timed:
        return
    times = {sms: t["ms"] for sms, t in timed.items()}
    top = max(times)
    for sms in sorted(times):
        row = _decode_row(32, 4096, sms, timed[sms], copy_gbs)
        row.update(kernel="paged_decode_sweep", scaling_eff=times[top] * top / (sms * times[sms]))
        rows.append(row)
    moved = decode_bytes([4096] * 32)
    plot_lines(results_dir / "paged_decode_sm_sweep.png",
               {"batch 32 x 4096": (sorted(times), [gbps(moved, times[s]) for s in sorted(times)])},
               xlabel="SM budget (programs)", ylabel="GB/s (K/V + q + out)",
               title="paged decode: bandwidth vs SM budget (bf16, Hq 28 / Hkv 4, D 128)")
    rows.append({"kernel": "paged_decode_sweep", "headline": "paged decode 32x4096 GB/s by SMs: "
                 + ", ".join(f"{s}:{gbps(moved, times[s]):.0f}" for s in sorted(times))})


def graph_vs_eager(w: Workload, rows: list, budget: Budget, full: int) -> None:
    """A planned decode step captured once, replayed after a new plan, against eager launches."""
    for batch, ctx in ((32, 4096), (128, 512)):
        if not budget.ok(5):
            rows.append({"kernel": "paged_decode_graph", "batch": batch, "context": ctx,
                         "status": "skipped (time)"})
            continue
        b = w.batch([ctx] * batch)
        plan = _decode_plan(w, b)
        out = torch.empty_like(b["q"])
        args = (b["q"], w.k_cache, w.v_cache, b["block_tables"], b["seq_lens"])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            plan.run(*args, out=out, num_sms=full)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.run(*args, out=out, num_sms=full)
        plan.plan(b["lens"])  # a new plan's contents reach the captured kernels
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = _rel(out, _ref_decode(w, b)) if batch * ctx <= (1 << 18) else None
        te = time_call(lambda plan=plan, args=args, out=out: plan.run(
            *args, out=out, num_sms=full), graph=False, warmup_ms=10, rep_ms=25)
        eager = te["ms"]
        replay = bench_ms(graph.replay, warmup_ms=10, rep_ms=25)
        # "ms"/"graph": the replay of the graph captured here; host_us: one eager call's issue
        row = {"kernel": "paged_decode_graph", "batch": batch, "context": ctx, "num_sms": full,
               "ms": replay, "graph": True, "timing": "graph replay (do_bench)",
               "host_us": te["host_us"], "eager_ms": eager, "graph_ms": replay,
               "speedup": eager / replay, "status": "ok"}
        if err is not None:
            row.update(rel_err=err, status="ok" if err <= BF16_RTOL else "WRONG")
        rows.append(row)
        rows.append({"kernel": "paged_decode_graph", "headline": f"decode {batch}x{ctx}: eager "
                     f"{eager * 1e3:.1f} us, graph replay {replay * 1e3:.1f} us"})


def prefill_vs_sdpa(w: Workload, rows: list, budget: Budget, full: int) -> None:
    """Causal prefill of one 4096-token prompt against SDPA's flash backend (K/V expanded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from spaceserve.kernels.attention.paged import paged_prefill_attention

    if not budget.ok(8):
        rows.append({"kernel": "paged_prefill", "status": "skipped (time)"})
        return
    t = PREFILL_TOKENS
    b = w.batch([t])
    q = torch.randn(t, HQ, DIM, dtype=w.dtype, device=w.device, generator=w.gen)
    cu = torch.tensor([0, t], dtype=torch.int32, device=w.device)
    pages = b["block_tables"][0].long()
    k = w.k_cache[pages].reshape(-1, HKV, DIM)[:t].repeat_interleave(HQ // HKV, 1)
    v = w.v_cache[pages].reshape(-1, HKV, DIM)[:t].repeat_interleave(HQ // HKV, 1)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))

    def sdpa() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def ours(sms: int) -> torch.Tensor:
        return paged_prefill_attention(q, w.k_cache, w.v_cache, b["block_tables"], cu,
                                       b["seq_lens"], num_sms=sms)

    ref = sdpa()[0].transpose(0, 1)
    err = _rel(ours(full), ref)
    flops = 2.0 * t * t * HQ * DIM  # causal: half of 4 * T^2 * H * D
    torch_ms = bench_ms(sdpa, warmup_ms=10, rep_ms=40)
    for sms in (full, min(HALF, full)):
        # one long launch, planned on the host per call: timed eagerly (do_bench)
        tc = time_call(lambda sms=sms: ours(sms), graph=False, warmup_ms=10, rep_ms=40)
        ms = tc["ms"]
        rows.append({"kernel": "paged_prefill", "tokens": t, "num_sms": sms, "ms": ms,
                     "graph": tc["graph"], "timing": tc["timing"], "host_us": tc["host_us"],
                     "tflops": tflops(flops, ms), "sdpa_ms": torch_ms,
                     "sdpa_tflops": tflops(flops, torch_ms), "vs_sdpa": torch_ms / ms,
                     "rel_err_vs_sdpa": err, "status": "ok" if err <= BF16_RTOL else "WRONG"})
    r = rows[-2]
    rows.append({"kernel": "paged_prefill", "headline": f"prefill {t} causal: {r['tflops']:.0f} "
                 f"TFLOP/s vs SDPA flash {r['sdpa_tflops']:.0f} ({r['ms']:.2f} vs "
                 f"{torch_ms:.2f} ms)"})


def _headlines(rows: list[dict], copy_gbs: float, full: int) -> list[dict]:
    out = []
    for sms in (full, min(HALF, full)):
        sel = [r for r in rows if r.get("kernel") == "paged_decode" and r.get("num_sms") == sms
               and "gbs" in r and r["context"] >= 4096]
        if sel:
            out.append({"kernel": "paged_decode", "headline": f"paged decode @{sms} SMs GB/s "
                        f"(copy {copy_gbs:.0f}): " + ", ".join(
                            f"{r['batch']}x{r['context']} {r['gbs']:.0f}" for r in sel)})
    wrong = [r for r in rows if r.get("status") == "WRONG"]
    if wrong:
        out.append({"kernel": "check", "headline": "WRONG results: " + ", ".join(
            f"{r['kernel']} {r.get('batch')}x{r.get('context')}" for r in wrong)})
    return out


def _plot_table(rows: list[dict], results_dir: Path, full: int) -> None:
    series = {}
    for sms in (full, min(HALF, full)):
        for batch in BATCHES:
            sel = [r for r in rows if r.get("kernel") == "paged_decode" and "gbs" in r
                   and r["batch"] == batch and r["num_sms"] == sms]
            if sel:
                series[f"B={batch} @{sms}"] = ([r["context"] for r in sel],
                                               [r["gbs"] for r in sel])
    if series:
        plot_lines(results_dir / "paged_decode_gbs.png", series, xlabel="context (tokens)",
                   ylabel="GB/s (K/V + q + out)", logx=True,
                   title="paged decode bandwidth (bf16, Hq 28 / Hkv 4, D 128, page 16)")


def run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """Benchmark paged attention on CUDA; rows for the harness (JSON + PNGs in results_dir)."""
    results_dir = Path(results_dir)
    if not torch.cuda.is_available():
        return [{"section": "paged-attention", "skipped": "needs a CUDA device"}]
    budget = Budget(time_budget_s)
    full = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth_gbs(1 << 31, rep_ms=50)
    rows = section_rows()  # saved after every row
    rows.append({"kernel": "copy", "gbs": copy["gbs_read_write"], "status": "ok"})
    w = Workload(MAX_CACHE_TOKENS, torch.device("cuda"))
    sections = (
        lambda: decode_table(w, rows, budget, copy["gbs_read_write"], full),
        lambda: decode_sweep(w, rows, budget, copy["gbs_read_write"], full, results_dir),
        lambda: graph_vs_eager(w, rows, budget, full),
        lambda: prefill_vs_sdpa(w, rows, budget, full),
    )
    for section in sections:
        try:
            section()
        except Exception as exc:  # one failing part must not lose the others' rows
            rows.append({"kernel": "paged_attention", "status": f"error: {exc!r}"[:300]})
    _plot_table(rows, results_dir, full)
    return rows + _headlines(rows, copy["gbs_read_write"], full)
