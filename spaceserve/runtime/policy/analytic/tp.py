"""Analytic curves of one rank of a tensor-parallel group: the decoder split Megatron-style, the
vision encoder data-parallel or sharded, and a cost model of the collectives between them.

A rank's decoder runs its share of every layer (query and KV heads, MLP width and vocabulary
divided by the TP size; KV heads replicated when there are fewer than ranks) followed by two
all-reduces of the layer's activations, and the LM head's logits are all-gathered. Collectives
are stream-ordered with the stage's kernels (the runtime issues them on the stage's stream), so
their time adds to the stage's; it is bound by the links, not by SMs.

The vision encoder, in vLLM's `mm_encoder_tp_mode` terms:
- ``"data"`` (SpaceServe's default): every rank holds the whole ViT and encodes whole images;
  its curve is the single-GPU ViT plus the broadcast of the embeddings (and of Qwen3-VL's
  DeepStack features, one tensor of the same size per tap) from their owner (spread over the
  layers). The simulator runs one image per rank at a time (`encoder_ranks` in the
  curve set's model description; `encoder_dp.RoundTwsrft`).
- ``"replicate"`` (the engine's reference mode): every rank encodes every image with the whole
  ViT, so its curve is the single-GPU ViT and there is one encoder queue.
- ``"weights"``: the ViT sharded like the decoder (heads, MLP width and the merger split over
  the ranks, two all-reduces per block and one after each merger, DeepStack's included); every
  rank works on the same image, so there is one encoder queue.

A collective of ``S`` bytes over ``n`` ranks costs ``latency + k * S / bus_bw`` (ring
algorithms; all-reduce k = 2(n-1)/n, all-gather (n-1)/n of the gathered bytes, broadcast 1).
The link figures are stated assumptions, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from spaceserve.checks import require_choice, require_int
from spaceserve.models.presets import get_preset
from spaceserve.runtime.policy.analytic.model import (
    DevicePreset,
    ModelShape,
    Roofline,
    analytic_curves,
)
from spaceserve.runtime.policy.curves import CurveSet

MM_ENCODER_TP_MODES = ("data", "weights", "replicate")


@dataclass(frozen=True)
class LinkPreset:
    """The GPU-to-GPU fabric of a TP group, as NCCL's ring collectives see it."""

    name: str
    link_bw: float  # bytes/s one GPU sends over all its links (one direction)
    bus_bw: float  # bytes/s a large collective achieves (NCCL's "busbw")
    latency_s: float  # fixed cost of one collective (launch, protocol, synchronisation)


LINKS: dict[str, LinkPreset] = {
    # HGX H200 8-GPU: NVLink 4, 18 links x 25 GB/s per direction = 450 GB/s per GPU through
    # NVSwitch (900 GB/s both ways); assumed 80% of it as bus bandwidth (360 GB/s) and 15 us per
    # collective (small all-reduces on 8 NVLink GPUs take ~10-20 us).
    "H200": LinkPreset("NVLink 4 (HGX H200 8-GPU)", 450e9, 360e9, 15e-6),
    "H100": LinkPreset("NVLink 4 (HGX H100 8-GPU)", 450e9, 360e9, 15e-6),
    # HGX A100: NVLink 3, 12 links x 25 GB/s = 300 GB/s per direction.
    "A100": LinkPreset("NVLink 3 (HGX A100 8-GPU)", 300e9, 230e9, 20e-6),
}


class TensorParallelRoofline(Roofline):
    """`Roofline` of one rank of `tp` (module docstring). `shape` is the whole model's."""

    def __init__(self, shape: ModelShape, device: DevicePreset, dtype_bytes: int = 2, *,
                 tp: int, link: LinkPreset, mm_encoder_tp_mode: str = "data") -> None:
        require_int("tp", tp)
        require_choice("mm_encoder_tp_mode", mm_encoder_tp_mode, MM_ENCODER_TP_MODES)
        for what, n in (("attention heads", shape.heads), ("intermediate size",
                                                           shape.intermediate)):
            if n % tp:
                raise ValueError(f"{what} ({n}) do not split over tp={tp}")
        if shape.kv_heads % tp and tp % shape.kv_heads:
            raise ValueError(f"KV heads ({shape.kv_heads}) neither split over nor replicate "
                             f"across tp={tp}")
        if mm_encoder_tp_mode == "weights" and (shape.vision_heads % tp or
                                                shape.vision_mlp % tp):
            raise ValueError(f"the vision encoder's {shape.vision_heads} heads / MLP width "
                             f"{shape.vision_mlp} do not split over tp={tp}")
        rank = replace(shape, heads=shape.heads // tp, kv_heads=max(1, shape.kv_heads // tp),
                       intermediate=shape.intermediate // tp,
                       vocab=math.ceil(shape.vocab / tp))
        super().__init__(rank, device, dtype_bytes)
        self.tp, self.link, self.mode = tp, link, mm_encoder_tp_mode

    # -- collectives -----------------------------------------------------------------------------
    def _collective(self, nbytes: float, factor: float) -> float:
        if self.tp == 1 or nbytes <= 0:
            return 0.0
        return self.link.latency_s + factor * nbytes / self.link.bus_bw

    def all_reduce(self, nbytes: float) -> float:
        return self._collective(nbytes, 2.0 * (self.tp - 1) / self.tp)

    def all_gather(self, nbytes: float) -> float:
        """`nbytes`: the gathered result's size."""
        return self._collective(nbytes, (self.tp - 1) / self.tp)

    def broadcast(self, nbytes: float) -> float:
        return self._collective(nbytes, 1.0)

    # -- decoder ---------------------------------------------------------------------------------
    def _text_layer(self, rows: float, attn: float, sms: int) -> float:
        """The rank's share of a layer, then o_proj's and down_proj's all-reduces."""
        t = super()._text_layer(rows, attn, sms)
        return t + 2 * self.all_reduce(rows * self.s.hidden * self.b)

    def _logits(self, rows: float) -> float:
        return self.all_gather(rows * self.s.vocab * self.tp * 4)  # fp32 logits

    def prefill(self, tokens: float, context: float, sms: int) -> float:
        return super().prefill(tokens, context, sms) + self._logits(1)

    def decode(self, batch: float, context: float, sms: int) -> float:
        return super().decode(batch, context, sms) + self._logits(batch)

    # -- vision encoder --------------------------------------------------------------------------
    def _vit_layer(self, p: float, segment: float, sms: int) -> float:
        if self.mode != "weights":
            return super()._vit_layer(p, segment, sms)
        s, segment, n = self.s, max(1.0, segment), self.tp
        e, hd, heads = s.vision_embed, s.vision_embed // s.vision_heads, s.vision_heads // n
        layer = 2 * self._rowwise(p, e, sms)  # the norms are replicated
        layer += self._gemm(p, e, 3 * e // n, sms) + self._gemm(p, e // n, e, sms)
        attn_par = math.ceil(p / segment) * math.ceil(segment / 128) * heads
        layer += self._op(4.0 * p * segment * heads * hd, 4.0 * self.b * p * e / n, attn_par,
                          sms, self.d.attn_efficiency)
        up = (2 * s.vision_mlp if s.vision_gated else s.vision_mlp) // n
        layer += self._gemm(p, e, up, sms) + self._gemm(p, s.vision_mlp // n, e, sms)
        return layer + 2 * self.all_reduce(p * e * self.b)

    def encoder_layer(self, patches: float, sms: int) -> float:
        """One vision-layer equivalent of one rank's work (module docstring)."""
        s, p = self.s, float(patches)
        m, wide = p / s.merge ** 2, s.vision_embed * s.merge ** 2
        if self.mode == "replicate":
            return super().encoder_layer(patches, sms)
        mergers = 1 + s.vision_deepstack  # the final one and the DeepStack ones (Qwen3-VL)
        if self.mode == "data":  # + the broadcast of the embeddings (and features) from their owner
            extra = self.broadcast(mergers * m * s.vision_out * self.b)
            return super().encoder_layer(patches, sms) + extra / s.vision_depth
        # weights: each merger's two GEMMs split too (column, then row + all-reduce); the rest
        # as on one GPU (its mergers removed)
        whole = self._gemm(m, wide, wide, sms) + self._gemm(m, wide, s.vision_out, sms)
        split = (self._gemm(m, wide, wide // self.tp, sms) +
                 self._gemm(m, wide // self.tp, s.vision_out, sms) +
                 self.all_reduce(m * s.vision_out * self.b))
        return super().encoder_layer(patches, sms) + mergers * (split - whole) / s.vision_depth


def tensor_parallel_curves(config: Any = None, device: str | DevicePreset = "H200", *,
                           tp: int = 8, mm_encoder_tp_mode: str = "data",
                           link: str | LinkPreset | None = None, name: str | None = None,
                           dtype: str = "bfloat16") -> CurveSet:
    """Modelled curves of one rank of a TP group of `tp` (default: Qwen2-VL-72B at TP 8 on HGX
    H200). The model description records ``tp``, ``mm_encoder_tp_mode``, ``encoder_ranks`` (the
    ranks encoding images at once: `tp` when data-parallel, else 1) and the link preset."""
    if config is None:
        config = get_preset("qwen2-vl-72b")
    key = device if isinstance(device, str) else device.name
    if link is None or isinstance(link, str):
        link_key = link or key
        if link_key not in LINKS:
            raise ValueError(f"link: no preset for {link_key!r}; choose from {sorted(LINKS)}")
        link = LINKS[link_key]

    def roofline(shape: ModelShape, dev: DevicePreset, dtype_bytes: int) -> Roofline:
        return TensorParallelRoofline(shape, dev, dtype_bytes, tp=tp, link=link,
                                      mm_encoder_tp_mode=mm_encoder_tp_mode)

    meta = {"tp": tp, "mm_encoder_tp_mode": mm_encoder_tp_mode,
            "encoder_ranks": tp if mm_encoder_tp_mode == "data" else 1, "link": asdict(link)}
    return analytic_curves(config, device, name=name, dtype=dtype, roofline=roofline,
                           meta=meta)
