"""The "colocation" section: decode beside a stream of images, per engine mode, against the sim.

On the GPU (`run`): random-weight Qwen2-VL-7B shapes in bf16 - the LLM cut to `LLM_LAYERS`
layers so four engines fit the time budget (each row says so). Per mode (temporal, shared,
spatial-static, spatial): 32 background requests decode alone (TPOT), then 1024x1024 and
1920x1080 image requests arrive (Poisson) beside small text "probe" requests: background TPOT
under load, probe p99 ITL, image and probe TTFT. The discrete-event simulator
(`spaceserve.runtime.sim`) runs the same arrivals on the curves the engine uses and its
prediction and error are in the rows. Under green contexts the SM probe shows whether the
encoder's and the decoder's programs shared an SM. A co-located mode's row carries its decode
graphs' memory per capture and in total, and the KV blocks it costs (`graph_memory`). Table +
plot (colocation.png). The load itself is `bench.serving.colocation_load.drive`; each mode gets
an equal share of the time left when it starts and its drive loop stops at the end of that
share, keeping what it measured. `dry_run` runs the same control flow on CPU with the null model.

Which encoder driver keeps decode launches on time (host side, CPU) is
bench/serving/colocation_driver.py.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BENCH_GRAPH_RESERVE_BYTES,
    format_table,
    graph_memory,
    model_len_for,
    section_rows,
    write_json,
)
from bench.serving.colocation_load import BACKGROUND, BG_OUTPUT, BG_PROMPT, drive
from spaceserve.bench.prompts import Prompts

SECTION = "colocation"
MODES = ("temporal", "shared", "spatial-static", "spatial")
LLM_LAYERS = 8  # of Qwen2-VL-7B's 28: four engines and their graphs must fit ~120 s
IMAGE_MIX = {"1024x1024": 0.5, "1920x1080": 0.5}
IMAGE_SIZES = {"1024x1024": (1024, 1024), "1920x1080": (1080, 1920)}


def sim_prediction(curves: Any, mode: str, workload: Any, static_sms: int | None,
                   splits: list[int] | None = None) -> dict[str, float]:
    """The simulator's TPOT / p99 ITL / TTFT (ms) for the same workload, mode and splits."""
    from spaceserve.runtime.sim import SimConfig, simulate

    cfg = SimConfig(mode=mode, static_encoder_sms=static_sms or curves.num_sms // 2,
                    allowed_encoder_sms=tuple(splits) if splits else None,
                    background=BACKGROUND, background_context=BG_PROMPT,
                    background_output=BG_OUTPUT)
    s = simulate(curves, cfg, workload).summary()
    return {"sim_tpot_load_ms": s["background"]["tpot"]["mean_ms"],
            "sim_probe_itl_p99_ms": s["text"]["itl"]["p99_ms"],
            "sim_image_ttft_ms": s["image"]["ttft"]["mean_ms"]}


def with_errors(row: dict[str, Any]) -> dict[str, Any]:
    """Relative error of each simulator prediction against its measurement."""
    for key in ("tpot_load_ms", "probe_itl_p99_ms", "image_ttft_ms"):
        got, want = row.get(key), row.get(f"sim_{key}")
        if isinstance(got, float) and isinstance(want, float) and want > 0 and got == got:
            row[f"sim_err_{key.removesuffix('_ms')}"] = (want - got) / got
    return row


def probe_partitions(engine: Any) -> dict[str, Any]:
    """Concurrent SM probes on the current partition's two streams (GPU only)."""
    from spaceserve.kernels.smprobe import probe_available, probe_report, probe_sms

    pset = engine.spatial.partitions
    why = probe_available(pset.device)
    if why is not None:
        return {"probe": f"skipped: {why}"}
    part = pset.current
    outs = {}
    with part.encoder_scope():
        outs["encoder"] = probe_sms(part.encoder_sms, spin=1 << 16, device=pset.device)
    with part.decoder_scope():
        outs["decoder"] = probe_sms(part.decoder_sms, spin=1 << 16, device=pset.device)
    torch.cuda.synchronize()
    rep = probe_report(outs, {"encoder": part.encoder_sms, "decoder": part.decoder_sms})
    return {"probe": rep.summary(), "probe_disjoint": rep.disjoint, "green": part.green}


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars per mode: measured vs simulated TPOT, probe p99 ITL and image TTFT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in rows if "tpot_load_ms" in r]
    if not runs:
        return None
    panels = (("tpot_alone_ms", "TPOT alone"), ("tpot_load_ms", "TPOT with images"),
              ("probe_itl_p99_ms", "probe p99 ITL"), ("image_ttft_ms", "image TTFT"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    x = range(len(runs))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar([i - 0.2 for i in x], [r.get(key, math.nan) for r in runs], 0.4, label="measured")
        sim = [r.get(f"sim_{key}", math.nan) for r in runs]
        if any(v == v for v in sim):
            ax.bar([i + 0.2 for i in x], sim, 0.4, label="simulated")
        ax.set_xticks(list(x), [r["mode"] for r in runs], rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("ms")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def headline(row: dict[str, Any]) -> str:
    """One mode's measurement against the simulator, in a line."""
    return (f"{row['mode']}: TPOT {row['tpot_alone_ms']:.1f} alone -> "
            f"{row['tpot_load_ms']:.1f} ms with images (sim "
            f"{row.get('sim_tpot_load_ms', math.nan):.1f}); probe p99 ITL "
            f"{row['probe_itl_p99_ms']:.1f} ms; image TTFT {row['image_ttft_ms']:.0f} ms"
            + (f"; SM probe {row['probe']}" if "probe" in row else "")
            + (" (cut at the deadline)" if "cut" in row else ""))


def run_modes(make_engine: Any, prompts_for: Any, workload: Any, curves: Any, *,
              modes: tuple[str, ...] = MODES, alone_s: float = 2.0,
              deadline: float = math.inf, note: str = "",
              rows: list[dict[str, Any]] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """One engine per mode on the same arrivals; rows with measurements and predictions,
    appended to `rows` (a new list if None) mode by mode. Each mode gets an equal share of the
    time left before `deadline` (a `clock()` value) when it starts, and its drive loop stops at
    the end of it (`drive`: the clock must be the engine's for the latency metrics)."""
    from spaceserve.runtime.sim import generate

    arrivals = generate(workload)
    rows = [] if rows is None else rows
    for i, mode in enumerate(modes):
        row: dict[str, Any] = {"section": SECTION, "mode": mode}
        if note:
            row["note"] = note
        now = clock()
        if now > deadline:
            rows.append(row | {"skipped": "time budget spent"})
            continue
        share = now + (deadline - now) / (len(modes) - i)
        try:
            engine = make_engine(mode)
            if engine.spatial is not None:  # budgets: the SM counts granted, not requested
                pset = engine.spatial.partitions
                part = pset.current
                row |= {"encoder_sms": part.encoder_sms, "decoder_sms": part.decoder_sms,
                        "green": part.green, "partitions": pset.describe()["splits"]}
                row |= graph_memory(engine)  # what the split set's decode graphs cost
                if mode == "spatial":
                    row["splits"] = sorted(p.encoder_sms for p in pset.splits.values())
                    row["splits_requested"] = sorted(pset.splits)
                if mode == "spatial-static":
                    row |= probe_partitions(engine)
            row |= drive(engine, arrivals, prompts_for(engine), alone_s=alone_s,
                         load_s=workload.duration_s, deadline=share, clock=clock)
            if engine.spatial is not None and engine.spatial.sis is not None:
                row["splits_used"] = sorted({e for _, e in engine.spatial.switches})
            engine.close()
            del engine
        except Exception as exc:  # one mode failing must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        gc.collect()
        try:
            row |= sim_prediction(curves, mode, workload,
                                  row.get("encoder_sms") if mode == "spatial-static" else None,
                                  row.get("splits"))
        except Exception as exc:
            row["sim_error"] = f"{type(exc).__name__}: {exc}"[:200]
        row = with_errors(row)
        if "tpot_load_ms" in row:
            row["headline"] = headline(row)
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


@dataclass
class Setup:
    """The GPU section's engines: a factory per mode, their prompts, workload and curves."""

    make_engine: Callable[[str], Any]
    prompts_for: Callable[[Any], Prompts]
    workload: Any
    curves: Any


def setup(llm_layers: int = LLM_LAYERS, vision_depth: int | None = None) -> Setup:
    """bf16 Qwen2-VL-7B shapes with random weights on the GPU, the LLM cut to `llm_layers`
    (the vision tower to `vision_depth` when given: the warm-up builds one layer of each)."""
    from bench.kernels.models import image_grid
    from spaceserve import Engine, EngineConfig
    from spaceserve.models import from_state_dict, random_state_dict
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config
    from spaceserve.runtime.policy.model_curves import load_curves
    from spaceserve.runtime.sim import Workload
    from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner

    config = qwen2_vl_7b_config()
    config.text_config.num_hidden_layers = llm_layers
    if vision_depth is not None:
        config.vision_config.depth = vision_depth
    dev = torch.device("cuda")
    state = random_state_dict(config, dtype=torch.bfloat16, device=dev)
    models = {b: from_state_dict(config, state, attention_backend=b, dtype=torch.bfloat16,
                                 device=dev) for b in ("triton", "torch")}
    del state
    grids = {r: tuple(image_grid(h, w, config)) for r, (h, w) in IMAGE_SIZES.items()}
    workload = Workload(image_rate=1.5, duration_s=5.0, image_mix=IMAGE_MIX, text_rate=4.0,
                        text_tokens=16, output_tokens=16, seed=0)
    curves = load_curves(None, Qwen2VLRunner(models["triton"], eos_token_ids=()))
    prompts_for = lambda eng: Prompts(eng.runner.info, grids)  # noqa: E731
    max_len = workload_len(grids, workload)

    def make_engine(mode: str) -> Any:
        model = models["torch" if mode == "shared" else "triton"]
        cfg = EngineConfig(mode=mode, num_kv_blocks=4096, block_size=16, max_num_seqs=48,
                           max_num_batched_tokens=4096, max_encoder_tokens_per_step=2816,
                           graph_batch_sizes=(32, 40, 48), max_model_len=max_len,
                           graph_reserve_bytes=BENCH_GRAPH_RESERVE_BYTES)
        return Engine(Qwen2VLRunner(model, eos_token_ids=()), cfg)

    return Setup(make_engine, prompts_for, workload, curves)


def workload_len(grids: dict[str, tuple[int, int, int]], workload: Any, merge: int = 2) -> int:
    """max_model_len for this section's requests: the largest image prompt (image tokens, text
    tokens, output) or a background request, whichever is longer (`model_len_for`)."""
    image = max(t * h * w // merge ** 2 for t, h, w in grids.values())
    return model_len_for(image + workload.text_tokens + workload.output_tokens,
                         BG_PROMPT + BG_OUTPUT)


def warm(engine: Any, s: Setup) -> None:
    """A short drive of `engine`: the shapes of image prompts, probes and their chunks run
    once here, not inside the first mode's measurement."""
    from spaceserve.runtime.sim import Workload, generate

    load = Workload(image_rate=4.0, duration_s=0.6, image_mix=IMAGE_MIX, text_rate=4.0,
                    text_tokens=16, output_tokens=4, seed=1)
    drive(engine, generate(load), s.prompts_for(engine), alone_s=0.3, load_s=0.6, background=4)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """GPU harness entry point (bf16 Qwen2-VL-7B shapes, LLM cut to `LLM_LAYERS` layers)."""
    if not torch.cuda.is_available():
        return [{"section": SECTION, "skipped": "needs a CUDA device"}]
    deadline = time.perf_counter() + time_budget_s - 5.0  # closing, the simulator, the plot
    s = setup()
    t0 = time.perf_counter()
    engine = s.make_engine("spatial-static")
    warm(engine, s)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    note = (f"LLM cut to {LLM_LAYERS} of 28 layers to fit the time budget; vision tower full; "
            f"warm-up {time.perf_counter() - t0:.0f} s")
    rows = run_modes(s.make_engine, s.prompts_for, s.workload, s.curves, alone_s=1.5,
                     deadline=deadline, note=note, rows=section_rows())
    return _finish(rows, Path(results_dir))


def dry_run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The section's control flow on CPU: every mode on the null model (no kernels, tiny
    images), with the simulator beside it, per-mode deadlines, rows and the plot."""
    from spaceserve import Engine, EngineConfig
    from spaceserve.runtime.policy.model_curves import load_curves
    from spaceserve.runtime.sim import Workload
    from spaceserve.runtime.worker.null import NullModelRunner

    deadline = time.perf_counter() + time_budget_s - 2.0
    grids = {"1024x1024": (1, 8, 8), "1920x1080": (1, 8, 12)}
    workload = Workload(image_rate=25.0, duration_s=0.15, image_mix=IMAGE_MIX, text_rate=25.0,
                        text_tokens=4, output_tokens=4, seed=1)

    def make_engine(mode: str) -> Any:
        return Engine(NullModelRunner(check=False, max_model_len=4096),
                      EngineConfig(mode=mode, num_kv_blocks=2048, block_size=16,
                                   max_num_seqs=48, max_num_batched_tokens=1024))

    rows = run_modes(make_engine, lambda eng: Prompts(eng.runner.info, grids), workload,
                     load_curves(None, None), alone_s=0.05, deadline=deadline,
                     note="dry run: null model on CPU", rows=section_rows())
    return _finish(rows, Path(results_dir))


def _finish(rows: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    write_json(out / f"{SECTION}_rows.json", rows)
    plot(rows, out / f"{SECTION}.png")
    print(format_table(rows, ["mode", "encoder_sms", "tpot_alone_ms", "tpot_load_ms",
                              "sim_tpot_load_ms", "probe_itl_p99_ms", "sim_probe_itl_p99_ms",
                              "image_ttft_ms", "sim_image_ttft_ms", "images_done"]))
    return list(rows)
