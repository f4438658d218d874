"""Engine prompts: validated token ids and media out of what `Engine.add_request` takes.

A prompt is ``{"prompt_token_ids", "pixel_values"?, "image_grid_thw"?, "pixel_values_videos"?,
"video_grid_thw"?, "second_per_grid_ts"?, "mm_hashes"?}`` (media tokens already expanded;
transformers' names), ``{"prompt": str, "images": [...], "videos": [...]}`` or a bare string.
Text prompts go through the checkpoint's processor (or tokenizer); everything is checked against
the model (vocabulary, image and video tokens, patch size, merge size) and the engine's limits
(context, KV capacity, images per prompt). Images and videos become one `MultiModalData` in
prompt order; an item's tokens need not be one run (a Qwen3-VL video's temporal patches are
separated by their timestamps' text), its positions are each token's place. A bad prompt raises
ValueError (an `InputError` from the processor) naming the problem: the engine ends that request
with the message and carries on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.core.request import MultiModalData, check_int
from spaceserve.runtime.inputs.media.images import load_image


def _grid(value: Any, name: str = "image_grid_thw") -> torch.Tensor:
    # Host metadata: the planner and the vision tower read it on the host every step, so a
    # device tensor is brought over once here rather than synchronised on later.
    grid = torch.as_tensor(value).to(device="cpu", dtype=torch.int64)
    if grid.dim() == 1 and grid.numel() == 3:
        grid = grid.view(1, 3)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{name} must be [num_items, 3], got {tuple(grid.shape)}")
    if grid.numel() and int(grid.min()) < 1:
        raise ValueError(f"{name} holds a non-positive size")
    return grid


def _media(kind: str, pv: Any, grid: Any, tok: int | None, ids_arr: np.ndarray,
           info: Any) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]] | None:
    """(patches, grid, prompt positions of each item's tokens) of one kind, validated."""
    pv_name, grid_name = ("pixel_values", "image_grid_thw") if kind == "image" else \
        ("pixel_values_videos", "video_grid_thw")
    num_tokens = 0 if tok is None else int((ids_arr == tok).sum())
    if pv is None and grid is None:
        if num_tokens:
            raise ValueError(f"prompt_token_ids holds {num_tokens} {kind} tokens but no "
                             f"{pv_name} / {grid_name} were given")
        return None
    if pv is None or grid is None:
        missing = pv_name if pv is None else grid_name
        raise ValueError(f"{missing} is missing ({kind}s need {pv_name} and {grid_name})")
    if tok is None:
        raise ValueError(f"{pv_name}: this model takes no {kind}s")
    grid = _grid(grid, grid_name)
    merge = info.spatial_merge_size
    if bool(((grid[:, 1:] % merge) != 0).any()):
        raise ValueError(f"{grid_name}: h and w must be multiples of the merge size {merge}")
    if not isinstance(pv, torch.Tensor) or pv.dim() != 2:
        raise ValueError(f"{pv_name} must be a 2-D tensor [patches, patch_dim]")
    if grid.shape[0] == 0 and num_tokens == 0 and pv.shape[0] == 0:
        return None  # an empty batch of media: none
    patches = int(grid.prod(dim=1).sum())
    if pv.shape[0] != patches:
        raise ValueError(f"{pv_name} has {pv.shape[0]} patch rows; {grid_name} needs {patches}")
    if info.patch_dim is not None and pv.shape[1] != info.patch_dim:
        raise ValueError(f"{pv_name} rows have {pv.shape[1]} values; the model expects "
                         f"{info.patch_dim}")
    if num_tokens != patches // merge**2:
        raise ValueError(f"prompt_token_ids holds {num_tokens} {kind} tokens; {grid_name} "
                         f"gives {patches // merge**2}")
    where = np.flatnonzero(ids_arr == tok)
    bounds = np.cumsum([0] + (grid.prod(dim=1) // merge**2).tolist())
    return pv, grid, [where[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _hashes(prompt: dict[str, Any], counts: dict[str, int]) -> dict[str, list[str]] | None:
    hashes = prompt.get("mm_hashes")
    if hashes is None:
        return None
    if not isinstance(hashes, dict):
        raise ValueError("mm_hashes must map 'image' / 'video' to lists of strings")
    out = {}
    for kind, n in counts.items():
        values = list(hashes.get(kind) or [])
        if len(values) != n or not all(isinstance(h, str) for h in values):
            raise ValueError(f"mm_hashes[{kind!r}] must hold {n} strings, one per {kind}")
        out[kind] = values
    return out


def _merge(images: Any, videos: Any, seconds: tuple[float, ...],
           hashes: dict[str, list[str]] | None) -> MultiModalData:
    """Images and videos as one `MultiModalData`, items ordered by their first token."""
    items = []  # (first position, kind, index)
    for kind, media in (("image", images), ("video", videos)):
        if media is not None:
            items += [(int(pos[0]), kind, j) for j, pos in enumerate(media[2])]
    items.sort()
    pvs, grids, positions, video_items, hash_list = [], [], [], [], []
    offsets = {kind: np.cumsum([0] + m[1].prod(dim=1).tolist())
               for kind, m in (("image", images), ("video", videos)) if m is not None}
    dtype = (images or videos)[0].dtype
    for row, (_, kind, j) in enumerate(items):
        pv, grid, pos = images if kind == "image" else videos
        pvs.append(pv[int(offsets[kind][j]):int(offsets[kind][j + 1])].to(dtype))
        grids.append(grid[j])
        positions.append(pos[j])
        if kind == "video":
            video_items.append(row)
        if hashes is not None:
            hash_list.append(hashes[kind][j])
    flat = np.concatenate(positions)
    if flat.size > 1 and not bool((np.diff(flat) > 0).all()):
        raise ValueError("prompt_token_ids: the tokens of an image and a video interleave")
    return MultiModalData(torch.cat(pvs), torch.stack(grids), flat,
                          video_items=tuple(video_items), second_per_grid_ts=seconds,
                          hashes=tuple(hash_list) if hashes is not None else None)


def _seconds(value: Any, num_videos: int) -> tuple[float, ...]:
    if value is None:
        return (1.0,) * num_videos
    seconds = torch.as_tensor(value, dtype=torch.float64).flatten().tolist()
    if len(seconds) != num_videos or not all(np.isfinite(s) and s > 0 for s in seconds):
        raise ValueError(f"second_per_grid_ts must hold {num_videos} positive numbers, one per "
                         "video")
    return tuple(float(s) for s in seconds)


def process_prompt(prompt: Any, info: Any, *, context_len: int, capacity: int, max_images: int,
                   processor: Any = None, tokenizer: Any = None
                   ) -> tuple[list[int], MultiModalData | None]:
    """Validate a prompt against the model (`info`: a runner's ModelInfo) and the engine limits.

    A prompt is ``{"prompt_token_ids", ...media fields}`` (media tokens already expanded; see
    the module docstring) or ``{"prompt": str, "images": [...], "videos": [...]}`` / a bare
    string when a processor exists (a tokenizer alone takes text without media). Returns
    (token ids, media or None); raises ValueError with the reason.
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"prompt must be a dict or a str, got {type(prompt).__name__}")
    if "prompt_token_ids" in prompt:
        ids, enc = prompt["prompt_token_ids"], prompt
    elif "prompt" in prompt:
        images = list(prompt.get("images") or [])
        videos = list(prompt.get("videos") or [])
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt must be a str")
        if processor is None and tokenizer is not None and not images and not videos:
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
        kw = {"videos": videos} if videos else {}
        enc = processor(text=[prompt["prompt"]], images=decoded or None, return_tensors="pt",
                        **kw)
        ids = enc["input_ids"][0]
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
    arr = np.asarray(ids, dtype=np.int64)
    images = _media("image", enc.get("pixel_values"), enc.get("image_grid_thw"),
                    info.image_token_id, arr, info)
    videos = _media("video", enc.get("pixel_values_videos"), enc.get("video_grid_thw"),
                    getattr(info, "video_token_id", None), arr, info)
    if images is not None and images[1].shape[0] > max_images:
        raise ValueError(f"image_grid_thw: {images[1].shape[0]} images, more than allowed "
                         f"(max_images_per_prompt={max_images})")
    if videos is None and enc.get("second_per_grid_ts") is not None:
        raise ValueError("second_per_grid_ts is given without videos")
    if images is None and videos is None:
        return ids, None
    counts = {"image": 0 if images is None else int(images[1].shape[0]),
              "video": 0 if videos is None else int(videos[1].shape[0])}
    hashes = _hashes(enc, counts)
    seconds = _seconds(enc.get("second_per_grid_ts"), counts["video"]) if videos else ()
    if videos is None:  # images alone: as given
        pv, grid, pos = images
        return ids, MultiModalData(pv, grid, np.concatenate(pos),
                                   hashes=None if hashes is None else tuple(hashes["image"]))
    return ids, _merge(images, videos, seconds, hashes)
