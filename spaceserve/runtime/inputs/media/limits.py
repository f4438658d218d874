"""Bounds on what one request's inputs may carry.

Limits are plain frozen dataclasses validated at construction (ValueError names the field), so
a server, a benchmark or an offline caller can build them from flags or config. Text is bounded
by the context length instead (`text.text_byte_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from spaceserve.checks import require_int


def check_positive_ints(obj: object, names: tuple[str, ...]) -> None:
    """ValueError unless every named field of `obj` is an int >= 1 (bools refused)."""
    for name in names:
        value = getattr(obj, name)
        require_int(name, value)


@dataclass(frozen=True)
class ImageLimits:
    """Per-image and per-request bounds; `allowed_local_dir` (the folder file:// image and
    video URLs may read from) None refuses every file://.

    `max_request_pixels` is the per-request budget of decoded pixels: all images of one request
    and its videos' sampled frames together (`video.OpenedVideo.pixels`), checked from the
    headers before anything is decoded."""

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    allowed_local_dir: str | None = None
    max_request_pixels: int = 2 * 4096 * 4096

    def __post_init__(self) -> None:
        check_positive_ints(self, ("max_image_bytes", "max_image_pixels",
                                   "max_images_per_request", "max_request_pixels"))


@dataclass(frozen=True)
class VideoLimits:
    """Per-video and per-request bounds, all checked before a frame is decoded: the encoded
    size, the pixels of one frame and the frames the stream holds (from the container header;
    they bound decoding work, while sampling keeps at most a few hundred of them)."""

    max_video_bytes: int = 64 * 1024 * 1024
    max_video_pixels: int = 4096 * 2160
    max_video_frames: int = 9000
    max_videos_per_request: int = 2

    def __post_init__(self) -> None:
        check_positive_ints(self, ("max_video_bytes", "max_video_pixels", "max_video_frames",
                                   "max_videos_per_request"))
