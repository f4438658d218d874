"""Engine prompts: validated token ids and images out of what `Engine.add_request` takes.

A prompt is ``{"prompt_token_ids", "pixel_values"?, "image_grid_thw"?}`` (image tokens already
expanded), ``{"prompt": str, "images": [...]}`` or a bare string. Text prompts go through the
checkpoint's processor (or tokenizer); everything is checked against the model (vocabulary,
image token, patch size, merge size) and the engine's limits (context, KV capacity, images per
prompt). A bad prompt raises ValueError (an `InputError` from the processor) naming the problem:
the engine ends that request with the message and carries on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..request import MultiModalData, check_int
from .images import load_image


def _grid(value: Any) -> torch.Tensor:
    # Host metadata: the planner and the vision tower read it on the host every step, so a
    # device tensor is brought over once here rather than synchronised on later.
    grid = torch.as_tensor(value).to(device="cpu", dtype=torch.int64)
    if grid.dim() == 1 and grid.numel() == 3:
        grid = grid.view(1, 3)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [num_images, 3], got {tuple(grid.shape)}")
    if grid.numel() and int(grid.min()) < 1:
        raise ValueError("image_grid_thw holds a non-positive size")
    return grid


def process_prompt(prompt: Any, info: Any, *, context_len: int, capacity: int, max_images: int,
                   processor: Any = None, tokenizer: Any = None
                   ) -> tuple[list[int], MultiModalData | None]:
    """Validate a prompt against the model (`info`: a runner's ModelInfo) and the engine limits.

    A prompt is ``{"prompt_token_ids", "pixel_values"?, "image_grid_thw"?}`` (image tokens
    already expanded) or ``{"prompt": str, "images": [...]}`` / a bare string when a processor
    exists (a tokenizer alone takes text without images). Returns (token ids, images or None);
    raises ValueError with the reason.
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"prompt must be a dict or a str, got {type(prompt).__name__}")
    if "prompt_token_ids" in prompt:
        ids, pv, grid = prompt["prompt_token_ids"], prompt.get("pixel_values"), \
            prompt.get("image_grid_thw")
    elif "prompt" in prompt:
        images = list(prompt.get("images") or [])
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt must be a str")
        if processor is None and tokenizer is not None and not images:
            return process_prompt({"prompt_token_ids": tokenizer.encode(prompt["prompt"])},
                                  info, context_len=context_len, capacity=capacity,
                                  max_images=max_images)
        if processor is None:
            what = "an image processor" if tokenizer is not None else "a tokenizer"
            raise ValueError(f"prompt: this needs {what}, and this checkpoint has none; pass "
                             "prompt_token_ids (and pixel_values / image_grid_thw)")
        if len(images) > max_images:
            raise ValueError(f"images: {len(images)} images, more than allowed "
                             f"(max_images_per_prompt={max_images})")
        decoded = [load_image(x, i) for i, x in enumerate(images)]
        enc = processor(text=[prompt["prompt"]], images=decoded or None, return_tensors="pt")
        ids, pv, grid = enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw")
    else:
        raise ValueError("prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError("prompt_token_ids must be a sequence of ints")
    ids = [check_int("prompt_token_ids", t, 0) for t in ids]
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    if max(ids) >= info.vocab_size:
        raise ValueError(f"prompt_token_ids holds {max(ids)}, outside the vocabulary "
                         f"({info.vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"prompt_token_ids has {len(ids)} tokens; the context holds "
                         f"{context_len} (max_model_len), leaving no room to generate")
    if len(ids) >= capacity:
        raise ValueError(f"prompt of {len(ids)} tokens can never fit in the KV cache "
                         f"({capacity} tokens in all)")
    img_tok = info.image_token_id
    num_img_tokens = 0 if img_tok is None else sum(1 for t in ids if t == img_tok)
    if pv is None and grid is None:
        if num_img_tokens:
            raise ValueError(f"prompt_token_ids holds {num_img_tokens} image tokens but no "
                             "pixel_values / image_grid_thw were given")
        return ids, None
    if pv is None or grid is None:
        missing = "pixel_values" if pv is None else "image_grid_thw"
        raise ValueError(f"{missing} is missing (images need pixel_values and image_grid_thw)")
    if img_tok is None:
        raise ValueError("pixel_values: this model takes no images")
    grid = _grid(grid)
    if grid.shape[0] > max_images:
        raise ValueError(f"image_grid_thw: {grid.shape[0]} images, more than allowed "
                         f"(max_images_per_prompt={max_images})")
    merge = info.spatial_merge_size
    if bool(((grid[:, 1:] % merge) != 0).any()):
        raise ValueError(f"image_grid_thw: h and w must be multiples of the merge size {merge}")
    if not isinstance(pv, torch.Tensor) or pv.dim() != 2:
        raise ValueError("pixel_values must be a 2-D tensor [patches, patch_dim]")
    patches = int(grid.prod(dim=1).sum())
    if pv.shape[0] != patches:
        raise ValueError(f"pixel_values has {pv.shape[0]} patch rows; image_grid_thw needs "
                         f"{patches}")
    if info.patch_dim is not None and pv.shape[1] != info.patch_dim:
        raise ValueError(f"pixel_values rows have {pv.shape[1]} values; the model expects "
                         f"{info.patch_dim}")
    if num_img_tokens != patches // merge**2:
        raise ValueError(f"prompt_token_ids holds {num_img_tokens} image tokens; "
                         f"image_grid_thw gives {patches // merge**2}")
    positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == img_tok)
    return ids, MultiModalData(pv, grid, positions)
