"""Qwen2.5-VL on SpaceServe: Qwen2-VL's two stages with Qwen2.5-VL's vision tower.

The language model is Qwen2-VL's (same decoder, paged KV cache, M-RoPE); the differences are
the vision tower (`qwen2_5_vl_vision`: RMSNorm, SwiGLU with biases, window attention, a merger
to ``out_hidden_size``) and the temporal spacing of video positions (`mrope`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .mrope import mrope_positions
from .qwen2_5_vl_vision import Qwen25VisionEncoder
from .qwen2_vl import Qwen2VL

Tensor = torch.Tensor
MODEL_TYPE = "qwen2_5_vl"


class Qwen25VL(Qwen2VL):
    """Qwen2.5-VL with the same stage entry points as `Qwen2VL` (`encode_images`, the
    preemptible ``vision.start/advance/finish``, `plan_step`, `forward`)."""

    vision_class = Qwen25VisionEncoder
    vision_out_field = "out_hidden_size"

    def mrope_positions(self, input_ids: Any, image_grid_thw: Any = None, *,
                        video_grid_thw: Any = None,
                        second_per_grid_ts: Tensor | Sequence[float] | None = None
                        ) -> tuple[Tensor, int]:
        """M-RoPE positions ``[3, L]`` and rope delta of one prompt, video positions spaced by
        ``tokens_per_second * second_per_grid_ts`` as transformers' Qwen2.5-VL does."""
        return mrope_positions(input_ids, image_grid_thw, self.config,
                               video_grid_thw=video_grid_thw,
                               second_per_grid_ts=second_per_grid_ts)

