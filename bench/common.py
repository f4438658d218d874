"""Timing and reporting helpers shared by the benchmark modules and the GPU harness.

Times are medians in milliseconds. On CUDA they come from `triton.testing.do_bench` (which
flushes L2 between calls and syncs the device), or, for decode-shape and multi-launch calls
(`graph_timed`), from `triton.testing.do_bench_cudagraph` (the call replayed from a CUDA graph:
no launch gaps between its kernels, no host time; replays back to back, so L2 is not flushed
between them); on CPU from wall-clock repeats. `time_call` also reports the host time of one
eager call (the launcher's own cost) as ``host_us``. Nothing here imports a kernel module at
import time, so the demo can set TRITON_INTERPRET before kernels are imported.
`bench_ms`, `sync` and `format_table` live in the package (`spaceserve.bench.measure`, used by
the kernel demo), `pyplot` in `spaceserve.plotting` and the section rows (`Rows`,
`section_rows`, `write_json`) in the torch-free `bench.rows`; they are re-exported here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.rows import Rows, bind_section_rows, section_rows, write_json
from spaceserve.bench.measure import bench_ms, format_table, sync
from spaceserve.plotting import pyplot

__all__ = ["BENCH_GRAPH_RESERVE_BYTES", "DRY_MODEL", "GRAPH_MAX_M", "Rows", "bench_ms",
           "bind_section_rows", "copy_bandwidth_gbs", "format_table", "gbps", "graph_memory",
           "graph_timed", "launch_count", "matmul_tflops", "model_len_for", "plot_lines", "pyplot",
           "register_dry_model", "section_rows", "sync", "tflops", "time_call", "write_json"]

GRAPH_MAX_M = 64  # rows (tokens, sequences) up to which a call is a decode shape: graph-timed
# Decode-graph memory bound of the benchmark engines (EngineConfig.graph_reserve_bytes): the torch
# backend's graphs (the shared baseline) gather and upcast their block tables' pages, ~1.2 GiB
# at batch 48 x 4096 tokens; 4 GiB of an H200's 141 leaves room for every split's graphs.
BENCH_GRAPH_RESERVE_BYTES = 4 << 30
DRY_MODEL = "qwen2-vl-tiny-random"  # the dry runs' random-weight model (`register_dry_model`)


def gbps(nbytes: float, ms: float) -> float:
    """GB/s (1e9 bytes per second) for `nbytes` moved in `ms` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else math.nan


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s for `flops` in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else math.nan


def model_len_for(*lengths: int, floor: int = 256) -> int:
    """`max_model_len` for a benchmark whose longest request holds `max(lengths)` tokens
    (prompt + output): the next power of two. Decode graphs and block tables are sized from it,
    so an engine sized to its workload, not to the model's 32k context, pays for what it runs."""
    need = max(floor, *lengths)
    return 1 << (need - 1).bit_length()


def launch_count(fn: Callable[[], Any]) -> int:
    """How many SpaceServe kernel launches one call of `fn` makes (its launch records)."""
    from spaceserve.kernels import record_launches

    with record_launches() as recs:
        fn()
    return len(recs)


def graph_timed(m: int | None, launches: int = 1) -> bool:
    """Whether a call is timed from a CUDA graph: a decode shape (at most `GRAPH_MAX_M` rows),
    whose kernels are short enough for launch gaps to show, or a multi-launch op (split-K +
    reduce, gated MLP, decode + merge), whose kernels would otherwise wait on each other's
    launches."""
    return (m is not None and m <= GRAPH_MAX_M) or launches > 1


def time_call(fn: Callable[[], Any], *, graph: bool, rep_ms: float = 40,
              warmup_ms: float = 10, device: torch.device | str | None = None,
              host_reps: int = 20) -> dict[str, Any]:
    """One call of `fn` timed: ``{"ms": device time, "graph": whether it was replayed from a
    CUDA graph, "host_us": host time of one eager call, "timing": how}``.

    `graph` (on CUDA) times it with `triton.testing.do_bench_cudagraph` (median; an op whose
    capture fails is timed eagerly and says why in ``graph_error``), else with `bench_ms`.
    ``host_us`` is the median wall time of issuing one eager call on an idle device (no sync
    inside it): what the launcher itself costs the host. On CPU both are wall-clock times of
    the call (the dry run: nothing is graph-timed)."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda":  # the call runs on the host: repeats until rep_ms, no warm-up
        times: list[float] = []
        start = time.perf_counter()
        while not times or (time.perf_counter() - start) * 1e3 < rep_ms:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = sorted(times)[len(times) // 2]
        return {"ms": ms, "graph": False, "host_us": ms * 1e3, "timing": "wall (CPU)"}
    fn()
    host = []
    for _ in range(max(1, host_reps)):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize(dev)
    out: dict[str, Any] = {"host_us": sorted(host)[len(host) // 2] * 1e6}
    if graph:
        from triton.testing import do_bench_cudagraph

        try:
            ms = float(do_bench_cudagraph(fn, rep=max(1, int(rep_ms)), return_mode="median"))
            return {"ms": ms, "graph": True, **out, "timing": "cuda-graph"}
        except Exception as exc:  # timed eagerly below; the row says why
            torch.cuda.synchronize(dev)
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    ms = bench_ms(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, device=dev)
    return {"ms": ms, "graph": False, **out, "timing": "do_bench"}


def copy_bandwidth_gbs(nbytes: int = 1 << 30, device: torch.device | str = "cuda",
                       rep_ms: float = 200) -> dict[str, float]:
    """Device-to-device copy of `nbytes`: GB/s counting the read and the write (2 x nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms=rep_ms, device=device)
    return {"bytes": float(nbytes), "ms": ms, "gbs_read_write": gbps(2 * nbytes, ms)}


def matmul_tflops(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cuda", rep_ms: float = 200) -> dict[str, float]:
    """torch.matmul [m, k] x [k, n] on random data: median ms and TFLOP/s."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    ms = bench_ms(lambda: torch.matmul(a, b), rep_ms=rep_ms, device=device)
    return {"m": m, "n": n, "k": k, "ms": ms, "tflops": tflops(2.0 * m * n * k, ms)}


def plot_lines(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str, logx: bool = False,
               logy: bool = False) -> Path | None:
    """Line plot of {label: (xs, ys)} to a PNG; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def graph_memory(engine: Any) -> dict[str, Any]:
    """What a co-located engine's decode graphs cost: the device memory each capture took
    (`engine.spatial.graph_bytes`: the rise of reserved memory over one partition's captures,
    keyed by its requested encoder SMs, 0 = the whole device), the total for the split set in
    use, and the KV blocks those bytes would hold (bytes / the engine's KV block bytes, rounded
    up). Empty where nothing was captured (a temporal mode, or no CUDA: a dry run)."""
    spatial = getattr(engine, "spatial", None)
    per = {int(k): int(v) for k, v in sorted((spatial.graph_bytes if spatial else {}).items())}
    block = int(engine.memory.block_bytes)
    total = sum(per.values())
    return {"graph_bytes": per, "graph_bytes_total": total, "graph_captures": len(per),
            "graph_batch_sizes": list(engine.graph_batch_sizes), "kv_block_bytes": block,
            "graph_kv_blocks": {k: -(-v // block) for k, v in per.items()},
            "graph_kv_blocks_total": -(-total // block)}


def _tiny_qwen2_vl() -> Any:
    from transformers import Qwen2VLConfig

    special = 250  # image, video, vision start / end ids, inside the 256-token vocabulary
    return Qwen2VLConfig(
        text_config=dict(vocab_size=256, bos_token_id=1, eos_token_id=2, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=special, video_token_id=special + 1, vision_start_token_id=special + 2,
        vision_end_token_id=special + 3)


def register_dry_model() -> str:
    """Make `DRY_MODEL` (a Qwen2-VL of a few thousand weights) one of the random-weight models
    in this process, for the sections' dry runs on CPU; returns its name."""
    from spaceserve.bench.random_model import RANDOM_MODELS

    RANDOM_MODELS.setdefault(DRY_MODEL, _tiny_qwen2_vl)
    return DRY_MODEL
