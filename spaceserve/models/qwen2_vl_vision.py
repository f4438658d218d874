"""Qwen2-VL vision encoder: patch embedding, ViT blocks with 2D rotary, 2x2 patch merger.

The encoder is preemptible: `start` makes an `EncoderJob` (host-side metadata only), `advance`
runs it a given number of blocks under an SM budget and keeps its hidden state, `finish` runs
the merger. A job advanced in any chunking yields bitwise the embeddings of a full run, since
each block sees exactly the same inputs. The TWSRFT scheduler drives jobs block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.models.attention.backends import AttentionBackend, VitMeta
from spaceserve.models.ops import TorchOps

Tensor = torch.Tensor
LN_EPS = 1e-6


@dataclass
class EncoderJob:
    """One batch of images moving through the encoder, block by block."""

    grid_thw: list[tuple[int, int, int]]
    num_patches: int
    num_tokens: int
    num_layers: int
    meta: VitMeta
    cos: Tensor
    sin: Tensor
    pixel_values: Tensor | None
    hidden: Tensor | None = None
    layers_done: int = 0
    embeddings: Tensor | None = None
    merge: int = 2

    @property
    def done(self) -> bool:
        """All blocks have run (the merger runs in `finish`)."""
        return self.layers_done == self.num_layers

    @property
    def remaining_layers(self) -> int:
        return self.num_layers - self.layers_done

    @property
    def tokens_per_image(self) -> list[int]:
        return [t * h * w // self.merge**2 for t, h, w in self.grid_thw]


def _grid_list(grid_thw: Any) -> list[tuple[int, int, int]]:
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [num_images, 3], got {tuple(grid_thw.shape)}")
        rows = grid_thw.tolist()
    else:
        rows = [list(r) for r in grid_thw]
    out = []
    for r in rows:
        if len(r) != 3:
            raise ValueError(f"image_grid_thw rows must be (t, h, w), got {r!r}")
        t, h, w = (int(x) for x in r)
        if min(t, h, w) < 1:
            raise ValueError(f"image_grid_thw row {(t, h, w)} has a non-positive entry")
        out.append((t, h, w))
    if not out:
        raise ValueError("image_grid_thw is empty")
    return out


class VisionEncoder:
    """The Qwen2-VL ViT on SpaceServe ops; weights come from a name -> tensor getter."""

    def __init__(self, config: Any, weight: Callable[[str], Tensor], ops: TorchOps,
                 backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> None:
        self._init_tower(config, ops, backend, device, dtype, "embed_dim")
        self.patch_w = self._patch_embedding(weight)
        names = ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
                 "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
                 "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
        self.blocks = [[weight(f"blocks.{i}.{n}") for n in names] for i in range(self.num_layers)]
        self.merger = [weight(f"merger.{n}") for n in ("ln_q.weight", "ln_q.bias", "mlp.0.weight",
                                                       "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")]

    # -- set-up shared with the Qwen2.5-VL tower ----------------------------------------
    def _init_tower(self, config: Any, ops: TorchOps, backend: AttentionBackend,
                    device: torch.device, dtype: torch.dtype, width_key: str) -> None:
        """Sizes, activation name and 2D-rotary frequencies from the vision config, whose
        width is `config.<width_key>` (Qwen2-VL: embed_dim, Qwen2.5-VL: hidden_size)."""
        self.config = config
        self.ops = ops
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.embed_dim = int(getattr(config, width_key))
        self.num_heads = int(config.num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim or self.head_dim % 4:
            raise ValueError(f"vision {width_key}={self.embed_dim} / num_heads={self.num_heads} "
                             "must give a head dim divisible by 4 (2D rotary)")
        self.merge = int(config.spatial_merge_size)
        self.patch_dim = (int(config.in_channels) * int(config.temporal_patch_size)
                          * int(config.patch_size) ** 2)
        self.activation = str(config.hidden_act)
        self.num_layers = int(config.depth)
        rope = getattr(config, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta", 10000.0))
        half = self.head_dim // 2
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def _patch_embedding(self, weight: Callable[[str], Tensor]) -> Tensor:
        """The patch embedding as a ``[embed_dim, patch_dim]`` GEMM weight, checked."""
        patch_w = weight("patch_embed.proj.weight").reshape(self.embed_dim, -1).contiguous()
        if patch_w.shape[1] != self.patch_dim:
            raise ValueError(f"patch_embed.proj.weight gives {patch_w.shape[1]} inputs per "
                             f"patch, the config {self.patch_dim}")
        return patch_w

    def _check_batch(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]
                     ) -> tuple[list[tuple[int, int, int]], int]:
        """(grid, total patches) of a valid batch of images; ValueError naming what is wrong."""
        grid = _grid_list(grid_thw)
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 2:
            raise ValueError("pixel_values must be a 2-D tensor [patches, channels*T*P*P]")
        if pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values has {pixel_values.shape[1]} values per patch, the "
                             f"model expects {self.patch_dim}")
        for t, h, w in grid:
            if h % self.merge or w % self.merge:
                raise ValueError(f"image_grid_thw row {(t, h, w)}: h and w must be multiples "
                                 f"of the merge size {self.merge}")
        total = sum(t * h * w for t, h, w in grid)
        if total != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw describes {total} patches but pixel_values has "
                             f"{pixel_values.shape[0]}")
        return grid, total

    def check(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]) -> int:
        """Validate a batch of images without setting anything up (ValueError naming what is
        wrong); returns its patch count."""
        return self._check_batch(pixel_values, grid_thw)[1]

    def _patch_input(self, job: EncoderJob) -> Tensor:
        """The patches the embedding GEMM reads, in the order the blocks see them."""
        return job.pixel_values

    # -- host-side job setup -------------------------------------------------------------
    def rotary_tables(self, grid: Sequence[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
        """fp32 cos/sin ``[patches, head_dim]`` of the 2D rotary, patches in merge-block order."""
        m = self.merge
        hs, ws = [], []
        for t, h, w in grid:
            hpos = torch.arange(h).view(h, 1).expand(h, w)
            wpos = torch.arange(w).view(1, w).expand(h, w)
            for pos, out in ((hpos, hs), (wpos, ws)):
                blk = pos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
                out.append(blk.repeat(t))
        freqs_h = torch.cat(hs)[:, None].float() * self.inv_freq
        freqs_w = torch.cat(ws)[:, None].float() * self.inv_freq
        hw = torch.cat([freqs_h, freqs_w], dim=-1)
        full = torch.cat([hw, hw], dim=-1)
        return full.cos().to(self.device), full.sin().to(self.device)

    def start(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]
              ) -> EncoderJob:
        """Validate a batch of images and set up its job; launches nothing.

        `pixel_values` ``[patches, C*T*P*P]`` as Qwen2VLImageProcessor gives them; `grid_thw`
        ``[num_images, 3]`` patch grids (host metadata: a CUDA tensor is copied to the host).
        """
        grid, total = self._check_batch(pixel_values, grid_thw)
        cu = [0]
        for t, h, w in grid:
            for _ in range(t):
                cu.append(cu[-1] + h * w)
        cos, sin = self.rotary_tables(grid)
        return EncoderJob(
            grid_thw=grid, num_patches=total, num_tokens=total // self.merge**2,
            num_layers=self.num_layers,
            meta=self.backend.plan_vit(cu, self.num_heads, self.head_dim, self.dtype, self.device),
            cos=cos, sin=sin,
            pixel_values=pixel_values.to(device=self.device, dtype=self.dtype).contiguous(),
            merge=self.merge,
        )

    # -- device work ---------------------------------------------------------------------
    def _block(self, h: Tensor, i: int, job: EncoderJob, num_sms: int | None) -> Tensor:
        ops = self.ops
        n1w, n1b, qkv_w, qkv_b, pw, pb, n2w, n2b, f1w, f1b, f2w, f2b = self.blocks[i]
        n = h.shape[0]
        x = ops.layer_norm(h, n1w, n1b, LN_EPS, num_sms=num_sms)
        qkv = ops.linear(x, qkv_w, qkv_b, num_sms=num_sms).view(n, 3, self.num_heads, -1)
        q, k, v = qkv.unbind(1)
        q, k = ops.rotary(q, k, job.cos, job.sin, num_sms=num_sms)
        o = self.backend.vit_attention(q, k, v, job.meta, num_sms=num_sms)
        h = h + ops.linear(o.reshape(n, self.embed_dim), pw, pb, num_sms=num_sms)
        x = ops.layer_norm(h, n2w, n2b, LN_EPS, num_sms=num_sms)
        x = ops.linear(x, f1w, f1b, activation=self.activation, num_sms=num_sms)
        return h + ops.linear(x, f2w, f2b, num_sms=num_sms)

    def advance(self, job: EncoderJob, num_layers: int = 1, *, num_sms: int | None = None
                ) -> int:
        """Run up to `num_layers` more blocks of `job` (the patch embedding, on the patches in
        `_patch_input` order, goes with the first); returns how many ran. Every launch is under
        `num_sms`."""
        if num_layers < 0:
            raise ValueError(f"num_layers={num_layers} must be >= 0")
        if job.hidden is None:
            job.hidden = self.ops.linear(self._patch_input(job), self.patch_w, num_sms=num_sms)
            job.pixel_values = None
        steps = min(num_layers, job.remaining_layers)
        h = job.hidden
        for _ in range(steps):
            h = self._block(h, job.layers_done, job, num_sms)
            job.layers_done += 1
        job.hidden = h
        return steps

    def finish(self, job: EncoderJob, *, num_sms: int | None = None) -> Tensor:
        """Merge 2x2 patches into LLM-width embeddings ``[tokens, text_hidden]`` (a job must be
        done); images' rows follow in the order of `grid_thw`."""
        if not job.done or job.hidden is None:
            raise ValueError(f"job has run {job.layers_done} of {job.num_layers} blocks; "
                             "advance it to the end before finish")
        if job.embeddings is None:
            lw, lb, w0, b0, w2, b2 = self.merger
            x = self.ops.layer_norm(job.hidden, lw, lb, LN_EPS, num_sms=num_sms)
            x = x.reshape(job.num_tokens, -1)
            x = self.ops.linear(x, w0, b0, activation="gelu", num_sms=num_sms)
            job.embeddings = self.ops.linear(x, w2, b2, num_sms=num_sms)
            job.hidden = None
        return job.embeddings

    def encode(self, pixel_values: Tensor, grid_thw: Tensor | Sequence[Sequence[int]], *,
               num_sms: int | None = None) -> Tensor:
        """Embeddings of a batch of images in one go (start, all blocks, finish)."""
        job = self.start(pixel_values, grid_thw)
        self.advance(job, self.num_layers, num_sms=num_sms)
        return self.finish(job, num_sms=num_sms)
