"""What the warm-up launches: every launcher at the shapes the later sections use, bf16, split
into cases that workers run in parallel. Kernel cases launch each shape once (their time is the
first launch's); model cases run the sections' own code paths on Qwen2-VL-7B / Qwen2.5-VL-7B
widths with one layer per stack (a kernel specialisation depends on the widths and the token
counts, not on the depth), and the engine cases drive the colocation, serving and engine-step
engines briefly. The autotune section's candidate configs are the tuner's own business: not warmed.

A case function takes ``(device, timer, **kwargs)``; ``timer(fn)`` runs `fn` once, synchronised,
and returns milliseconds (the signature of the benchmarks' timers).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

Timer = Callable[[Callable[[], Any]], float]
DTYPE = torch.bfloat16


def _r(*shape: int, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev) * scale).to(DTYPE)


def linear_shape(dev: torch.device, timer: Timer, n: int, k: int, ms: tuple[int, ...]) -> None:
    from spaceserve.kernels import linear

    w = _r(n, k, dev=dev, scale=k ** -0.5)
    for m in ms:
        x = _r(m, k, dev=dev)
        timer(lambda x=x: linear(x, w))


def gated_mlp(dev: torch.device, timer: Timer, hidden: int, inter: int, ms: tuple[int, ...],
              bias: bool = False) -> None:
    from spaceserve.kernels import gated_mlp as mlp

    wgu, wd = _r(2 * inter, hidden, dev=dev, scale=0.02), _r(hidden, inter, dev=dev, scale=0.02)
    bgu, bd = (_r(2 * inter, dev=dev), _r(hidden, dev=dev)) if bias else (None, None)
    for m in ms:
        x = _r(m, hidden, dev=dev)
        timer(lambda x=x: mlp(x, wgu, wd, b_gate_up=bgu, b_down=bd))


def norms(dev: torch.device, timer: Timer, shapes: tuple[tuple[int, int], ...]) -> None:
    from spaceserve.kernels import layer_norm, rms_norm

    for m, k in shapes:
        x, w, b = _r(m, k, dev=dev), _r(k, dev=dev), _r(k, dev=dev)
        timer(lambda x=x, w=w: rms_norm(x, w, 1e-6))
        timer(lambda x=x, w=w: rms_norm(x, w, 1e-6, residual=x))
        timer(lambda x=x, w=w, b=b: layer_norm(x, w, b, 1e-6))


def probes(dev: torch.device, timer: Timer) -> None:
    """The SM and time probes (partition checks and the facts' overlap; GPU only: inline PTX)."""
    from spaceserve.kernels.smprobe import probe_sms, probe_times

    timer(lambda: probe_sms(8, spin=8, device=dev))
    timer(lambda: probe_times(8, tiles_per_sm=1, spin=8, device=dev))


def paged_decode(dev: torch.device, timer: Timer, context: int, batches: tuple[int, ...]) -> None:
    from bench.kernels.paged_attention import DIM, HKV, HQ, PAGE
    from spaceserve.kernels import DecodePlan

    pages = -(-context // PAGE)
    for b in batches:
        kc, vc = _r(b * pages, PAGE, HKV, DIM, dev=dev), _r(b * pages, PAGE, HKV, DIM, dev=dev)
        tables = torch.arange(b * pages, dtype=torch.int32, device=dev).view(b, pages)
        lens = torch.full((b,), context, dtype=torch.int32, device=dev)
        plan = DecodePlan(b, pages, HQ, HKV, DIM, PAGE, device=dev)
        plan.plan([context] * b)
        q = _r(b, HQ, DIM, dev=dev)
        timer(lambda q=q, kc=kc, vc=vc, t=tables, s=lens, p=plan: p.run(q, kc, vc, t, s))


def paged_prefill(dev: torch.device, timer: Timer, tokens: int) -> None:
    from bench.kernels.paged_attention import DIM, HKV, HQ, PAGE
    from spaceserve.kernels import paged_prefill_attention

    pages = -(-tokens // PAGE)
    kc, vc = _r(pages, PAGE, HKV, DIM, dev=dev), _r(pages, PAGE, HKV, DIM, dev=dev)
    tables = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    q = _r(tokens, HQ, DIM, dev=dev)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    lens = torch.tensor([tokens], dtype=torch.int32, device=dev)
    timer(lambda: paged_prefill_attention(q, kc, vc, tables, cu, lens))


def vit_attention(dev: torch.device, timer: Timer, lens: list[int], rotary: bool) -> None:
    """Host-planned and device work lists, and the fused rotary path with apply_rotary."""
    from bench.kernels.vit_attention import DIM, HEADS
    from spaceserve.kernels import apply_rotary, plan_vit_attention
    from spaceserve.kernels import vit_attention as attn

    total = sum(lens)
    cu_host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu_host.to(dev)
    q, k, v = (_r(total, HEADS, DIM, dev=dev) for _ in range(3))
    plan = plan_vit_attention(cu_host, HEADS, DIM, dtype=DTYPE, device=dev)
    timer(lambda: attn(q, k, v, cu, max(lens), plan=plan))
    timer(lambda: attn(q, k, v, cu, max(lens), device_worklist=True))
    if rotary:
        angles = torch.rand(total, DIM // 2, device=dev) * 6.0
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        timer(lambda: attn(q, k, v, cu, max(lens), plan=plan, cos=cos, sin=sin))
        timer(lambda: apply_rotary(q, k, cos, sin))


def _one_layer(config: Any) -> Any:
    config.text_config.num_hidden_layers = 1
    config.vision_config.depth = 1
    return config


def models_suite(dev: torch.device, timer: Timer, images: tuple[str, ...],
                 batches: tuple[int, ...], context: int | None = None) -> None:
    """The models section's own code (vision pass, eager and graph decode) at one layer."""
    from bench.kernels import models as bm
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config

    bm.run_suite(_one_layer(qwen2_vl_7b_config()), dev, DTYPE,
                 images={i: bm.IMAGES[i] for i in images}, batches=batches,
                 context=context or bm.CONTEXT, budgets=(None,), hf=False,
                 graphs=dev.type == "cuda", timer=timer, time_budget_s=1e9)


def qwen25_vision(dev: torch.device, timer: Timer, images: tuple[str, ...]) -> None:
    """The qwen25-vision section's tower at two blocks: one windowed, one full."""
    from bench.kernels import qwen25_vision as bq
    from spaceserve.runtime.policy.analytic.model import qwen2_5_vl_7b_config

    config = qwen2_5_vl_7b_config()
    config.vision_config.depth = 2
    config.vision_config.fullatt_block_indexes = [1]
    bq.run_suite(config, dev, DTYPE, images={i: bq.IMAGES[i] for i in images},
                 budgets=(None,), hf=False, timer=timer, time_budget_s=1e9)


def colocation_engine(dev: torch.device, timer: Timer, mode: str) -> None:
    """The colocation section's engine (its config and warm workload) at one layer per stack."""
    from bench.serving import colocation as bc

    setup = bc.setup(llm_layers=1, vision_depth=1)
    engine = setup.make_engine(mode)
    timer(lambda: bc.warm(engine, setup))
    engine.close()


def engine_step(dev: torch.device, timer: Timer) -> None:
    """The engine-step section's engine (graphs for its batch sizes, greedy and random
    sampling, eager steps) at one LLM layer, two steps per configuration."""
    from bench.gpu import engine_step as es

    plan = es.Plan(llm_layers=1, steps=2, warm=1, device=str(dev), reserve_s=0.0)
    with tempfile.TemporaryDirectory() as out:
        timer(lambda: es.run_plan(plan, out, 1e9))


def serving_engine(dev: torch.device, timer: Timer, mode: str) -> None:
    """The serving section's plan for one mode and rate, briefly, at one LLM layer."""
    from bench.serving import serving as bs

    plan = bs.Plan(llm_layers=1, modes=(mode,), rates=(bs.RATES[-1],), duration_s=0.5,
                   min_mode_s=0.0)
    with tempfile.TemporaryDirectory() as out:
        timer(lambda: bs.run_plan(plan, out, 60.0))


def cases() -> list[tuple[str, str, str, dict[str, Any], float]]:
    """(case, kernel, function, kwargs, relative cost): the long poles first."""
    from bench.gpu import bench_kernels as bk
    from bench.kernels import models as bm
    from bench.kernels import paged_attention as bp
    from bench.kernels import vit_attention as bv

    out: list[tuple[str, str, str, dict[str, Any], float]] = []
    for mode in ("spatial-static", "temporal"):
        out.append((f"colocation engine {mode}", "engine", "colocation_engine",
                    {"mode": mode}, 8.0))
    out.append(("serving engine spatial", "engine", "serving_engine", {"mode": "spatial"}, 8.0))
    out.append(("engine step", "engine", "engine_step", {}, 6.0))
    for image in bm.IMAGES:
        out.append((f"models vision {image}", "model:vision", "models_suite",
                    {"images": (image,), "batches": ()}, 5.0))
    for b in bm.BATCHES:
        out.append((f"models decode b{b}", "model:decode", "models_suite",
                    {"images": (), "batches": (b,)}, 5.0))
    for image in ("1024x1024", "1920x1080"):
        out.append((f"qwen2.5 vision {image}", "model:qwen2.5-vision", "qwen25_vision",
                    {"images": (image,)}, 5.0))
    for label, n, k in bk.LINEAR_SHAPES:
        out.append((f"linear {label}", "linear", "linear_shape",
                    {"n": n, "k": k, "ms": (4096, *bk.SKINNY_M)}, 2.0))
    out.append(("gated_mlp llm", "gated_mlp", "gated_mlp",
                {"hidden": bk.HIDDEN, "inter": bk.INTER, "ms": (4096, *bk.SKINNY_M)}, 2.0))
    _, _, v_embed, v_mlp = bk.preset_dims("qwen2.5-vl-7b")  # 1280, 3420
    out.append(("gated_mlp qwen2.5 vision", "gated_mlp", "gated_mlp",
                {"hidden": v_embed, "inter": v_mlp, "ms": (1024, 4096), "bias": True}, 2.0))
    out.append(("norms", "norms", "norms",
                {"shapes": ((4096, bk.HIDDEN), (16384, bk.V_EMBED), (32, bk.HIDDEN))}, 1.0))
    out.append(("sm and time probes", "probes", "probes", {}, 1.0))
    for ctx in bp.CONTEXTS:
        batches = tuple(b for b in bp.BATCHES if b * ctx <= bp.MAX_CACHE_TOKENS)
        out.append((f"paged decode ctx{ctx}", "paged_decode", "paged_decode",
                    {"context": ctx, "batches": batches}, 2.0))
    out.append(("paged prefill", "paged_prefill", "paged_prefill",
                {"tokens": bp.PREFILL_TOKENS}, 2.0))
    for name, lens in bv.WORKLOADS.items():
        out.append((f"vit_attention {name}", "vit_attention", "vit_attention",
                    {"lens": lens, "rotary": name == "1920x1080"}, 2.0))
    return sorted(out, key=lambda c: -c[4])
