"""The "qwen25-vision" section: Qwen2.5-VL-7B's vision tower (random weights, bf16) on SpaceServe
against transformers' own tower in the same run.

Shapes: depth 32, hidden 1280, 16 heads (D=80), SwiGLU intermediate 3420 (with biases; its rows
are not 16-byte aligned, so the gated-MLP kernel's pointer path runs), merger to 3584, 112 px
windows with full attention in blocks 7/15/23/31. Workloads: one 1024x1024 and one 1920x1080
image (grids from transformers' smart_resize with the hub preprocessor's limits). For each:
SpaceServe's Triton stack at the whole device and at smaller SM budgets, SpaceServe on stock torch
ops, and `Qwen2_5_VisionTransformerPretrainedModel` with attn_implementation="sdpa". Outputs are
checked against the torch-ops path (relative error in the rows). Nothing runs without CUDA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import Rows, bench_ms, section_rows
from bench.kernels.models import Clock, _checker, _fmt, _measure, _reference, image_grid

SECTION = "qwen25-vision"
IMAGES = {"1024x1024": (1024, 1024), "1920x1080": (1080, 1920)}
BUDGETS = (None, 66, 32)  # None = the whole device


def build_towers(config: Any, device: torch.device, dtype: torch.dtype, *, hf: bool = True,
                 seed: int = 0, std: float = 0.02) -> dict[str, Any]:
    """SpaceServe's tower on its kernels and on torch ops, and transformers' tower, sharing one
    set of random weights (matrices and biases ~ N(0, std), norm weights ~ 1 + N(0, std))."""
    from spaceserve.models.attention.backends import get_backend
    from spaceserve.models.ops import make_ops
    from spaceserve.models.qwen2_5_vl_vision import Qwen25VisionEncoder, vision_weight_shapes

    vcfg = config.vision_config
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in vision_weight_shapes(vcfg, prefix="").items():
        w = torch.randn(shape, generator=gen, device=device) * std
        if "norm" in name or "ln_q" in name:
            w = w + 1.0
        state[name] = w.to(dtype)
    towers = {impl: Qwen25VisionEncoder(vcfg, state.__getitem__, make_ops(impl),
                                        get_backend(impl), device, dtype)
              for impl in ("triton", "torch")}
    if hf:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        with torch.device(device):
            model = Qwen2_5_VisionTransformerPretrainedModel._from_config(
                vcfg, attn_implementation="sdpa", dtype=dtype)
        model.load_state_dict(state, strict=True, assign=True)
        towers["transformers"] = model.eval()
    return towers


def bench_towers(towers: dict[str, Any], config: Any, images: dict[str, tuple[int, int]],
                 budgets: tuple[int | None, ...], clock: Clock, timer: Callable,
                 rows: list[dict] | None = None) -> list[dict]:
    """Rows per image, appended to `rows` (a new list if None) as they are measured."""
    rows = [] if rows is None else rows
    ours, stock = towers["triton"], towers["torch"]
    for name, (h, w) in images.items():
        grid = torch.tensor([image_grid(h, w, config)])
        patches = int(grid.prod())
        gen = torch.Generator(device=ours.device).manual_seed(patches)
        pv = torch.randn(patches, ours.patch_dim, generator=gen, device=ours.device).to(ours.dtype)
        windows = len(ours.start(pv, grid).window_meta.cu_seqlens_host) - 1
        base = dict(section=SECTION, workload=name, patches=patches,
                    tokens=patches // ours.merge ** 2, windows=windows)

        def stock_fn(pv=pv, grid=grid):
            return stock.encode(pv, grid)

        ref = _reference(stock_fn, clock)
        times: dict[Any, float | None] = {}
        for b in budgets:
            def fn(b=b, pv=pv, grid=grid):
                return ours.encode(pv, grid, num_sms=b)

            times[b] = _measure(rows, clock, dict(base, impl="spaceserve", num_sms=b), fn, timer,
                                _checker(fn, ref))
            if b is None and "transformers" in towers:
                grid_dev = grid.to(pv.device)

                def hf_fn(pv=pv, grid=grid_dev, visual=towers["transformers"]):
                    with torch.no_grad():
                        return visual(pv, grid_thw=grid).pooler_output

                times["hf"] = _measure(rows, clock, dict(base, impl="transformers-sdpa",
                                                         num_sms=None), hf_fn, timer,
                                       _checker(hf_fn, ref))
        times["torch"] = _measure(rows, clock, dict(base, impl="spaceserve-torch-ops",
                                                    num_sms=None), stock_fn, timer)
        speedup = ""
        if times.get(None) and times.get("hf"):
            speedup = f" ({times['hf'] / times[None]:.2f}x transformers)"
        rows.append(dict(base, headline=f"qwen2.5-vl vision {name} ({patches} patches, "
                         f"{windows} windows): spaceserve "
                         + " / ".join(f"{_fmt(times.get(b))} @{b or 'all'}" for b in budgets)
                         + f"{speedup}; torch ops {_fmt(times.get('torch'))}; transformers "
                         + _fmt(times.get("hf"))))
    return rows


def run_suite(config: Any, device: torch.device, dtype: torch.dtype, *,
              images: dict[str, tuple[int, int]] = IMAGES,
              budgets: tuple[int | None, ...] = BUDGETS, time_budget_s: float = 40.0,
              hf: bool = True, partial: Path | None = None,
              timer: Callable[[Callable[[], Any]], float] | None = None) -> list[dict]:
    """The vision pass of `config` (a Qwen2_5_VLConfig) on `device`: the GPU section runs it at
    7B shapes, tests at tiny shapes on CPU."""
    from spaceserve.kernels.budget import device_num_sms

    clock = Clock(time_budget_s, reserve=2.0 if device.type == "cuda" else 0.0)
    timer = timer or (lambda fn: bench_ms(fn, device=device))
    total = device_num_sms(device)
    budgets = tuple(dict.fromkeys(b if b is None or b < total else None for b in budgets))
    t0 = time.perf_counter()
    towers = build_towers(config, device, dtype, hf=hf)
    rows = section_rows() if partial is None else Rows(partial, SECTION)
    rows.append(dict(section=SECTION, stage="setup", build_s=time.perf_counter() - t0,
                     dtype=str(dtype), device=str(device), num_sms=total))
    bench_towers(towers, config, images, budgets, clock, timer, rows=rows)
    return list(rows)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict]:
    """GPU harness entry point: Qwen2.5-VL-7B's vision tower, bf16, on the current CUDA device."""
    if not torch.cuda.is_available():
        return [dict(section=SECTION, skipped="needs a CUDA device")]
    from spaceserve.runtime.policy.analytic.model import qwen2_5_vl_7b_config

    return run_suite(qwen2_5_vl_7b_config(), torch.device("cuda"), torch.bfloat16,
                     time_budget_s=time_budget_s * 0.95)
