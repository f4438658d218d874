"""Qwen2-VL on SpaceServe: the vision encoder and language model stages behind one object."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spaceserve.kernels.budget import resolve_num_sms
from spaceserve.models.attention.backends import AttentionBackend, get_backend
from spaceserve.models.mrope import mrope_positions
from spaceserve.models.ops import TorchOps, make_ops
from spaceserve.models.parallel import Communicator, TensorParallel
from spaceserve.models.qwen2_vl_text import KVCache, LanguageModel
from spaceserve.models.qwen2_vl_vision import EncoderJob, VisionEncoder
from spaceserve.models.step import context as _context

Tensor = torch.Tensor


class Qwen2VL:
    """Qwen2-VL with two stage entry points, each under its own SM budget:
    `encode_images` (the encoder; preemptible through ``vision.start/advance/finish``) and
    `forward` (one LM step over the paged cache, metadata from `plan_step`).

    With `tp` (`parallel.TensorParallel`) and `comm`, the decoder is this rank's shard of a
    tensor-parallel group (`weight` then returns shards, and ``weight(name, rows=(a, b))`` full
    rows); the vision tower is whole on every rank."""

    # The vision tower class and the vision config field giving its output width (architecture
    # variants override these).
    vision_class: type[VisionEncoder] = VisionEncoder
    vision_out_field = "hidden_size"
    language_class: type[LanguageModel] = LanguageModel

    def __init__(self, config: Any, weight: Callable[[str], Tensor], *,
                 attention_backend: str | AttentionBackend = "triton",
                 dtype: torch.dtype, device: torch.device, dense_ops: str | None = None,
                 tp: TensorParallel | None = None, comm: Communicator | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallel()
        self.dtype = dtype
        self.device = device
        self.backend = get_backend(attention_backend)
        self.ops: TorchOps = make_ops(dense_ops or self.backend.dense_ops)
        tcfg = config.text_config
        self.vision = self.vision_class(config.vision_config, lambda n: weight("visual." + n),
                                        self.ops, self.backend, device, dtype)
        out = getattr(config.vision_config, self.vision_out_field)
        if out != tcfg.hidden_size:
            raise ValueError(f"vision_config.{self.vision_out_field}={out} must equal "
                             f"text_config.hidden_size={tcfg.hidden_size}")
        head = weight("lm_head.weight")
        img = int(config.image_token_id)
        vid = getattr(config, "video_token_id", None)
        media = [t for t in (img, vid) if t is not None]
        rows = {t: weight("language.embed_tokens.weight", rows=(t, t + 1)) for t in media} \
            if self.tp.size > 1 else None
        self.language = self.language_class(
            tcfg, lambda n: weight("language." + n), head, img, self.ops, self.backend, device,
            dtype, tp=self.tp, comm=comm, video_token_id=vid, media_token_rows=rows,
            **self.language_kwargs())

    def language_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of `language_class` (architecture variants)."""
        return {}

    @property
    def attention_backend(self) -> str:
        return self.backend.name

    def _budget(self, num_sms: int | None) -> int | None:
        return None if num_sms is None else resolve_num_sms(num_sms, self.device)

    # -- encoder stage ---------------------------------------------------------------------
    def encode_images(self, pixel_values: Tensor, image_grid_thw: Tensor | Sequence[Sequence[int]],
                      *, num_sms: int | None = None) -> Tensor:
        """Merged image embeddings ``[image_tokens, text_hidden]`` (transformers' pooler_output),
        every launch under `num_sms`. Videos go the same way: `image_grid_thw` rows with t > 1
        temporal patches (transformers' ``pixel_values_videos`` / ``video_grid_thw``)."""
        return self.vision.encode(pixel_values, image_grid_thw, num_sms=self._budget(num_sms))

    def start_encode(self, pixel_values: Tensor, image_grid_thw: Any) -> EncoderJob:
        return self.vision.start(pixel_values, image_grid_thw)

    # -- decoder stage ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return self.language.allocate_kv_cache(num_blocks, block_size)

    def plan_step(self, num_cached_tokens: Sequence[int], num_new_tokens: Sequence[int],
                  block_tables: Sequence[Sequence[int]], *, block_size: int,
                  **kwargs: Any) -> _context.StepContext:
        """`context.plan_step` on this model's device, planned for its attention backend."""
        return _context.plan_step(num_cached_tokens, num_new_tokens, block_tables,
                                  block_size=block_size, device=self.device,
                                  backend=self.backend, **kwargs)

    def forward(self, input_ids: Tensor, ctx: _context.StepContext, kv_cache: KVCache, *,
                image_embeds: Tensor | None = None, num_sms: int | None = None,
                comm: Communicator | None = None) -> Tensor:
        """One LM step; logits of the rows `ctx` selects (see `context.py`). `comm` replaces
        the decoder's communicator for this step (tensor parallelism only)."""
        return self.language.forward(input_ids, ctx, kv_cache, image_embeds=image_embeds,
                                     num_sms=self._budget(num_sms), comm=comm)

    __call__ = forward

    # -- host helpers ----------------------------------------------------------------------
    def mrope_positions(self, input_ids: Any, image_grid_thw: Any = None, *,
                        video_grid_thw: Any = None,
                        second_per_grid_ts: Tensor | Sequence[float] | None = None
                        ) -> tuple[Tensor, int]:
        """M-RoPE positions ``[3, L]`` and rope delta of one prompt (see `mrope.py`);
        `second_per_grid_ts` spaces video frames on Qwen2.5-VL only."""
        return mrope_positions(input_ids, image_grid_thw, self.config,
                               video_grid_thw=video_grid_thw,
                               second_per_grid_ts=second_per_grid_ts)

    def image_processor(self, **kwargs: Any) -> Any:
        """transformers' Qwen2VLImageProcessor with this model's patch geometry."""
        from transformers import Qwen2VLImageProcessor

        v = self.config.vision_config
        kwargs.setdefault("patch_size", v.patch_size)
        kwargs.setdefault("temporal_patch_size", v.temporal_patch_size)
        kwargs.setdefault("merge_size", v.spatial_merge_size)
        return Qwen2VLImageProcessor(**kwargs)
