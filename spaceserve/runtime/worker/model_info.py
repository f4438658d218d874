"""What the engine needs to know about a model: `ModelInfo`, reported by every runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a model to validate and finish requests.

    `image_token_id` None means text only, `video_token_id` None no videos. `patch_dim` is the
    width of a ``pixel_values`` row (Qwen2-VL: 3 * 2 * 14 * 14 = 1176); one LLM image or video
    token covers ``spatial_merge_size ** 2`` patches.
    """

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    spatial_merge_size: int = 2
    patch_dim: int | None = None
    video_token_id: int | None = None
