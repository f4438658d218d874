"""The "facts" section: what the GPU offers, measured in under a minute.

SM count; device-to-device copy GB/s; bf16 matmul TFLOP/s on random data; green contexts through
cuda.bindings (creatable? SMs granted for several requests); one split as the engine makes it
(`PartitionSet`, probed) put through `green_stream_facts` in about 2 s: a Triton kernel on both
green streams at once and how much of the time they ran together (``%globaltimer`` per program:
the overlap fraction), events across green and ordinary streams, a CUDA graph captured and
replayed on a green stream, with the granted budgets; HBM read GB/s of a persistent Triton
streaming kernel against its program count and tile size; Triton launch overhead. (Compile times
and the cache proof are the warm-up section's: bench/gpu/warmup.py.)
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench.common import (
    bench_ms,
    copy_bandwidth_gbs,
    gbps,
    matmul_tflops,
    plot_lines,
    section_rows,
    write_json,
)

GREEN_REQUESTS = (8, 16, 32, 64, 66, 100)
STREAM_PROGRAMS = (8, 16, 32, 48, 64, 66, 96, 132)
STREAM_TILE_KB = (4, 16, 64)


@triton.jit
def _stream_read(x_ptr, out_ptr, num_tiles, BLOCK: tl.constexpr):
    """Persistent read-only stream: each program sums its tiles (so the loads are not dead)."""
    pid = tl.program_id(0)
    acc = tl.zeros((1,), tl.float32)
    for tile in tl.range(pid, num_tiles, tl.num_programs(0)):
        offs = tile * BLOCK + tl.arange(0, BLOCK)  # < 2**31: the buffer holds 2**30 elements
        acc += tl.sum(tl.load(x_ptr + offs).to(tl.float32), 0)
    tl.store(out_ptr + pid + tl.arange(0, 1), acc)


@triton.jit
def _empty(x_ptr, n):
    pass


def compile_specs() -> list:
    """The facts kernels, for the sm_90 compile check (python -m spaceserve.kernels.aot
    --module bench/gpu/facts.py)."""
    from spaceserve.kernels.persistent import CompileSpec

    sig = {"x_ptr": "*bf16", "out_ptr": "*fp32", "num_tiles": "i32"}
    specs = [CompileSpec(f"stream_read[{kb}KB]", _stream_read, sig, {"BLOCK": kb * 512},
                         num_warps=8) for kb in STREAM_TILE_KB]
    return specs + [CompileSpec("empty", _empty, {"x_ptr": "*fp32", "n": "i32"}, {})]


def green_contexts(requests: tuple[int, ...] = GREEN_REQUESTS) -> list[dict[str, Any]]:
    """For each SM request: split, create a green context and a stream, run work on it."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return [{"request": None, "created": False, "error": f"cuda.bindings missing: {exc}"}]
    from spaceserve.runtime.spatial.partition import (
        green_context_stream,
        sm_resource,
        split_sm_resource,
    )

    torch.cuda.init()
    rows = []
    try:
        dev, whole = sm_resource(torch.cuda.current_device())
    except Exception as exc:
        return [{"request": None, "created": False, "error": str(exc)}]
    for n in requests:
        row: dict[str, Any] = {"request": n, "created": False, "granted": None, "remaining": None}
        ctx = stream = None
        try:
            group, remaining = split_sm_resource(whole, n)
            row["granted"], row["remaining"] = group.sm.smCount, remaining.sm.smCount
            ctx, stream, _ = green_context_stream(dev, group)
            ts = torch.cuda.get_stream_from_external(int(stream))
            with torch.cuda.stream(ts):
                x = torch.ones(1 << 20, device="cuda")
                ok = bool((x * 2).sum().item() == 2 * (1 << 20))
            ts.synchronize()
            row["created"], row["work_ok"] = True, ok
        except Exception as exc:
            row["error"] = str(exc)[:200]
        finally:
            if stream is not None:
                driver.cuStreamDestroy(stream)
            if ctx is not None:
                driver.cuGreenCtxDestroy(ctx)
        rows.append(row)
    return rows


def green_streams_row(dev: torch.device, split: int | None = None) -> dict[str, Any]:
    """One split made as the engine makes it, and what its streams do (`green_stream_facts`,
    CUDA only): a row with the overlap fraction and the granted budgets as figures. Without
    CUDA (the dry run) the same fields, the budgets those of the fallback, the checks skipped."""
    from spaceserve.kernels.budget import device_num_sms
    from spaceserve.runtime.spatial.partition import PartitionSet, default_splits

    total = device_num_sms(dev)
    if split is None:
        splits = default_splits(total)
        split = splits[len(splits) // 2]
    pset = PartitionSet(dev, [split])
    try:
        part = pset.get(split)
        row: dict[str, Any] = {"fact": "green_streams", "split": split,
                               "encoder_sms": part.encoder_sms, "decoder_sms": part.decoder_sms,
                               "green": part.green, "reason": part.reason or pset.reason,
                               "probe": part.probe, "overlap_fraction": None}
        if dev.type == "cuda":
            from spaceserve.runtime.spatial.partition_probe import green_stream_facts

            facts = green_stream_facts(pset, split)
            row.update({k: facts[k] for k in ("concurrent", "events", "graph", "wall_s")},
                       overlap_fraction=facts["overlap_fraction"], value=facts["ok"])
        else:
            row["skipped"] = "needs a CUDA device (budgets: the fallback's)"
    finally:
        pset.close()
    row["figures"] = {"overlap_fraction": row["overlap_fraction"],
                      "granted_encoder_sms": row["encoder_sms"],
                      "granted_decoder_sms": row["decoder_sms"], "green_split": row["green"]}
    over = row["overlap_fraction"]
    checks = ", ".join(f"{k} {'ok' if row[k]['ok'] else 'FAILED'}" for k in
                       ("concurrent", "events", "graph") if k in row)
    row["headline"] = (f"split {split}: encoder {row['encoder_sms']} / decoder "
                       f"{row['decoder_sms']} SMs granted ({'green' if row['green'] else 'budgets'}"
                       f"); overlap {'-' if over is None else f'{over:.2f}'}"
                       + (f"; {checks}" if checks else f"; {row.get('skipped', '')}"))
    return row


def hbm_stream_sweep(deadline: float, gib: float = 2.0) -> list[dict[str, Any]]:
    """Read GB/s of `_stream_read` over program counts and tile sizes (bf16 data)."""
    n = int(gib * (1 << 30)) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_()
    out = torch.empty(max(STREAM_PROGRAMS), dtype=torch.float32, device="cuda")
    rows = []
    for kb in STREAM_TILE_KB:
        block = kb * 1024 // 2
        tiles = n // block
        for p in STREAM_PROGRAMS:
            if time.perf_counter() > deadline:
                return rows
            ms = bench_ms(lambda p=p, block=block, tiles=tiles:
                          _stream_read[(p,)](x, out, tiles, BLOCK=block, num_warps=8),
                          rep_ms=40)
            rows.append({"programs": p, "tile_kb": kb, "ms": ms,
                         "gbs": gbps(tiles * block * 2, ms)})
    return rows


def launch_overhead_us(n: int = 2000) -> dict[str, float]:
    """Host time per launch of an empty Triton kernel (after compile), and per synced launch."""
    x = torch.empty(16, device="cuda")
    _empty[(1,)](x, 16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        _empty[(1,)](x, 16)
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        _empty[(1,)](x, 16)
        torch.cuda.synchronize()
    synced = (time.perf_counter() - t0) / 200 * 1e6
    return {"launch_host_us": host, "launch_sync_us": synced}


def _device_row(dev: torch.device) -> dict[str, Any]:
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, sms, gib = props.name, props.multi_processor_count, props.total_memory / 2**30
        text = f"{name}: {sms} SMs, {gib:.0f} GiB"
    else:
        name, sms, gib = platform.processor() or platform.machine(), None, None
        text = f"CPU ({os.cpu_count()} cores; dry run, no CUDA device)"
    return {"fact": "device", "value": name, "sms": sms, "memory_gib": gib,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "headline": f"{text}, torch {torch.__version__}, triton {triton.__version__}"}


def measure(results_dir: Path, time_budget_s: float, dev: torch.device) -> list[dict[str, Any]]:
    """The facts on `dev`: CUDA measures everything; a CPU (the dry run) measures copy and
    matmul at small sizes and marks the CUDA-only facts skipped, so the control flow runs."""
    start = time.perf_counter()
    deadline = start + time_budget_s
    cuda = dev.type == "cuda"
    rows = section_rows()  # saved after every row
    device = _device_row(dev)
    rows.append(device)
    facts: dict[str, Any] = {k: device[k] for k in ("value", "sms", "memory_gib", "torch",
                                                     "triton", "cuda")}
    copy = copy_bandwidth_gbs(1 << 30 if cuda else 1 << 24, device=dev, rep_ms=200 if cuda else 20)
    rows.append({"fact": "copy_gbs", "value": copy["gbs_read_write"],
                 "headline": f"{dev.type} copy {copy['gbs_read_write']:.0f} GB/s (read+write)"})
    size, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    mm = matmul_tflops(size, size, size, dtype, device=dev, rep_ms=200 if cuda else 20)
    facts.update(copy=copy, matmul=mm)
    rows.append({"fact": f"{str(dtype).removeprefix('torch.')}_matmul_tflops",
                 "value": mm["tflops"],
                 "headline": f"{str(dtype).removeprefix('torch.')} matmul {size}^3 "
                 f"{mm['tflops']:.3g} TFLOP/s"})
    if not cuda:
        rows.append({"fact": "green_contexts", "skipped": "needs a CUDA device"})
        rows.append(green_streams_row(dev))
        for fact in ("stream_read_gbs", "triton_launch_us"):
            rows.append({"fact": fact, "skipped": "needs a CUDA device"})
        write_json(results_dir / "facts_details.json", facts)
        return rows

    green = green_contexts()
    facts["green_contexts"] = green
    granted = ", ".join(f"{g['request']}->{g['granted']}" + ("" if g["created"] else "(x)")
                        for g in green if g.get("request") is not None)
    ok = all(g["created"] for g in green)
    rows.append({"fact": "green_contexts", "value": ok,
                 "figures": {"green_granted_sms": {str(g["request"]): g["granted"]
                                                   for g in green if g.get("request")}},
                 "headline": f"green contexts {'ok' if ok else 'FAILED'}: {granted or green}"})
    try:
        streams = green_streams_row(dev)
    except Exception as exc:  # the facts after it still run
        streams = {"fact": "green_streams", "value": False, "error": f"{exc!r}"[:300],
                   "headline": f"green streams FAILED: {exc!r}"[:200]}
    facts["green_streams"] = streams
    rows.append(streams)

    sweep = hbm_stream_sweep(start + 0.7 * time_budget_s)
    facts["hbm_stream"] = sweep
    if sweep:
        best = max(sweep, key=lambda r: r["gbs"])
        rows.append({"fact": "stream_read_gbs", "value": best["gbs"],
                     "headline": f"Triton stream read best {best['gbs']:.0f} GB/s at "
                     f"{best['programs']} programs x {best['tile_kb']} KB tiles"})
        plot_lines(results_dir / "facts_hbm_stream.png",
                   {f"{kb} KB tiles": ([r["programs"] for r in sweep if r["tile_kb"] == kb],
                                       [r["gbs"] for r in sweep if r["tile_kb"] == kb])
                    for kb in STREAM_TILE_KB},
                   xlabel="programs (persistent grid)", ylabel="read GB/s",
                   title=f"HBM read of a persistent Triton kernel ({device['value']})")
    if time.perf_counter() < deadline - 2:
        launch = launch_overhead_us()
        facts["launch"] = launch
        rows.append({"fact": "triton_launch_us", "value": launch["launch_host_us"],
                     "headline": f"Triton launch {launch['launch_host_us']:.1f} us host, "
                     f"{launch['launch_sync_us']:.1f} us with sync"})
    write_json(results_dir / "facts_details.json", facts)
    return rows


def run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The GPU harness entry point (skips without CUDA)."""
    if not torch.cuda.is_available():
        return [{"section": "facts", "skipped": "needs a CUDA device"}]
    return measure(Path(results_dir), time_budget_s, torch.device("cuda"))


def dry_run(results_dir: Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The dry run's facts: the same control flow on the CPU."""
    return measure(Path(results_dir), time_budget_s, torch.device("cpu"))
