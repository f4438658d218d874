"""Qwen3-VL vision encoder: Qwen2-VL's tower with a learned, resampled position table and
DeepStack taps.

Differences from `qwen2_vl_vision.VisionEncoder` (whose set-up, checks, 2D rotary and block
this reuses): the patch embedding has a bias; a learned ``pos_embed`` table of
``num_position_embeddings`` (a square grid) is bilinearly resampled (corners aligned) to each
image's patch grid and added after the embedding; blocks use tanh-GELU and the weight names of
transformers' Qwen3-VL; the merger normalises before the 2x2 shuffle; and the hidden states
after each block in ``deepstack_visual_indexes`` go through a merger of their own (normalising
after the shuffle), giving one *DeepStack feature* per tap.

The encoder's result per item is one tensor ``[tokens, (1 + taps) * out_hidden]``: the final
embeddings, then each tap's feature, side by side. Everything the runtime does with media rows
(encoder cache, hand-off, chunked prefill slicing, tensor-parallel shipping) carries the taps
with them. A job is preemptible as in Qwen2-VL: a tap is merged inside the `advance` that runs
its block and kept on the job, so a job split at any layer boundaries gives bitwise the
one-shot result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spaceserve.models.attention.backends import AttentionBackend
from spaceserve.models.ops import TorchOps
from spaceserve.models.qwen2_vl_vision import LN_EPS, EncoderJob, VisionEncoder

Tensor = torch.Tensor
_BLOCK_NAMES = ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
                "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
                "mlp.linear_fc2.bias")
_MERGER_NAMES = ("norm.weight", "norm.bias", "linear_fc1.weight", "linear_fc1.bias",
                 "linear_fc2.weight", "linear_fc2.bias")
# transformers' activation names -> the ops' names
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu",
                "quick_gelu": "quick_gelu", "silu": "silu"}


@dataclass
class DeepStackJob(EncoderJob):
    """An `EncoderJob` that also carries the resampled position table's taps (host-planned
    indices ``[patches, 4]`` and fp32 weights) and the DeepStack features taken so far."""

    pos_index: Tensor | None = None
    pos_weight: Tensor | None = None
    taps: list[Tensor] = field(default_factory=list)


def bilinear_taps(grid: Sequence[tuple[int, int, int]], side: int, merge: int
                  ) -> tuple[Tensor, Tensor]:
    """Indices ``[patches, 4]`` into a ``side x side`` table and fp32 weights resampling it
    bilinearly (corners aligned, as ``F.interpolate(align_corners=True)``) to each image's
    ``h x w`` grid, patches in merge-block order and repeated over the t temporal patches."""
    idx, wts = [], []
    for t, h, w in grid:
        def axis(n: int) -> tuple[Tensor, Tensor, Tensor]:
            src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo_i = lo.long().clamp(0, side - 1)
            return lo_i, (lo_i + 1).clamp(max=side - 1), frac
        h0, h1, fh = axis(h)
        w0, w1, fw = axis(w)
        rows = [(h0, 1 - fh), (h1, fh)]
        cols = [(w0, 1 - fw), (w1, fw)]
        i4 = torch.stack([(r[:, None] * side + c[None, :]) for r, _ in rows for c, _ in cols], -1)
        w4 = torch.stack([(a[:, None] * b[None, :]) for _, a in rows for _, b in cols], -1)
        # raster (h, w) -> merge-block order (h/m, w/m, m, m)
        order = torch.arange(h * w).view(h // merge, merge, w // merge, merge) \
            .permute(0, 2, 1, 3).flatten()
        idx.append(i4.view(h * w, 4)[order].repeat(t, 1))
        wts.append(w4.view(h * w, 4)[order].repeat(t, 1))
    return torch.cat(idx), torch.cat(wts)


class Qwen3VisionEncoder(VisionEncoder):
    """The Qwen3-VL ViT with DeepStack on SpaceServe ops; weights from a name -> tensor getter
    (names under ``visual.``, as transformers' Qwen3VLVisionModel)."""

    def __init__(self, config: Any, weight: Callable[[str], Tensor], ops: TorchOps,
                 backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> None:
        self._init_tower(config, ops, backend, device, dtype, "hidden_size")
        act = str(config.hidden_act)
        if act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act={act!r} is not one of {sorted(_ACTIVATIONS)}")
        self.activation = _ACTIVATIONS[act]
        self.patch_w = self._patch_embedding(weight)
        self.patch_b = weight("patch_embed.proj.bias")
        self.pos_embed = weight("pos_embed.weight")
        self.side = int(round(int(config.num_position_embeddings) ** 0.5))
        if self.side * self.side != self.pos_embed.shape[0]:
            raise ValueError(f"pos_embed has {self.pos_embed.shape[0]} rows, not a square "
                             "grid (num_position_embeddings)")
        self.blocks = [[weight(f"blocks.{i}.{n}") for n in _BLOCK_NAMES]
                       for i in range(self.num_layers)]
        self.merger = [weight(f"merger.{n}") for n in _MERGER_NAMES]
        self.deepstack_indexes = [int(i) for i in config.deepstack_visual_indexes]
        bad = [i for i in self.deepstack_indexes if not 0 <= i < self.num_layers]
        if bad or len(set(self.deepstack_indexes)) != len(self.deepstack_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_indexes} must be "
                             f"distinct layers in [0, {self.num_layers})")
        self.deepstack_mergers = [[weight(f"deepstack_merger_list.{j}.{n}")
                                   for n in _MERGER_NAMES]
                                  for j in range(len(self.deepstack_indexes))]
        self.out_hidden = int(config.out_hidden_size)

    @property
    def num_taps(self) -> int:
        """DeepStack taps: extra ``out_hidden`` columns in each item's result."""
        return len(self.deepstack_indexes)

    def start(self, pixel_values: Tensor, grid_thw: Any) -> DeepStackJob:
        """As `VisionEncoder.start`, plus the position table's resampling taps (host work)."""
        base = super().start(pixel_values, grid_thw)
        index, weights = bilinear_taps(base.grid_thw, self.side, self.merge)
        return DeepStackJob(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                            pos_index=index.to(self.device), pos_weight=weights.to(self.device))

    def _merge(self, x: Tensor, weights: list[Tensor], num_tokens: int, postshuffle: bool,
               num_sms: int | None) -> Tensor:
        """A patch merger: LayerNorm (before or after the 2x2 shuffle), fc1, GELU, fc2."""
        nw, nb, w1, b1, w2, b2 = weights
        if postshuffle:
            x = self.ops.layer_norm(x.reshape(num_tokens, -1), nw, nb, LN_EPS, num_sms=num_sms)
        else:
            x = self.ops.layer_norm(x, nw, nb, LN_EPS, num_sms=num_sms).reshape(num_tokens, -1)
        x = self.ops.linear(x, w1, b1, activation="gelu", num_sms=num_sms)
        return self.ops.linear(x, w2, b2, num_sms=num_sms)

    def advance(self, job: DeepStackJob, num_layers: int = 1, *, num_sms: int | None = None
                ) -> int:
        """Run up to `num_layers` more blocks (the patch embedding and position table go with
        the first; a tap's merger with its block); returns how many ran, all under `num_sms`."""
        if num_layers < 0:
            raise ValueError(f"num_layers={num_layers} must be >= 0")
        if job.hidden is None:
            h = self.ops.linear(job.pixel_values, self.patch_w, self.patch_b, num_sms=num_sms)
            pos = (self.pos_embed[job.pos_index] * job.pos_weight[:, :, None]).sum(1)
            job.hidden = h + pos.to(h.dtype)
            job.pixel_values = job.pos_index = job.pos_weight = None
        steps = min(num_layers, job.remaining_layers)
        h = job.hidden
        for _ in range(steps):
            i = job.layers_done
            h = self._block(h, i, job, num_sms)
            job.layers_done += 1
            if i in self.deepstack_indexes:
                j = self.deepstack_indexes.index(i)
                job.taps.append(self._merge(h, self.deepstack_mergers[j], job.num_tokens, True,
                                            num_sms))
        job.hidden = h
        return steps

    def finish(self, job: DeepStackJob, *, num_sms: int | None = None) -> Tensor:
        """The item rows ``[tokens, (1 + taps) * out_hidden]``: final merged embeddings, then
        each DeepStack feature in tap order (a job must be done)."""
        if not job.done or (job.hidden is None and job.embeddings is None):
            raise ValueError(f"job has run {job.layers_done} of {job.num_layers} blocks; "
                             "advance it to the end before finish")
        if job.embeddings is None:
            main = self._merge(job.hidden, self.merger, job.num_tokens, False, num_sms)
            job.embeddings = torch.cat([main, *job.taps], dim=1) if job.taps else main
            job.hidden, job.taps = None, []
        return job.embeddings


def vision_weight_shapes(v: Any) -> dict[str, tuple[int, ...]]:
    """Hub names and shapes of a Qwen3-VL vision tower's weights."""
    e, m, out = int(v.hidden_size), int(v.intermediate_size), int(v.out_hidden_size)
    merged = e * int(v.spatial_merge_size) ** 2
    p = "model.visual."
    shapes: dict[str, tuple[int, ...]] = {
        p + "patch_embed.proj.weight": (e, v.in_channels, v.temporal_patch_size,
                                        v.patch_size, v.patch_size),
        p + "patch_embed.proj.bias": (e,),
        p + "pos_embed.weight": (int(v.num_position_embeddings), e),
    }

    def merger(prefix: str, norm: int) -> None:
        shapes.update({prefix + "norm.weight": (norm,), prefix + "norm.bias": (norm,),
                       prefix + "linear_fc1.weight": (merged, merged),
                       prefix + "linear_fc1.bias": (merged,),
                       prefix + "linear_fc2.weight": (out, merged),
                       prefix + "linear_fc2.bias": (out,)})
    for i in range(int(v.depth)):
        b = f"{p}blocks.{i}."
        shapes.update({b + "norm1.weight": (e,), b + "norm1.bias": (e,),
                       b + "norm2.weight": (e,), b + "norm2.bias": (e,),
                       b + "attn.qkv.weight": (3 * e, e), b + "attn.qkv.bias": (3 * e,),
                       b + "attn.proj.weight": (e, e), b + "attn.proj.bias": (e,),
                       b + "mlp.linear_fc1.weight": (m, e), b + "mlp.linear_fc1.bias": (m,),
                       b + "mlp.linear_fc2.weight": (e, m), b + "mlp.linear_fc2.bias": (e,)})
    merger(p + "merger.", e)
    for j in range(len(v.deepstack_visual_indexes)):
        merger(f"{p}deepstack_merger_list.{j}.", merged)
    return shapes
