"""Qwen3-VL's preprocessing settings, declared once: the patch geometry (16-px patches,
temporal patch 2, 2x2 merge: what the vision config gives) and the normalisation (mean and std
0.5 per channel, where Qwen2-VL uses CLIP's).

`Qwen3VL.image_processor`, the tiny checkpoint's ``preprocessor_config.json`` and
``video_preprocessor_config.json`` (`spaceserve.models.tiny`) and the input side's Qwen3-VL
defaults (`runtime.inputs.family`, `runtime.inputs.media.frames_qwen3`) all take them from
here; a released checkpoint's own files say the same, and win where they say it. Pure Python:
the input side imports it without torch.
"""

from __future__ import annotations

from typing import Any

# The chat turns of the Qwen family's tiny checkpoints and Qwen3-VL's fallback template: no
# default system message, a media part as <|vision_start|><|image_pad|><|vision_end|> (or
# <|video_pad|>), text parts as written.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def processor_settings(vision_config: Any = None) -> dict[str, Any]:
    """transformers' image / video processor fields of a Qwen3-VL checkpoint: the geometry of
    `vision_config` (its ``patch_size``, ``temporal_patch_size``, ``spatial_merge_size``; the
    defaults above where it has none) and the normalisation, as JSON-ready lists."""
    def get(name: str, default: int) -> int:
        value = getattr(vision_config, name, None) if vision_config is not None else None
        return int(value) if value is not None else default

    return {"patch_size": get("patch_size", PATCH_SIZE),
            "temporal_patch_size": get("temporal_patch_size", TEMPORAL_PATCH_SIZE),
            "merge_size": get("spatial_merge_size", MERGE_SIZE),
            "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD)}


__all__ = ["IMAGE_MEAN", "IMAGE_STD", "MERGE_SIZE", "PATCH_SIZE", "TEMPORAL_PATCH_SIZE",
           "processor_settings"]
