"""Qwen3-VL on SpaceServe: Qwen2-VL's two stage entry points with Qwen3-VL's vision tower
(DeepStack taps), decoder (q/k norm, interleaved M-RoPE, DeepStack adds) and video positions.

A Qwen3-VL prompt separates a video's temporal patches by text timestamps
(``<1.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>`` per patch), so each run of
video tokens is one temporal patch: its M-RoPE grid is ``(1, h, w)`` and its temporal row is
constant, as transformers' ``get_rope_index`` splits ``video_grid_thw``. The encoder still sees
a video as one item of t temporal patches (attention within each), whose rows follow the
prompt's frame order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spaceserve.models.mrope import _grid_rows, mrope_positions
from spaceserve.models.qwen2_vl import Qwen2VL
from spaceserve.models.qwen3_vl.processing import processor_settings
from spaceserve.models.qwen3_vl.text import Qwen3LanguageModel
from spaceserve.models.qwen3_vl.vision import Qwen3VisionEncoder

Tensor = torch.Tensor
MODEL_TYPE = "qwen3_vl"


def split_video_grid(video_grid_thw: Any) -> list[tuple[int, int, int]]:
    """One ``(1, h, w)`` row per temporal patch of each video (the prompt's frame runs)."""
    return [(1, h, w) for t, h, w in _grid_rows(video_grid_thw) for _ in range(t)]


class Qwen3VL(Qwen2VL):
    """Qwen3-VL with the stage entry points of `Qwen2VL`; `encode_images` and the job's
    `finish` give rows ``[tokens, (1 + taps) * hidden]`` (embeddings, then DeepStack
    features), which `forward` takes as `image_embeds`."""

    vision_class = Qwen3VisionEncoder
    vision_out_field = "out_hidden_size"
    language_class = Qwen3LanguageModel

    def language_kwargs(self) -> dict[str, Any]:
        return {"num_deepstack": len(self.config.vision_config.deepstack_visual_indexes)}

    @property
    def num_deepstack(self) -> int:
        """DeepStack taps per media token (extra hidden-wide columns of its encoder row)."""
        return self.language.num_deepstack

    def mrope_positions(self, input_ids: Any, image_grid_thw: Any = None, *,
                        video_grid_thw: Any = None,
                        second_per_grid_ts: Tensor | Sequence[float] | None = None
                        ) -> tuple[Tensor, int]:
        """M-RoPE positions ``[3, L]`` and rope delta; a video's temporal patches are separate
        runs (module docstring) and `second_per_grid_ts` is not used (timestamps are text)."""
        videos = split_video_grid(video_grid_thw) if video_grid_thw is not None else None
        return mrope_positions(input_ids, image_grid_thw, self.config, video_grid_thw=videos)

    def image_processor(self, **kwargs: Any) -> Any:
        """transformers' Qwen2VLImageProcessor with this model's patch geometry (patch 16) and
        Qwen3-VL's normalisation (mean and std 0.5): `processing.processor_settings`, the
        settings the input side and the tiny checkpoint's processor files use too."""
        for key, value in processor_settings(self.config.vision_config).items():
            kwargs.setdefault(key, value)
        return super().image_processor(**kwargs)
