"""Qwen2-VL and Qwen2.5-VL on SpaceServe kernels: loading, stage entry points, attention
backends, planner."""

from spaceserve.models.attention.backends import (
    AttentionBackend,
    BackendUnavailable,
    VitMeta,
    available_backends,
    get_backend,
    known_backends,
)
from spaceserve.models.loading.loader import (
    from_config,
    from_pretrained,
    from_state_dict,
    random_state_dict,
    weight_shapes,
)
from spaceserve.models.mrope import mrope_positions, text_positions
from spaceserve.models.qwen2_5_vl import Qwen25VL
from spaceserve.models.qwen2_5_vl_vision import Qwen25VisionEncoder, WindowEncoderJob, window_layout
from spaceserve.models.qwen2_vl import Qwen2VL
from spaceserve.models.qwen2_vl_text import KVCache, LanguageModel
from spaceserve.models.qwen2_vl_vision import EncoderJob, VisionEncoder
from spaceserve.models.step.context import HostMeta, StepContext, plan_step
from spaceserve.models.step.cuda_graph import DecodeGraph, DecodeGraphSet, GraphMemoryError

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
