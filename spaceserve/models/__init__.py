"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`qwen3_vl/`) on SpaceServe kernels: loading, stage
entry points, attention backends, planner; `presets` holds the published models' shapes,
`tiny` the `--model tiny` / `--model tiny-qwen3-vl` checkpoint builders.

The names below are imported on first use, so that `spaceserve.models.presets` (pure Python,
read by the runtime's policy and the simulator) does not pull in torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionBackend": "spaceserve.models.attention.backends",
    "BackendUnavailable": "spaceserve.models.attention.backends",
    "VitMeta": "spaceserve.models.attention.backends",
    "available_backends": "spaceserve.models.attention.backends",
    "get_backend": "spaceserve.models.attention.backends",
    "known_backends": "spaceserve.models.attention.backends",
    "HostMeta": "spaceserve.models.step.context",
    "StepContext": "spaceserve.models.step.context",
    "plan_step": "spaceserve.models.step.context",
    "DecodeGraph": "spaceserve.models.step.cuda_graph",
    "DecodeGraphSet": "spaceserve.models.step.cuda_graph",
    "GraphMemoryError": "spaceserve.models.step.cuda_graph",
    "from_config": "spaceserve.models.loading.loader",
    "from_pretrained": "spaceserve.models.loading.loader",
    "from_state_dict": "spaceserve.models.loading.loader",
    "random_state_dict": "spaceserve.models.loading.loader",
    "weight_shapes": "spaceserve.models.loading.loader",
    "mrope_positions": "spaceserve.models.mrope",
    "text_positions": "spaceserve.models.mrope",
    "Qwen25VL": "spaceserve.models.qwen2_5_vl",
    "Qwen25VisionEncoder": "spaceserve.models.qwen2_5_vl_vision",
    "WindowEncoderJob": "spaceserve.models.qwen2_5_vl_vision",
    "window_layout": "spaceserve.models.qwen2_5_vl_vision",
    "Qwen2VL": "spaceserve.models.qwen2_vl",
    "KVCache": "spaceserve.models.qwen2_vl_text",
    "LanguageModel": "spaceserve.models.qwen2_vl_text",
    "EncoderJob": "spaceserve.models.qwen2_vl_vision",
    "VisionEncoder": "spaceserve.models.qwen2_vl_vision",
    "Qwen3VL": "spaceserve.models.qwen3_vl.model",
    "Qwen3LanguageModel": "spaceserve.models.qwen3_vl.text",
    "DeepStackJob": "spaceserve.models.qwen3_vl.vision",
    "Qwen3VisionEncoder": "spaceserve.models.qwen3_vl.vision",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'spaceserve.models' has no attribute {name!r}")
