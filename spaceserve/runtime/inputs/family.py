"""Which model family a checkpoint is, and what its inputs differ in.

The family is the checkpoint's ``config.json`` ``model_type`` (``qwen2_vl``, ``qwen2_5_vl``,
``qwen3_vl``). Images go through the checkpoint's own image processor in every family (Qwen3-VL
uses Qwen2-VL's with 16-px patches and mean/std 0.5, as its ``preprocessor_config.json`` says);
videos differ: Qwen2-VL and Qwen2.5-VL sample them as `frames.VideoSampling` does, Qwen3-VL as
`frames_qwen3.Qwen3VideoSampling` does (its own sampling and resize rule, and a timestamp before
every temporal patch in the prompt). Qwen3-VL's processor settings are declared once, in
`spaceserve.models.qwen3_vl.processing`: what a checkpoint's ``preprocessor_config.json`` leaves
out comes from there (`image_processor_defaults`), not from the Qwen2-VL processor's defaults,
and a processor whose patch geometry is not the vision tower's is refused (`check_geometry`).
`chat_template` finds a checkpoint's template where the tokenizer did not load one
(``chat_template.jinja`` / ``chat_template.json``, the processor's files), else the
family's shape (`QWEN3_VL_CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from spaceserve.models.qwen3_vl.processing import CHAT_TEMPLATE, processor_settings
from spaceserve.runtime.inputs.media.frames import VideoSampling
from spaceserve.runtime.inputs.media.frames_qwen3 import Qwen3VideoSampling

FAMILY_SAMPLING: dict[str, type[VideoSampling]] = {
    "qwen2_vl": VideoSampling,
    "qwen2_5_vl": VideoSampling,
    "qwen3_vl": Qwen3VideoSampling,
}

# Qwen3-VL's chat turns when a checkpoint has none: no default system message (Qwen2-VL's
# template adds one); declared with the family's processor settings.
QWEN3_VL_CHAT_TEMPLATE = CHAT_TEMPLATE
FAMILY_TEMPLATES = {"qwen3_vl": QWEN3_VL_CHAT_TEMPLATE}


def model_family(path: str | os.PathLike) -> str | None:
    """The ``model_type`` of a local checkpoint's ``config.json`` (None: no readable config)."""
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file) as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _read_json(path: str | os.PathLike, name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(os.fspath(path), name)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _vision_config(path: str | os.PathLike) -> dict[str, Any]:
    vision = _read_json(path, "config.json").get("vision_config")
    return vision if isinstance(vision, dict) else {}


def image_processor_defaults(path: str | os.PathLike, family: str | None) -> dict[str, Any]:
    """Image processor fields a checkpoint's ``preprocessor_config.json`` leaves out that its
    family fixes: for Qwen3-VL the patch geometry of ``config.json``'s ``vision_config`` and
    mean / std 0.5 (`processing.processor_settings`), where transformers' Qwen2-VL image
    processor would default to 14-px patches and CLIP's normalisation. Empty for the others."""
    if family != "qwen3_vl":
        return {}
    written = _read_json(path, "preprocessor_config.json")
    from types import SimpleNamespace

    settings = processor_settings(SimpleNamespace(**_vision_config(path)))
    return {k: v for k, v in settings.items() if k not in written}


class ProcessorMismatch(ValueError):
    """A checkpoint's processor files disagree with its model (`check_geometry`): loading
    stops here rather than falling back to a processor that cannot take media."""


# (processor field, vision_config field)
GEOMETRY = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
            ("merge_size", "spatial_merge_size"))


def check_geometry(path: str | os.PathLike, *processors: Any) -> None:
    """ProcessorMismatch (a ValueError) naming the field when an image processor's or video
    sampling's patch geometry is not the vision tower's (``config.json``'s
    ``vision_config``): the prompt's token counts would not be what the encoder returns.
    Fields either side lacks are not compared."""
    vision = _vision_config(path)
    for proc in processors:
        for ours, theirs in GEOMETRY:
            want, got = vision.get(theirs), getattr(proc, ours, None)
            if isinstance(want, int) and isinstance(got, int) and want != got:
                raise ProcessorMismatch(
                    f"{os.fspath(path)}: the {type(proc).__name__} has {ours}={got}, but "
                    f"config.json's vision_config has {theirs}={want}; fix the checkpoint's "
                    "preprocessor_config.json / video_preprocessor_config.json")


def sampling_class(family: str | None) -> type[VideoSampling]:
    """The video settings class of a family (Qwen2-VL's for an unknown one)."""
    return FAMILY_SAMPLING.get(family or "", VideoSampling)


def chat_template(path: str | os.PathLike, family: str | None) -> str | None:
    """The chat template of a checkpoint whose tokenizer has none: its ``chat_template.jinja``
    or ``chat_template.json`` (``{"chat_template": ...}``), else its family's, else None."""
    root = os.fspath(path)
    try:
        with open(os.path.join(root, "chat_template.jinja")) as f:
            return f.read()
    except OSError:
        pass
    try:
        with open(os.path.join(root, "chat_template.json")) as f:
            found: Any = json.load(f).get("chat_template")
        if isinstance(found, str):
            return found
    except (OSError, ValueError, AttributeError):
        pass
    return FAMILY_TEMPLATES.get(family or "")


__all__ = ["FAMILY_SAMPLING", "FAMILY_TEMPLATES", "GEOMETRY", "QWEN3_VL_CHAT_TEMPLATE",
           "ProcessorMismatch",
           "chat_template", "check_geometry", "image_processor_defaults", "model_family",
           "sampling_class"]
