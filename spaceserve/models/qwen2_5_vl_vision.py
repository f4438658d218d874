"""Qwen2.5-VL vision encoder: RMSNorm, SwiGLU MLP with biases, window attention.

Qwen2.5-VL's ViT differs from Qwen2-VL's in three ways:

- RMSNorm instead of LayerNorm (blocks and merger), and a SwiGLU MLP whose three projections
  carry biases (gate and up fused into one ``[2I, E]`` GEMM; I=3420 at 7B, whose rows TMA cannot
  take, so the gated-MLP kernel's pointer path runs);
- most blocks attend only inside windows of ``window_size`` pixels (a square of merged tokens);
  the blocks in ``fullatt_block_indexes`` attend over the whole frame;
- to make windows contiguous, the patches are permuted once, in units of merge blocks, into
  window order (windows row-major per frame, tokens row-major inside a window); the merged
  embeddings are permuted back after the merger, so callers see image order.

Both segmentations are planned once per job on the host (`window_layout`) and their attention
plans are reused by every block. The job is preemptible exactly like Qwen2-VL's: `start` (host
metadata), `advance` by any number of blocks under an SM budget, `finish` (merger); chunking
never changes a bit of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.kernels.rotary import vision_rotary_cos_sin
from spaceserve.models.attention.backends import AttentionBackend, VitMeta
from spaceserve.models.ops import TorchOps, activation_torch
from spaceserve.models.qwen2_vl_vision import EncoderJob, VisionEncoder

Tensor = torch.Tensor
NORM_EPS = 1e-6


def window_layout(grid: Sequence[tuple[int, int, int]], merge: int, window: int
                  ) -> tuple[Tensor, list[int], list[int]]:
    """Host-side layout of a batch of images for window attention.

    `grid` holds (t, h, w) patch grids, `window` is the window side in merged tokens. Returns
    (token order, window cu_seqlens, frame cu_seqlens): ``order[i]`` is the image-order index of
    the merged token at window-order position ``i`` (int64 CPU tensor); the window cu_seqlens
    count patches (merged tokens x merge^2) per window; the frame cu_seqlens one segment per
    frame, as full-attention blocks use. Windows at the right and bottom edges are partial.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1 merged token")
    unit = merge * merge
    orders: list[Tensor] = []
    cu_win, cu_full = [0], [0]
    base = 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        idx = torch.full((nh * window, nw * window), -1, dtype=torch.long)
        idx[:gh, :gw] = torch.arange(gh * gw).view(gh, gw)
        tiles = idx.view(nh, window, nw, window).permute(0, 2, 1, 3).reshape(nh * nw, -1)
        valid = tiles >= 0
        flat = tiles[valid]  # row-major: window by window, row-major inside each
        sizes = valid.sum(1).tolist()
        for f in range(t):
            orders.append(flat + base + f * gh * gw)
            for s in sizes:
                cu_win.append(cu_win[-1] + s * unit)
            cu_full.append(cu_full[-1] + h * w)
        base += t * gh * gw
    order = torch.cat(orders) if orders else torch.zeros(0, dtype=torch.long)
    return order, cu_win, cu_full


def vision_weight_shapes(config: Any, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Names (hub layout, under `prefix`) and shapes of every Qwen2.5-VL vision weight."""
    e, inter = int(config.hidden_size), int(config.intermediate_size)
    merged = e * int(config.spatial_merge_size) ** 2
    p = int(config.patch_size)
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (e, int(config.in_channels), int(config.temporal_patch_size),
                                    p, p),
        "merger.ln_q.weight": (e,),
        "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
        "merger.mlp.2.weight": (int(config.out_hidden_size), merged),
        "merger.mlp.2.bias": (int(config.out_hidden_size),),
    }
    for i in range(int(config.depth)):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (e,), b + "norm2.weight": (e,),
                       b + "attn.qkv.weight": (3 * e, e), b + "attn.qkv.bias": (3 * e,),
                       b + "attn.proj.weight": (e, e), b + "attn.proj.bias": (e,),
                       b + "mlp.gate_proj.weight": (inter, e), b + "mlp.gate_proj.bias": (inter,),
                       b + "mlp.up_proj.weight": (inter, e), b + "mlp.up_proj.bias": (inter,),
                       b + "mlp.down_proj.weight": (e, inter), b + "mlp.down_proj.bias": (e,)})
    return {prefix + k: v for k, v in shapes.items()}


@dataclass
class WindowEncoderJob(EncoderJob):
    """An encoder job with window attention: `meta` segments frames (full-attention blocks),
    `window_meta` segments windows; `patch_order` permutes the input patches into window order
    and `token_inverse` brings the merged rows back to image order (both on the device)."""

    window_meta: VitMeta | None = None
    patch_order: Tensor | None = None
    token_inverse: Tensor | None = None


class Qwen25VisionEncoder(VisionEncoder):
    """The Qwen2.5-VL ViT on SpaceServe ops; weights come from a name -> tensor getter."""

    def __init__(self, config: Any, weight: Callable[[str], Tensor], ops: TorchOps,
                 backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> None:
        self._init_tower(config, ops, backend, device, dtype, "hidden_size")
        activation_torch(torch.zeros(1), self.activation)  # ValueError for an unknown one
        patch = int(config.patch_size)
        self.window = int(config.window_size) // self.merge // patch
        if self.window < 1:
            raise ValueError(f"window_size={config.window_size} px is smaller than one merged "
                             f"token ({self.merge * patch} px)")
        self.full_layers = frozenset(int(i) for i in config.fullatt_block_indexes)
        self.out_dim = int(config.out_hidden_size)
        self.patch_w = self._patch_embedding(weight)
        self.blocks = []
        for i in range(self.num_layers):
            w = lambda n, i=i: weight(f"blocks.{i}.{n}")  # noqa: E731
            gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
            gate_up_b = torch.cat([w("mlp.gate_proj.bias"), w("mlp.up_proj.bias")])
            self.blocks.append((
                w("norm1.weight"), w("attn.qkv.weight"), w("attn.qkv.bias"),
                w("attn.proj.weight"), w("attn.proj.bias"), w("norm2.weight"),
                gate_up.contiguous(), gate_up_b.contiguous(),
                w("mlp.down_proj.weight"), w("mlp.down_proj.bias"),
            ))
        self.merger = [weight(f"merger.{n}") for n in ("ln_q.weight", "mlp.0.weight",
                                                       "mlp.0.bias", "mlp.2.weight",
                                                       "mlp.2.bias")]

    # -- host-side job setup -------------------------------------------------------------
    def _upload(self, t: Tensor) -> Tensor:
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device,
                                                                      non_blocking=True)

    def start(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]
              ) -> WindowEncoderJob:
        """Validate a batch of images and plan its job (both segmentations, the patch
        permutation, the rotary tables in window order); launches nothing.

        `pixel_values` ``[patches, C*T*P*P]`` as the Qwen2-VL image processor gives them;
        `grid_thw` ``[num_images, 3]`` patch grids (host metadata).
        """
        grid, total = self._check_batch(pixel_values, grid_thw)
        order, cu_win, cu_full = window_layout(grid, self.merge, self.window)
        unit = self.merge ** 2
        patch_order = (order[:, None] * unit + torch.arange(unit)).reshape(-1)
        cos, sin = vision_rotary_cos_sin(grid, self.head_dim, self.theta, self.merge,
                                         device="cpu")
        plan = self.backend.plan_vit
        return WindowEncoderJob(
            grid_thw=grid, num_patches=total, num_tokens=total // unit,
            num_layers=self.num_layers,
            meta=plan(cu_full, self.num_heads, self.head_dim, self.dtype, self.device),
            cos=self._upload(cos[patch_order].contiguous()),
            sin=self._upload(sin[patch_order].contiguous()),
            pixel_values=pixel_values.to(device=self.device, dtype=self.dtype).contiguous(),
            merge=self.merge,
            window_meta=plan(cu_win, self.num_heads, self.head_dim, self.dtype, self.device),
            patch_order=self._upload(patch_order),
            token_inverse=self._upload(torch.argsort(order)),
        )

    # -- device work ---------------------------------------------------------------------
    def _swiglu(self, x: Tensor, w_gu: Tensor, b_gu: Tensor, w_down: Tensor, b_down: Tensor,
                num_sms: int | None) -> Tensor:
        if self.activation == "silu":  # the fused gate-up kernel with its silu*up epilogue
            return self.ops.gated_mlp(x, w_gu, w_down, b_gate_up=b_gu, b_down=b_down,
                                      num_sms=num_sms)
        gate, up = self.ops.linear(x, w_gu, b_gu, num_sms=num_sms).chunk(2, dim=-1)
        return self.ops.linear(activation_torch(gate, self.activation) * up, w_down, b_down,
                               num_sms=num_sms)

    def _block(self, h: Tensor, i: int, job: EncoderJob, num_sms: int | None) -> Tensor:
        ops = self.ops
        n1, qkv_w, qkv_b, pw, pb, n2, gu_w, gu_b, dw, db = self.blocks[i]
        meta = job.meta if i in self.full_layers else job.window_meta
        n = h.shape[0]
        x = ops.rms_norm(h, n1, NORM_EPS, num_sms=num_sms)
        qkv = ops.linear(x, qkv_w, qkv_b, num_sms=num_sms).view(n, 3, self.num_heads, -1)
        q, k, v = qkv.unbind(1)
        q, k = ops.rotary(q, k, job.cos, job.sin, num_sms=num_sms)
        o = self.backend.vit_attention(q, k, v, meta, num_sms=num_sms)
        attn = ops.linear(o.reshape(n, self.embed_dim), pw, pb, num_sms=num_sms)
        x, h = ops.rms_norm(attn, n2, NORM_EPS, residual=h, num_sms=num_sms)
        return h + self._swiglu(x, gu_w, gu_b, dw, db, num_sms)

    def _patch_input(self, job: EncoderJob) -> Tensor:
        """The patches in window order: the embedding and every block see them so."""
        return job.pixel_values.index_select(0, job.patch_order)

    def finish(self, job: EncoderJob, *, num_sms: int | None = None) -> Tensor:
        """Merge patches into LLM-width embeddings ``[tokens, out_hidden_size]`` in image order
        (the order of `grid_thw`, row-major per frame); the job must be done."""
        if not job.done or (job.hidden is None and job.embeddings is None):
            raise ValueError(f"job has run {job.layers_done} of {job.num_layers} blocks; "
                             "advance it to the end before finish")
        if job.embeddings is None:
            lw, w0, b0, w2, b2 = self.merger
            x = self.ops.rms_norm(job.hidden, lw, NORM_EPS, num_sms=num_sms)
            x = x.reshape(job.num_tokens, -1)
            x = self.ops.linear(x, w0, b0, activation="gelu", num_sms=num_sms)
            x = self.ops.linear(x, w2, b2, num_sms=num_sms)
            job.embeddings = x.index_select(0, job.token_inverse)
            job.hidden = None
        return job.embeddings
