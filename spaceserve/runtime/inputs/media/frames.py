"""How a video becomes patches as Qwen2-VL's processor makes them: `VideoSampling` (frame
sampling, frame sizes under the token budget, patch geometry, normalisation) and
`video_patches`.

Frames are sampled uniformly at `VideoSampling.fps` (at least ``min_frames``, at most
``max_frames``, an even count for temporal patches of 2; transformers'
``Qwen2VLVideoProcessor.sample_frames``), each resized to a multiple of 28 px between
``min_pixels`` and ``max_pixels`` with the total capped by ``max_video_tokens`` (its
``cap_pixels_per_frame``, as qwen-vl-utils does), then normalised and cut into ``[t * h * w,
3 * 2 * 14 * 14]`` patches (the last frame repeated to fill the last temporal patch). The
sampled frame rate gives ``second_per_grid_ts`` (Qwen2.5-VL's M-RoPE time spacing). Decoding
(PyAV) is video.py's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from spaceserve.runtime.inputs.media.limits import check_positive_ints

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoSampling:
    """How a video becomes patches: frame sampling, frame size and the patch geometry.

    Defaults are Qwen2-VL's video processor and qwen-vl-utils (2 frames per second, 4 to 768
    frames, 128 to 768 merged tokens per frame, at most 128000 tokens per video); a
    checkpoint's ``video_preprocessor_config.json`` overrides them (`from_pretrained`).
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    max_video_tokens: int = 128000
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        check_positive_ints(self, ("min_frames", "max_frames", "min_pixels", "max_pixels",
                                   "max_video_tokens", "patch_size", "temporal_patch_size",
                                   "merge_size"))
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps={self.fps!r} must be a positive number")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3:
                raise ValueError(f"{name} needs 3 values (RGB), got {value}")
            object.__setattr__(self, name, value)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_processor: Any = None
                        ) -> VideoSampling:
        """The settings of a local checkpoint: ``video_preprocessor_config.json`` when present
        (transformers' field names), else the image processor's patch geometry and
        normalisation with the video defaults above."""
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                "rescale_factor")
        cfg = {k: getattr(image_processor, k) for k in keys
               if getattr(image_processor, k, None) is not None}
        file = os.path.join(os.fspath(path), "video_preprocessor_config.json")
        if os.path.isfile(file):
            with open(file) as f:
                raw = json.load(f)
            size = raw.get("size") or {}
            raw.setdefault("min_pixels", size.get("shortest_edge"))
            raw.setdefault("max_pixels", size.get("longest_edge"))
            cfg.update({k: v for k, v in raw.items() if v is not None and k in
                        cls.__dataclass_fields__})
        return cls(**cfg)

    @property
    def factor(self) -> int:
        """Frame sides are multiples of this (one merged token's side in pixels)."""
        return self.patch_size * self.merge_size

    def fingerprint(self) -> bytes:
        """A stable digest of the settings (part of every video's content hash)."""
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(),
                               digest_size=16).digest()

    def sample(self, total_frames: int, video_fps: float) -> list[int]:
        """Indices of the frames to keep, uniform over the video (transformers'
        ``sample_frames`` with `fps`); a video shorter than one temporal patch keeps every
        frame (its last frame is repeated when patched)."""
        tps = self.temporal_patch_size
        cap = math.floor(min(self.max_frames, total_frames) / tps) * tps
        n = total_frames / video_fps * self.fps
        n = math.floor(min(max(n, self.min_frames), cap, total_frames) / tps) * tps
        if n < 1:
            return list(range(total_frames))
        return [int(i * total_frames / n) for i in range(n)]

    def within_tokens(self, tokens: int) -> VideoSampling:
        """These settings with one video's tokens bounded by `tokens` (a context length):
        frames get smaller to fit."""
        return replace(self, max_video_tokens=min(self.max_video_tokens, tokens))

    def timestamps(self, indices: Any, video_fps: float) -> list[float] | None:
        """Seconds of each temporal patch, for a prompt that writes them before its tokens;
        None: Qwen2-VL's prompt holds a video's tokens in one run, untimed."""
        return None

    def frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """(height, width) of the sampled frames: the aspect ratio kept, sides multiples of
        `factor`, pixels within [min_pixels, per-frame share of the token budget]."""
        f = self.factor
        budget = int(self.max_video_tokens * f * f * 0.9)
        max_px = max(min(self.max_pixels, budget * self.temporal_patch_size // max(num_frames, 1)),
                     int(self.min_pixels * 1.05))
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > max_px:
            beta = math.sqrt(height * width / max_px)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w


def video_patches(video: Any, sampling: VideoSampling) -> tuple[Any, tuple[int, int, int]]:
    """(pixel_values ``[t * h * w, 3 * T * P * P]`` float32, grid (t, h, w)) of one video (a
    `video.DecodedVideo`), in the patch order of transformers' Qwen2-VL video processor."""
    import torch

    x = torch.from_numpy(video.frames).float() * sampling.rescale_factor  # [T, H, W, C]
    mean = torch.tensor(sampling.image_mean)
    std = torch.tensor(sampling.image_std)
    x = ((x - mean) / std).permute(0, 3, 1, 2)  # [T, C, H, W]
    tps, p, m = sampling.temporal_patch_size, sampling.patch_size, sampling.merge_size
    if pad := -x.shape[0] % tps:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    frames, c, height, width = x.shape
    gt, gh, gw = frames // tps, height // p, width // p
    x = x.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tps * p * p).contiguous(), (gt, gh, gw)


__all__ = ["CLIP_MEAN", "CLIP_STD", "VideoSampling", "video_patches"]
