"""Analytic resource-utility curves: a roofline model of Qwen2-VL / Qwen2.5-VL / Qwen3-VL stages
on a device preset.

Before anything is profiled, SIS and the simulator need curves. This module derives them from
each op's FLOPs and bytes, computed from a transformers config, and a device preset:

- compute scales linearly with SMs, up to the op's parallelism (output tiles of 128x128, times a
  split-K factor of K/1024 for GEMMs; query blocks x heads for attention);
- bandwidth saturates at ``min(HBM, sms * per_sm_bw)`` (a single SM only keeps so many bytes in
  flight), again counting only SMs the op can occupy;
- an op takes ``max(compute, memory)``; every layer adds a fixed launch overhead;
- co-running with the other stage is one documented entry of the curves' contention table: the
  preset's ``contention``, a flat slowdown of both sides (8% on every preset: shared HBM/L2 and
  power-capped clocks; a guess at the order of magnitude, to be replaced by `spaceserve
  profile`'s measurements or overridden with `spaceserve sim --contention X`);
- Qwen2.5-VL's window blocks attend within windows of ``vision_window`` patches (cost linear in
  the patch count), its full blocks over the whole sequence; an encoder "layer" is the mean
  over the mix, so TWSRFT's remaining-work estimates and SIS see the right pass cost;
- Qwen3-VL's encoder (plain GELU MLP, full attention in every block) adds its learned position
  embeddings (a bilinear blend of 4 table rows per patch) and one DeepStack merger per tap (a
  norm and two GEMMs over the merged patches, as the final merger); its decoder adds the per-head
  q/k RMSNorm. The DeepStack features' additions to the first decoder layers' hidden states
  (one row-wise add per tap over the image tokens) are left out: a prefill curve does not know
  which of its tokens are image tokens, and the add is under 1% of a layer.

Results are marked ``source="modelled"``. The numbers are a model: they fix orders of magnitude
and the shape of the trade-off (memory-bound decode saturates at about half an H200, the
compute-bound encoder keeps scaling), not measured latencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from spaceserve.models.presets import ModelPreset, get_preset
from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curves import STAGE_AXES, Curve, CurveSet


@dataclass(frozen=True)
class DevicePreset:
    """Throughput figures of one GPU (achievable, not datasheet peaks)."""

    name: str
    num_sms: int
    flops: float  # dense bf16 FLOP/s of the whole device
    hbm_bw: float  # HBM bytes/s of the whole device
    per_sm_bw: float  # most bytes/s one SM can pull from HBM
    contention: float  # co-running slowdown of both sides (0.08: 8% slower); see contention.py
    layer_overhead_s: float  # fixed launch cost of one layer's kernels
    attn_efficiency: float = 0.6  # attention FLOP rate relative to GEMMs (D=80/128 tiles)


PRESETS: dict[str, DevicePreset] = {
    # H200: ~790 TFLOP/s bf16 matmul and ~4.3 TB/s copy measured; HBM saturates near 66 SMs.
    "H200": DevicePreset("H200", 132, 790e12, 4.3e12, 65e9, 0.08, 12e-6),
    "H100": DevicePreset("H100", 132, 700e12, 3.0e12, 65e9, 0.08, 12e-6),
    "A100": DevicePreset("A100", 108, 250e12, 1.7e12, 32e9, 0.08, 15e-6),
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Qwen2-VL-style model that its costs depend on."""

    name: str
    vision_depth: int
    vision_embed: int
    vision_heads: int
    vision_mlp: int
    vision_gated: bool
    vision_out: int
    merge: int
    patch_dim: int
    text_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_window: int = 0  # patches per attention window (0: every block attends fully)
    vision_window_layers: int = 0  # blocks attending within windows (the rest: full)
    vision_deepstack: int = 0  # DeepStack mergers (Qwen3-VL: one per tapped block)
    vision_pos_embed: bool = False  # learned position table interpolated per grid (Qwen3-VL)
    qk_norm: bool = False  # RMSNorm over each q and k head (the Qwen3 decoder)

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """Read a transformers Qwen2VLConfig (or Qwen2.5-VL) into the dimensions used here."""
        vc = getattr(config, "vision_config", None)
        tc = getattr(config, "text_config", None) or config
        if vc is None:
            raise ValueError("config: needs a vision_config (a Qwen2-VL style config)")
        window = window_layers = 0
        deepstack = getattr(vc, "deepstack_visual_indexes", None)
        if deepstack is not None:  # Qwen3-VL: LayerNorm + GELU MLP, merger to out_hidden_size
            embed, mlp, gated, out = vc.hidden_size, vc.intermediate_size, False, \
                vc.out_hidden_size
        elif hasattr(vc, "embed_dim"):  # Qwen2-VL: LayerNorm + GELU MLP, hidden_size = LLM width
            embed, mlp, gated, out = vc.embed_dim, int(vc.embed_dim * vc.mlp_ratio), False, \
                vc.hidden_size
        else:  # Qwen2.5-VL: SwiGLU MLP, merger to out_hidden_size, window attention
            embed, mlp, gated, out = vc.hidden_size, vc.intermediate_size, True, vc.out_hidden_size
            if getattr(vc, "window_size", None):
                m = vc.spatial_merge_size
                window = (vc.window_size // m // vc.patch_size * m) ** 2
                full = {int(i) for i in vc.fullatt_block_indexes if 0 <= int(i) < vc.depth}
                window_layers = vc.depth - len(full) if window else 0
        heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return cls(name or getattr(config, "model_type", "model"), vc.depth, embed, vc.num_heads,
                   mlp, gated, out, vc.spatial_merge_size, patch_dim, tc.num_hidden_layers,
                   tc.hidden_size, tc.intermediate_size, heads, tc.num_key_value_heads, head_dim,
                   tc.vocab_size, vision_window=window, vision_window_layers=window_layers,
                   vision_deepstack=len(deepstack or ()),
                   vision_pos_embed=bool(getattr(vc, "num_position_embeddings", 0)),
                   qk_norm=deepstack is not None)

    @classmethod
    def from_preset(cls, preset: ModelPreset, name: str | None = None) -> ModelShape:
        """The dimensions of a model preset (`spaceserve.models.presets`), as `from_config`
        reads them from the preset's transformers config, without building one."""
        v, t = preset.vision, preset.text
        window = window_layers = 0
        if v.gated and v.window_size:
            window = (v.window_size // v.merge // v.patch_size * v.merge) ** 2
            full = {i for i in v.fullatt_blocks if 0 <= i < v.depth}
            window_layers = v.depth - len(full) if window else 0
        return cls(name or preset.name, v.depth, v.embed, v.heads, v.intermediate, v.gated,
                   v.out_hidden, v.merge, v.patch_dim, t.layers, t.hidden, t.intermediate,
                   t.heads, t.kv_heads, t.head_dim, t.vocab, vision_window=window,
                   vision_window_layers=window_layers, vision_deepstack=len(v.deepstack),
                   vision_pos_embed=bool(v.position_embeddings),
                   qk_norm=preset.family == "qwen3_vl")


def qwen2_vl_7b_config() -> Any:
    """Qwen2-VL-7B's transformers config, built offline from its preset."""
    return get_preset("qwen2-vl-7b").hf_config()


def qwen2_vl_72b_config() -> Any:
    """Qwen2-VL-72B's transformers config, built offline from its preset."""
    return get_preset("qwen2-vl-72b").hf_config()


def qwen3_vl_8b_config() -> Any:
    """Qwen3-VL-8B's transformers config, built offline from its preset."""
    return get_preset("qwen3-vl-8b").hf_config()


def qwen2_5_vl_7b_config() -> Any:
    """Qwen2.5-VL-7B's transformers config, built offline from its preset."""
    return get_preset("qwen2.5-vl-7b").hf_config()


class Roofline:
    """Per-stage latencies of one model on one device preset (bf16 by default)."""

    def __init__(self, shape: ModelShape, device: DevicePreset, dtype_bytes: int = 2) -> None:
        self.s, self.d, self.b = shape, device, dtype_bytes

    def _rates(self, sms: int, par: float) -> tuple[float, float]:
        used = max(1.0, min(float(sms), par))
        flops = self.d.flops / self.d.num_sms * used
        bw = min(self.d.hbm_bw, self.d.per_sm_bw * used)
        return flops, bw

    def _op(self, flops: float, nbytes: float, par: float, sms: int,
            efficiency: float = 1.0) -> float:
        rate, bw = self._rates(sms, par)
        return max(flops / (rate * efficiency), nbytes / bw)

    def _gemm(self, m: float, k: int, n: int, sms: int) -> float:
        if m <= 0:
            return 0.0
        par = math.ceil(m / 128) * math.ceil(n / 128) * max(1, k // 1024)
        return self._op(2.0 * m * k * n, self.b * (m * k + k * n + m * n), par, sms)

    def _rowwise(self, rows: float, width: int, sms: int) -> float:
        """A norm or elementwise pass: read and write `rows x width`."""
        return self._op(0.0, 2.0 * self.b * rows * width, math.ceil(rows / 4), sms)

    def _vit_layer(self, p: float, segment: float, sms: int) -> float:
        """One vision block over `p` patches attending within segments of `segment` patches."""
        s, segment = self.s, max(1.0, segment)
        e, hd = s.vision_embed, s.vision_embed // s.vision_heads
        layer = 2 * self._rowwise(p, e, sms)
        layer += self._gemm(p, e, 3 * e, sms) + self._gemm(p, e, e, sms)
        attn_par = math.ceil(p / segment) * math.ceil(segment / 128) * s.vision_heads
        layer += self._op(4.0 * p * segment * s.vision_heads * hd, 4.0 * self.b * p * e, attn_par,
                          sms, self.d.attn_efficiency)
        up = 2 * s.vision_mlp if s.vision_gated else s.vision_mlp
        layer += self._gemm(p, e, up, sms) + self._gemm(p, s.vision_mlp, e, sms)
        return layer

    def encoder_layer(self, patches: float, sms: int) -> float:
        """One vision-layer equivalent: a full pass over `patches` ViT tokens divided by depth.

        Full attention is costed as one sequence of `patches` tokens (an upper bound for a batch
        of several images); window blocks as `patches / vision_window` windows.
        """
        s, p = self.s, float(patches)
        e = s.vision_embed
        windowed = s.vision_window_layers if s.vision_window else 0
        total = (s.vision_depth - windowed) * self._vit_layer(p, p, sms)
        if windowed:
            total += windowed * self._vit_layer(p, min(p, float(s.vision_window)), sms)
        m, wide = p / s.merge ** 2, e * s.merge ** 2
        extra = self._gemm(p, s.patch_dim, e, sms) + self._rowwise(p, e, sms)
        merger = self._gemm(m, wide, wide, sms) + self._gemm(m, wide, s.vision_out, sms)
        extra += merger + s.vision_deepstack * (merger + self._rowwise(m, wide, sms))
        if s.vision_pos_embed:  # 4 table rows read per patch, one row written
            extra += self._op(0.0, 5.0 * self.b * p * e, math.ceil(p / 4), sms)
        launches = s.vision_depth + 2 + s.vision_deepstack
        total = total + extra + launches * self.d.layer_overhead_s
        return total / s.vision_depth

    def _text_layer(self, rows: float, attn: float, sms: int) -> float:
        s = self.s
        q_width = s.heads * s.head_dim
        t = 2 * self._rowwise(rows, s.hidden, sms)
        t += self._gemm(rows, s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, sms)
        if s.qk_norm:
            t += self._rowwise(rows, (s.heads + s.kv_heads) * s.head_dim, sms)
        t += attn + self._gemm(rows, q_width, s.hidden, sms)
        t += self._gemm(rows, s.hidden, 2 * s.intermediate, sms)
        t += self._gemm(rows, s.intermediate, s.hidden, sms)
        return t + self.d.layer_overhead_s

    def prefill(self, tokens: float, context: float, sms: int) -> float:
        """One chunk of `tokens` new tokens of one sequence after `context` cached tokens."""
        s, t, c = self.s, float(tokens), float(context)
        pairs = t * c + t * (t + 1) / 2
        kv_bytes = self.b * (c + t) * 2 * s.kv_heads * s.head_dim
        io_bytes = 2 * self.b * t * s.heads * s.head_dim
        attn = self._op(4.0 * pairs * s.heads * s.head_dim, kv_bytes + io_bytes,
                        math.ceil(t / 128) * s.heads, sms, self.d.attn_efficiency)
        layers = s.text_layers * self._text_layer(t, attn, sms)
        return layers + self._gemm(1, s.hidden, s.vocab, sms)

    def decode(self, batch: float, context: float, sms: int) -> float:
        """One decode step of `batch` sequences with `context` cached tokens each."""
        s, bsz, c = self.s, float(batch), float(context)
        kv_bytes = self.b * bsz * (c + 1) * 2 * s.kv_heads * s.head_dim
        par = bsz * s.kv_heads * max(1, math.ceil(c / 512))
        attn = self._op(4.0 * bsz * (c + 1) * s.heads * s.head_dim, kv_bytes, par, sms)
        layers = s.text_layers * self._text_layer(bsz, attn, sms)
        return layers + self._gemm(bsz, s.hidden, s.vocab, sms)


GRIDS: dict[str, dict[str, list[int]]] = {
    "encoder": {"patches": [64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536]},
    "prefill": {"tokens": [16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384],
                "context": [0, 1024, 4096, 16384]},
    "decode": {"batch": [1, 2, 4, 8, 16, 32, 64, 128, 256],
               "context": [0, 256, 1024, 2048, 4096, 8192, 16384, 32768]},
}


def sms_grid(num_sms: int, step: int = 4) -> list[int]:
    """SM counts sampled by the curves: every `step` SMs and the whole device."""
    return sorted({*range(step, num_sms + 1, step), num_sms})


def _table(fn, sms: list[int], axes: list[list[int]]) -> list:
    def rec(prefix: tuple, rest: list[list[int]]) -> Any:
        if not rest:
            return fn(*prefix)
        return [rec((*prefix, x), rest[1:]) for x in rest[0]]

    return [rec((n,), axes) for n in sms]


def analytic_curves(config: Any = None, device: str | DevicePreset = "H200", *,
                    name: str | None = None, dtype: str = "bfloat16",
                    roofline: Callable[[ModelShape, DevicePreset, int], Roofline] = Roofline,
                    meta: dict[str, Any] | None = None) -> CurveSet:
    """Modelled curves for `config` (a transformers config or a model preset; default the
    Qwen2-VL-7B preset) on a device preset; `roofline` builds the cost model (one rank of a
    tensor-parallel group: `analytic_tp`), `meta` is added to the curve set's model
    description."""
    if config is None:
        config = get_preset("qwen2-vl-7b")
    if isinstance(device, str):
        if device not in PRESETS:
            raise ValueError(f"device: unknown preset {device!r}; choose from {sorted(PRESETS)}")
        device = PRESETS[device]
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(dtype)
    if dtype_bytes is None:
        raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {dtype!r}")
    shape = ModelShape.from_preset(config, name) if isinstance(config, ModelPreset) \
        else ModelShape.from_config(config, name)
    model = roofline(shape, device, dtype_bytes)
    sms = sms_grid(device.num_sms)
    fns = {"encoder": model.encoder_layer, "prefill": model.prefill, "decode": model.decode}
    curves = {}
    for stage, fn in fns.items():
        axes = [GRIDS[stage][a] for a in STAGE_AXES[stage]]

        def call(n: int, *work: int, fn=fn) -> float:
            return fn(*work, n)

        curves[stage] = Curve(STAGE_AXES[stage], {a: list(GRIDS[stage][a])
                                                  for a in STAGE_AXES[stage]}, sms,
                              _table(call, sms, axes))
    meta = asdict(shape) | {"device_preset": asdict(device)} | (meta or {})
    contention = Contention.flat(device.contention, source="modelled",
                                 note=f"{device.name} preset: a flat {100 * device.contention:g}% "
                                      "slowdown of both sides while both run (not measured)")
    return CurveSet(device.name, device.num_sms, meta, dtype, "modelled", curves["encoder"],
                    curves["prefill"], curves["decode"], contention)
