"""Qwen2.5-VL on SpaceServe: Qwen2-VL's two stages with Qwen2.5-VL's vision tower.

The language model is Qwen2-VL's (same decoder, paged KV cache, M-RoPE); the differences are
the vision tower (`qwen2_5_vl_vision`: RMSNorm, SwiGLU with biases, window attention, a merger
to ``out_hidden_size``) and the temporal spacing of video positions (`mrope`).
"""

from __future__ import annotations

import torch

from spaceserve.models.qwen2_5_vl_vision import Qwen25VisionEncoder
from spaceserve.models.qwen2_vl import Qwen2VL

Tensor = torch.Tensor
MODEL_TYPE = "qwen2_5_vl"


class Qwen25VL(Qwen2VL):
    """Qwen2.5-VL with the same stage entry points as `Qwen2VL` (`encode_images`, the
    preemptible ``vision.start/advance/finish``, `plan_step`, `forward`)."""

    vision_class = Qwen25VisionEncoder
    vision_out_field = "out_hidden_size"
    # mrope_positions is Qwen2-VL's: `mrope.py` spaces video frames by the vision config's
    # tokens_per_second * second_per_grid_ts, which only Qwen2.5-VL has
