"""Qwen2-VL and Qwen2.5-VL on SpaceServe kernels: loading, stage entry points, attention
backends, planner."""

from .attention_backends import (
    AttentionBackend,
    BackendUnavailable,
    VitMeta,
    available_backends,
    get_backend,
    known_backends,
)
from .context import HostMeta, StepContext, plan_step
from .cuda_graph import DecodeGraph, DecodeGraphSet, GraphMemoryError
from .loader import (
    from_config,
    from_pretrained,
    from_state_dict,
    random_state_dict,
    weight_shapes,
)
from .mrope import mrope_positions, text_positions
from .qwen2_5_vl import Qwen25VL
from .qwen2_5_vl_vision import Qwen25VisionEncoder, WindowEncoderJob, window_layout
from .qwen2_vl import Qwen2VL
from .qwen2_vl_text import KVCache, LanguageModel
from .qwen2_vl_vision import EncoderJob, VisionEncoder

__all__ = [
    "AttentionBackend",
    "BackendUnavailable",
    "DecodeGraph",
    "DecodeGraphSet",
    "EncoderJob",
    "GraphMemoryError",
    "HostMeta",
    "KVCache",
    "LanguageModel",
    "Qwen25VL",
    "Qwen25VisionEncoder",
    "Qwen2VL",
    "StepContext",
    "VisionEncoder",
    "VitMeta",
    "WindowEncoderJob",
    "available_backends",
    "from_config",
    "from_pretrained",
    "from_state_dict",
    "get_backend",
    "known_backends",
    "mrope_positions",
    "plan_step",
    "random_state_dict",
    "text_positions",
    "weight_shapes",
    "window_layout",
]
