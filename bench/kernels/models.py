"""The "models" section: Qwen2-VL-7B stages (random weights, bf16) on SpaceServe vs transformers.

- Vision pass (encoder stage) of one 448x448, 1024x1024 and 1920x1080 image (grids from
  transformers' smart_resize with the hub preprocessor's limits): SpaceServe's Triton stack at
  the whole device and at smaller SM budgets, SpaceServe on stock torch ops, and transformers'
  own vision tower (attn_implementation="sdpa").
- LM decode step (decoder stage) at batch 1, 32 and 128 with a 4k-token context in the paged
  cache: SpaceServe eager and replayed from a CUDA graph (plan/run split) per budget, stock
  torch ops, and transformers' forward over a DynamicCache of the same length.

Outputs are checked against the torch-ops path before timing (relative error in the rows). Each
case is skipped, and marked so, once the time budget is spent; a failing case becomes an
"error" row and the rest go on. Nothing runs without CUDA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import Rows, bench_ms, section_rows
from spaceserve.bench.prompts import image_grid as prompt_image_grid
from spaceserve.models.presets import get_preset

SECTION = "models"
IMAGES = {"448x448": (448, 448), "1024x1024": (1024, 1024), "1920x1080": (1080, 1920)}
BATCHES = (1, 32, 128)
CONTEXT = 4096
BUDGETS = (None, 66, 32)  # None = the whole device
BLOCK_SIZE = 16


def qwen2_vl_7b_config() -> Any:
    """Qwen2-VL-7B's shapes (its preset) as a transformers config."""
    return get_preset("qwen2-vl-7b").hf_config()


def image_grid(height: int, width: int, config: Any) -> list[int]:
    """(t, h, w) patch grid of one image as transformers' preprocessor resizes it."""
    return list(prompt_image_grid(f"{width}x{height}", config.vision_config))


def hf_key(name: str) -> str:
    """transformers 5.x in-memory name of a hub-layout weight name."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def build_models(config: Any, device: torch.device, dtype: torch.dtype, *,
                 hf: bool = True, backend: str = "triton") -> dict[str, Any]:
    """SpaceServe on its kernels and on torch ops, and transformers' model, all sharing one set
    of random weights (SpaceServe adds its fused QKV / gate-up copies)."""
    from spaceserve.models import from_state_dict, random_state_dict

    state = random_state_dict(config, dtype=dtype, device=device, seed=0)
    models = {"spaceserve": from_state_dict(config, state, attention_backend=backend,
                                            dtype=dtype, device=device),
              "torch-ops": from_state_dict(config, state, attention_backend="torch",
                                           dtype=dtype, device=device)}
    if hf:
        from transformers import Qwen2VLForConditionalGeneration

        with torch.device(device):
            model = Qwen2VLForConditionalGeneration._from_config(
                config, attn_implementation="sdpa", dtype=dtype)
        missing, unexpected = model.load_state_dict(
            {hf_key(k): v for k, v in state.items()}, strict=False, assign=True)
        if [k for k in missing if "lm_head" not in k] or unexpected:
            raise RuntimeError(f"transformers weights: missing {missing}, unexpected "
                               f"{unexpected}")
        models["transformers"] = model.eval()
    return models


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


class Clock:
    """Soft time budget: `ok()` turns False once less than `reserve` seconds remain."""

    def __init__(self, seconds: float, reserve: float = 0.0) -> None:
        self.deadline = time.perf_counter() + seconds
        self.reserve = reserve

    def ok(self) -> bool:
        return time.perf_counter() + self.reserve < self.deadline


def _measure(rows: list[dict], clock: Clock, base: dict, fn: Callable[[], Any],
             timer: Callable[[Callable[[], Any]], float], check: Callable[[], float] | None = None
             ) -> float | None:
    """Append one row: ms of `fn` (and the check's relative error), or why it has none."""
    row = dict(base)
    if not clock.ok():
        row["skipped"] = "time budget spent"
        rows.append(row)
        return None
    try:
        if check is not None:
            row["rel_err_vs_torch_ops"] = check()
        row["ms"] = timer(fn)
    except Exception as exc:  # one failing case must not lose the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    rows.append(row)
    return row.get("ms")


def bench_vision(models: dict[str, Any], config: Any, images: dict[str, tuple[int, int]],
                 budgets: tuple[int | None, ...], clock: Clock, timer: Callable,
                 rows: list[dict] | None = None) -> list[dict]:
    """Vision-pass rows, appended to `rows` (a new list if None) as they are measured."""
    rows = [] if rows is None else rows
    ours, stock = models["spaceserve"], models["torch-ops"]
    v = config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    for name, (h, w) in images.items():
        grid = torch.tensor([image_grid(h, w, config)])
        patches = int(grid.prod())
        gen = torch.Generator(device=ours.device).manual_seed(1)
        pv = torch.randn(patches, patch_dim, generator=gen, device=ours.device).to(ours.dtype)
        base = dict(section=SECTION, stage="vision", workload=name, patches=patches,
                    tokens=patches // v.spatial_merge_size ** 2)
        def stock_fn(pv=pv, grid=grid):
            return stock.encode_images(pv, grid)

        ref = _reference(stock_fn, clock)
        ms_stock = _measure(rows, clock, dict(base, impl="spaceserve-torch-ops", num_sms=None),
                            stock_fn, timer)
        times = {}
        for b in budgets:
            def fn(b=b, pv=pv, grid=grid):
                return ours.encode_images(pv, grid, num_sms=b)

            times[b] = _measure(rows, clock, dict(base, impl="spaceserve", num_sms=b), fn,
                                timer, _checker(fn, ref))
        ms_hf = None
        if "transformers" in models:
            grid_dev = grid.to(pv.device)  # transformers wants the grid beside the pixels

            def hf_fn(pv=pv, grid=grid_dev, visual=models["transformers"].model.visual):
                with torch.no_grad():
                    return visual(pv, grid_thw=grid).pooler_output

            ms_hf = _measure(rows, clock, dict(base, impl="transformers-sdpa", num_sms=None),
                             hf_fn, timer, _checker(hf_fn, ref))
        rows.append(dict(base, headline=f"vision {name} ({patches} patches): spaceserve "
                         + " / ".join(f"{_fmt(times.get(b))} @{b or 'all'}" for b in budgets)
                         + f"; torch ops {_fmt(ms_stock)}; transformers {_fmt(ms_hf)}"))
    return rows


def _reference(fn: Callable[[], torch.Tensor], clock: Clock) -> torch.Tensor | None:
    """The torch-ops output the other implementations are checked against (None if it fails)."""
    if not clock.ok():
        return None
    try:
        return fn()
    except Exception:
        return None


def _checker(fn: Callable[[], torch.Tensor], ref: torch.Tensor | None
             ) -> Callable[[], float] | None:
    return None if ref is None else (lambda: rel_err(fn(), ref))


def _fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.2f} ms"


def _fill_random(cache: Any, seed: int) -> None:
    gen = torch.Generator(device=cache.k[0].device).manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))


def bench_decode(models: dict[str, Any], batches: tuple[int, ...], context: int,
                 budgets: tuple[int | None, ...], clock: Clock, timer: Callable, *,
                 graphs: bool, rows: list[dict] | None = None) -> list[dict]:
    """Decode-step rows, appended to `rows` (a new list if None) as they are measured."""
    from spaceserve.models import DecodeGraph

    rows = [] if rows is None else rows
    ours, stock = models["spaceserve"], models["torch-ops"]
    dev, vocab = ours.device, ours.language.vocab_size
    for b in batches:
        base = dict(section=SECTION, stage="decode", workload=f"b{b}_ctx{context}", batch=b,
                    context=context)
        per_seq = -(-(context + 1) // BLOCK_SIZE)
        if not clock.ok():
            rows.append(dict(base, skipped="time budget spent"))
            continue
        cache = ours.allocate_kv_cache(b * per_seq, BLOCK_SIZE)
        _fill_random(cache, seed=b)
        perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(b)).tolist()
        tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(b)]
        ids = torch.randint(0, vocab, (b,), generator=torch.Generator().manual_seed(b)).to(dev)
        times: dict[str, float | None] = {}

        def plan(model, tables=tables, b=b):
            return model.plan_step([context] * b, [1] * b, tables, block_size=BLOCK_SIZE)

        ctx_stock = plan(stock)

        def stock_fn(ctx=ctx_stock, ids=ids, cache=cache):
            return stock.forward(ids, ctx, cache)

        ref = _reference(stock_fn, clock)
        times["torch"] = _measure(rows, clock, dict(base, impl="spaceserve-torch-ops",
                                                    mode="eager", num_sms=None), stock_fn, timer)
        ctx = plan(ours)
        for nsm in budgets:
            def fn(nsm=nsm, ctx=ctx, ids=ids, cache=cache):
                return ours.forward(ids, ctx, cache, num_sms=nsm)

            times[f"eager{nsm}"] = _measure(
                rows, clock, dict(base, impl="spaceserve", mode="eager", num_sms=nsm), fn,
                timer, _checker(fn, ref))
            if not graphs:
                continue
            try:
                graph = DecodeGraph(ours, cache, b, per_seq, num_sms=nsm)
                gctx = graph.plan([context] * b, tables)
                graph.replay(ids, gctx)  # the captured buffers now hold this step
            except Exception as exc:
                rows.append(dict(base, impl="spaceserve", mode="graph", num_sms=nsm,
                                 error=f"{type(exc).__name__}: {exc}"[:400]))
                continue
            times[f"graph{nsm}"] = _measure(
                rows, clock, dict(base, impl="spaceserve", mode="graph", num_sms=nsm),
                graph.graph.replay, timer,
                _checker(lambda g=graph, c=gctx, ids=ids: g.replay(ids, c), ref))
            del graph
        del ctx, ctx_stock
        _free(dev)
        hf_base = dict(base, impl="transformers-sdpa", mode="eager", num_sms=None,
                       cache="DynamicCache")
        if "transformers" in models and clock.ok():
            try:
                step = _hf_decode(models["transformers"], cache, tables, context, ids)
            except Exception as exc:
                rows.append(dict(hf_base, error=f"{type(exc).__name__}: {exc}"[:400]))
            else:
                del cache
                _free(dev)
                times["hf"] = _measure(rows, clock, hf_base, step, timer, _checker(step, ref))
                del step
        cache = ref = None
        rows.append(dict(base, headline=f"decode b={b} ctx={context}: spaceserve eager "
                         + " / ".join(f"{_fmt(times.get(f'eager{n}'))} @{n or 'all'}"
                                      for n in budgets)
                         + (f"; graph {_fmt(times.get('graphNone'))} @all" if graphs else "")
                         + f"; torch ops {_fmt(times.get('torch'))}; transformers "
                         + _fmt(times.get("hf"))))
        _free(dev)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _hf_decode(hf: Any, paged: Any, tables: list[list[int]], context: int, ids: torch.Tensor
               ) -> Callable[[], torch.Tensor]:
    """transformers' decode step over a DynamicCache holding the same `context` tokens as the
    paged cache, cropped back after every call so each timed call sees the same length."""
    from transformers import DynamicCache

    cfg = hf.config.text_config
    b = len(tables)
    index = torch.tensor(tables, device=ids.device)
    cache = DynamicCache(config=cfg)
    for layer, (kc, vc) in enumerate(zip(paged.k, paged.v, strict=True)):
        kv = [c[index].reshape(b, -1, *c.shape[2:])[:, :context].transpose(1, 2).contiguous()
              for c in (kc, vc)]
        cache.update(kv[0], kv[1], layer)
    inp = ids.view(b, 1)
    pos = torch.full((b, 1), context, dtype=torch.long, device=ids.device)

    def step() -> torch.Tensor:
        with torch.no_grad():
            out = hf(input_ids=inp, position_ids=pos, past_key_values=cache, use_cache=True,
                     logits_to_keep=1).logits
        cache.crop(-1)  # drop the token just appended
        return out[:, -1]

    return step


def run_suite(config: Any, device: torch.device, dtype: torch.dtype, *,
              images: dict[str, tuple[int, int]] = IMAGES, batches: tuple[int, ...] = BATCHES,
              context: int = CONTEXT, budgets: tuple[int | None, ...] = BUDGETS,
              time_budget_s: float = 300.0, graphs: bool | None = None, hf: bool = True,
              backend: str = "triton", partial: Path | None = None,
              timer: Callable[[Callable[[], Any]], float] | None = None) -> list[dict]:
    """Both stages for `config` on `device` (the GPU section runs it at 7B shapes; tests at
    tiny shapes on CPU). `backend` is SpaceServe's attention backend under test."""
    clock = Clock(time_budget_s, reserve=2.0 if device.type == "cuda" else 0.0)
    timer = timer or (lambda fn: bench_ms(fn, device=device))
    graphs = device.type == "cuda" if graphs is None else graphs
    t0 = time.perf_counter()
    models = build_models(config, device, dtype, hf=hf, backend=backend)
    rows = section_rows() if partial is None else Rows(partial, SECTION)
    rows.append(dict(section=SECTION, stage="setup", build_s=time.perf_counter() - t0,
                     dtype=str(dtype), device=str(device)))
    bench_decode(models, batches[:1], context, budgets, clock, timer, graphs=graphs, rows=rows)
    bench_vision(models, config, images, budgets, clock, timer, rows=rows)
    bench_decode(models, batches[1:], context, budgets, clock, timer, graphs=graphs, rows=rows)
    return list(rows)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict]:
    """GPU harness entry point: Qwen2-VL-7B shapes, bf16, on the current CUDA device."""
    if not torch.cuda.is_available():
        return [dict(section=SECTION, skipped="needs a CUDA device")]
    return run_suite(qwen2_vl_7b_config(), torch.device("cuda"), torch.bfloat16,
                     time_budget_s=time_budget_s * 0.95)
