"""How a video becomes patches and timestamps as Qwen3-VL's processor makes them:
`Qwen3VideoSampling`.

What differs from Qwen2-VL (frames.py), following transformers' ``Qwen3VLVideoProcessor`` and
``Qwen3VLProcessor``:

- sampling: ``n = total / video_fps * fps`` frames (truncated), within ``[min_frames,
  max_frames]`` and at most the video's frames, spread evenly from the first frame to the last
  (``linspace(0, total - 1, n)`` rounded); `n` need not be even, the last frame fills the last
  temporal patch;
- frame size: 32-px multiples (16-px patches, 2x2 merge) with ``min_pixels`` / ``max_pixels``
  bounding the whole clip (``t * h * w``), not one frame; with ``cap_pixels_per_frame`` each frame
  also gets at most ``max_video_tokens`` merged tokens' pixels and its share of ``max_pixels``
  (qwen-vl-utils' rule, transformers' opt-in);
- normalisation: mean and std 0.5 (not CLIP's);
- the prompt: every temporal patch is preceded by its time, ``<1.5 seconds>`` (the mean of its
  first and last frame's time in the source video, one decimal), and wrapped in its own
  ``<|vision_start|>`` / ``<|vision_end|>``: one video's tokens are split per temporal patch.

The patch order is Qwen2-VL's (`frames.video_patches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spaceserve.models.qwen3_vl.processing import IMAGE_MEAN, IMAGE_STD, PATCH_SIZE
from spaceserve.runtime.inputs.media.frames import VideoSampling

HALF = IMAGE_MEAN  # Qwen3-VL's normalisation (`spaceserve.models.qwen3_vl.processing`)


@dataclass(frozen=True)
class Qwen3VideoSampling(VideoSampling):
    """Qwen3-VL's video settings. Defaults are transformers' ``Qwen3VLVideoProcessor``'s;
    ``max_video_tokens`` is a per-frame ceiling here (merged tokens), used only with
    ``cap_pixels_per_frame``."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    max_video_tokens: int = 768
    patch_size: int = PATCH_SIZE
    image_mean: tuple[float, ...] = IMAGE_MEAN
    image_std: tuple[float, ...] = IMAGE_STD
    cap_pixels_per_frame: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.cap_pixels_per_frame, bool):
            raise ValueError(f"cap_pixels_per_frame={self.cap_pixels_per_frame!r} must be a "
                             "bool")

    def sample(self, total_frames: int, video_fps: float) -> list[int]:
        """Indices of the frames to keep: evenly from the first to the last frame."""
        import numpy as np

        n = int(total_frames / video_fps * self.fps)
        n = min(max(n, self.min_frames), self.max_frames, total_frames)
        return [int(i) for i in np.linspace(0, total_frames - 1, n).round().astype(int)]

    def frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """(height, width) of `num_frames` sampled frames: sides multiples of `factor`, the
        aspect ratio kept, the clip's pixels within [min_pixels, max_pixels] (a clip shorter
        than one temporal patch counts as one patch)."""
        f, tps = self.factor, self.temporal_patch_size
        frames = max(num_frames, tps)
        max_px = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * f * f, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            max_px = per_frame * frames
        if height < f or width < f:
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
        h, w = round(height / f) * f, round(width / f) * f
        t = round(frames / tps) * tps
        if t * h * w > max_px:
            beta = math.sqrt(frames * height * width / max_px)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif t * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def within_tokens(self, tokens: int) -> Qwen3VideoSampling:
        """These settings with one video's tokens bounded by `tokens` (a context length): the
        clip's pixels at most `tokens` merged tokens' worth (a clip of ``t`` frames holds
        ``ceil(t / 2) * h * w / factor^2`` tokens, at most its pixels / factor^2), never under
        ``min_pixels``."""
        f = self.factor
        return replace(self, max_pixels=max(self.min_pixels,
                                            min(self.max_pixels, tokens * f * f)))

    def timestamps(self, indices: Sequence[int], video_fps: float) -> list[float]:
        """Seconds of each temporal patch in the source video: the mean of its first and last
        frame's time (the last frame repeated to fill the last patch)."""
        tps = self.temporal_patch_size
        idx = list(indices)
        if not idx:
            return []
        idx += [idx[-1]] * (-len(idx) % tps)
        times = [i / video_fps for i in idx]
        return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's tokens: ``<1.5 seconds>``."""
    return f"<{seconds:.1f} seconds>"


__all__ = ["HALF", "Qwen3VideoSampling", "timestamp_text"]
