"""Videos: decoded with PyAV under `VideoLimits`, sampled and patched as Qwen2-VL's processor does.

A video becomes frames sampled uniformly at `VideoSampling.fps` (at least ``min_frames``, at
most ``max_frames``, an even count for temporal patches of 2; transformers'
``Qwen2VLVideoProcessor.sample_frames``), each resized to a multiple of 28 px between
``min_pixels`` and ``max_pixels`` with the total capped by ``max_video_tokens`` (its
``cap_pixels_per_frame``, as qwen-vl-utils does), then normalised and cut into ``[t * h * w,
3 * 2 * 14 * 14]`` patches (the last frame repeated to fill the last temporal patch). The
sampled frame rate gives ``second_per_grid_ts`` (Qwen2.5-VL's M-RoPE time spacing).

Decoding is bounded before any frame is decoded: the encoded size (the URL loader), the frame
size and frame count from the container header (`VideoLimits`). Only the demuxers of common
video containers may open the bytes, and nested opens (playlists, references to other files
or URLs) are refused. PyAV is an optional dependency (``pip install 'spaceserve[video]'``);
without it a video is refused with a clear error. Every failure is an `InputError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from .errors import InputError
from .limits import ImageLimits, VideoLimits, check_positive_ints
from .media import load_url_bytes

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ffmpeg demuxers a video may be read with (mp4/mov, webm/mkv, avi, mpeg-ts, ogg, flv, gif)
DEMUXERS = "mov,matroska,avi,mpegts,ogg,flv,gif"


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


@dataclass(frozen=True)
class DecodedVideo:
    """Sampled, resized RGB frames ``[T, H, W, 3]`` (uint8) of one video.

    `content_hash` digests the frames and the sampling settings: equal hashes mean equal
    encoder input (the key of an encoder-output cache). `second_per_grid_ts` is the time one
    temporal patch spans.
    """

    frames: Any  # numpy uint8 [T, H, W, 3]
    source_fps: float
    total_frames: int
    indices: tuple[int, ...]
    second_per_grid_ts: float
    content_hash: str

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def _bad(where: str, msg: str) -> InputError:
    return InputError(f"{where}: {msg}", kind="bad_video", param=where)


def _refuse_nested_open(url: Any, flags: Any, options: Any) -> Any:
    raise OSError("a video may not open other files or URLs")


def _open(raw: bytes, where: str) -> Any:
    try:
        import av
    except ImportError:
        raise InputError(f"{where}: video input needs PyAV, which this server lacks "
                         "(pip install 'spaceserve[video]')", kind="unsupported",
                         param=where) from None
    try:
        return av.open(io.BytesIO(raw), mode="r", metadata_errors="ignore",
                       container_options={"format_whitelist": DEMUXERS},
                       io_open=_refuse_nested_open)
    except Exception as exc:  # PyAV raises many types; all mean "not a video we read"
        raise _bad(where, f"cannot open video: not an mp4/mov, webm/mkv, avi, mpeg-ts, ogg, "
                          f"flv or gif file, or corrupt ({type(exc).__name__})") from None


def _header(raw: bytes, limits: VideoLimits, where: str) -> tuple[int, int, float, int]:
    """(height, width, fps, frames) from the container, checked against `limits`; counts
    packets when the header holds no frame count."""
    with _open(raw, where) as container:
        if not container.streams.video:
            raise _bad(where, "the file holds no video stream")
        stream = container.streams.video[0]
        w, h = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if w < 1 or h < 1:
            raise _bad(where, "the video stream has no frame size")
        if w * h > limits.max_video_pixels:
            raise InputError(f"{where}: video frames of {w}x{h} pixels exceed the limit of "
                             f"{limits.max_video_pixels} pixels", kind="too_large", param=where)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not (math.isfinite(fps) and fps > 0):
            raise _bad(where, "cannot tell the video's frame rate")
        total = int(stream.frames or 0)
        if total <= 0:
            total = 0
            for packet in container.demux(stream):
                total += 1 if packet.size else 0
                if total > limits.max_video_frames:
                    break
    if total < 1:
        raise _bad(where, "the video holds no frames")
    if total > limits.max_video_frames:
        raise InputError(f"{where}: video of more than {limits.max_video_frames} frames "
                         f"exceeds the limit", kind="too_large", param=where)
    return h, w, fps, total


def _decode_frames(raw: bytes, indices: list[int], size: tuple[int, int], where: str
                   ) -> tuple[list[Any], int]:
    """The frames at `indices` (sorted), resized to `size` (h, w), and how many frames were
    decoded; stops after the last index."""
    import numpy as np
    from PIL import Image

    wanted, last = set(indices), indices[-1]
    out: list[Any] = []
    count = 0
    with _open(raw, where) as container:
        for frame in container.decode(container.streams.video[0]):
            if count in wanted:
                img = frame.to_image()  # RGB
                if img.size != (size[1], size[0]):
                    img = img.resize((size[1], size[0]), Image.BICUBIC)
                out.append(np.asarray(img, dtype=np.uint8))
            count += 1
            if count > last:
                break
    return out, count


def decode_video(raw: bytes, limits: VideoLimits, sampling: VideoSampling,
                 where: str = "video") -> DecodedVideo:
    """Encoded video bytes to sampled, resized frames under `limits`; InputError otherwise."""
    import numpy as np

    try:
        h, w, fps, total = _header(raw, limits, where)
        for _ in range(2):  # a second pass when the header over-counts the frames
            indices = sampling.sample(total, fps)
            size = sampling.frame_size(h, w, len(indices))
            frames, seen = _decode_frames(raw, indices, size, where)
            if len(frames) == len(indices):
                break
            if seen < 1:
                raise _bad(where, "no frame could be decoded")
            total = seen
        else:
            raise _bad(where, "the frames decoded disagree with the container")
    except InputError:
        raise
    except Exception as exc:  # PyAV / PIL raise many types; all mean "not a usable video"
        raise _bad(where, f"cannot decode video ({type(exc).__name__}: {exc})") from None
    stack = np.stack(frames)
    sampled_fps = len(indices) / total * fps
    seconds = sampling.temporal_patch_size / sampled_fps
    return DecodedVideo(stack, fps, total, tuple(indices), seconds,
                        video_hash(stack, sampling, seconds))


def video_hash(frames: Any, sampling: VideoSampling, second_per_grid_ts: float) -> str:
    """Content hash of sampled frames under `sampling` (hex, 32 characters)."""
    h = hashlib.blake2b(digest_size=16, person=b"ss-video")
    h.update(sampling.fingerprint())
    h.update(repr((tuple(frames.shape), round(float(second_per_grid_ts), 9))).encode())
    h.update(memoryview(frames.tobytes()))
    return h.hexdigest()


def load_video_url(url: str, limits: ImageLimits, video_limits: VideoLimits,
                   sampling: VideoSampling, where: str = "video_url", *,
                   fetcher: Any = None) -> DecodedVideo:
    """Decode one video URL (``data:``, ``file://`` under the allowed folder, or http(s)
    through `fetcher`) under the limits; InputError otherwise."""
    raw = load_url_bytes(url, where=where, max_bytes=video_limits.max_video_bytes,
                         allowed_local_dir=limits.allowed_local_dir, media="video",
                         fetcher=fetcher)
    return decode_video(raw, video_limits, sampling, where)


def load_video(item: Any, index: int, sampling: VideoSampling) -> DecodedVideo:
    """One video of an offline prompt (a trusted caller: the default limits): encoded bytes,
    a ``data:`` URL, a ``file://`` URL or a path; or frames already sampled (uint8
    ``[T, H, W, 3]``, taken to be `sampling.fps` apart)."""
    import numpy as np

    where = f"videos[{index}]"
    if isinstance(item, (bytes, bytearray)):
        return decode_video(bytes(item), VideoLimits(), sampling, where)
    if isinstance(item, str) and item.startswith("data:"):
        raw = load_url_bytes(item, where=where, max_bytes=VideoLimits().max_video_bytes,
                             allowed_local_dir=None, media="video")
        return decode_video(raw, VideoLimits(), sampling, where)
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item).removeprefix("file://")
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise InputError(f"{where}: cannot read {path!r} ({exc.strerror})",
                             kind="not_found", param=where) from None
        return decode_video(raw, VideoLimits(), sampling, where)
    arr = np.asarray(item)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or 0 in arr.shape:
        raise _bad(where, "frames must be uint8 [T, H, W, 3]")
    from PIL import Image

    try:
        size = sampling.frame_size(arr.shape[1], arr.shape[2], arr.shape[0])
    except ValueError as exc:
        raise _bad(where, str(exc)) from None
    frames = np.stack([np.asarray(Image.fromarray(f).resize((size[1], size[0]), Image.BICUBIC))
                       if f.shape[:2] != size else f for f in arr])
    seconds = sampling.temporal_patch_size / sampling.fps
    return DecodedVideo(frames, sampling.fps, arr.shape[0], tuple(range(arr.shape[0])), seconds,
                        video_hash(frames, sampling, seconds))


def video_patches(video: DecodedVideo, sampling: VideoSampling) -> tuple[Any, tuple[int, int, int]]:
    """(pixel_values ``[t * h * w, 3 * T * P * P]`` float32, grid (t, h, w)) of one video, in
    the patch order of transformers' Qwen2-VL video processor."""
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


__all__ = ["DEMUXERS", "DecodedVideo", "VideoLimits", "VideoSampling", "decode_video",
           "load_video", "load_video_url", "video_hash", "video_patches"]
