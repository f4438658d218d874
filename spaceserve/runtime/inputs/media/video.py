"""Videos: decoded with PyAV under `VideoLimits`, sampled and patched as Qwen2-VL's processor
does (`sampling.VideoSampling`, `sampling.video_patches`).

Decoding is bounded before any frame is decoded: the encoded size (the URL loader), the frame
size and frame count from the container header (`VideoLimits`). Only the demuxers of common
video containers may open the bytes, a media type the source declares (a ``data:`` URL's, a
remote answer's Content-Type) must name the container the bytes are, and nested opens
(playlists, references to other files or URLs) are refused. As for images, reading the header
(`open_video`: an `OpenedVideo`, which says what its decoding will hold, `pixels`, and cost,
`work`) comes apart from decoding (`OpenedVideo.decode`, which checks a deadline between
frames), so a caller can check budgets in between. PyAV is an optional dependency (``pip
install 'spaceserve[video]'``); without it a video is refused with a clear error. Every failure
is an `InputError`; messages never echo library object reprs.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from spaceserve.runtime.inputs.errors import InputError, safe_detail
from spaceserve.runtime.inputs.media.frames import CLIP_MEAN, CLIP_STD, VideoSampling, video_patches
from spaceserve.runtime.inputs.media.limits import ImageLimits, VideoLimits
from spaceserve.runtime.inputs.media.urls import load_url_bytes, load_url_media, mime_source
from spaceserve.runtime.inputs.pool import DeadlineExceeded

# ffmpeg demuxers a video may be read with (mp4/mov, webm/mkv, avi, mpeg-ts, ogg, flv, gif)
DEMUXERS = "mov,matroska,avi,mpegts,ogg,flv,gif"
CONTAINER_NAMES = {"mov": "mp4/mov", "matroska": "webm/mkv", "avi": "avi", "mpegts": "mpeg-ts",
                   "ogg": "ogg", "flv": "flv", "gif": "gif"}
# a declared media type -> the demuxer its bytes must need
MIME_DEMUXERS = {
    "video/mp4": "mov", "video/quicktime": "mov", "video/x-m4v": "mov", "video/3gpp": "mov",
    "video/3gpp2": "mov", "application/mp4": "mov", "video/webm": "matroska",
    "video/x-matroska": "matroska", "video/matroska": "matroska",
    "application/x-matroska": "matroska", "video/x-msvideo": "avi", "video/avi": "avi",
    "video/msvideo": "avi", "video/mp2t": "mpegts", "video/ogg": "ogg", "application/ogg": "ogg",
    "video/x-flv": "flv", "video/gif": "gif", "image/gif": "gif",  # an animated GIF is a clip
}
_ACCEPTED = "mp4/mov, webm/mkv, avi, mpeg-ts, ogg, flv or gif"


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


def video_format_of_mime(mime: str | None, where: str) -> str | None:
    """The demuxer a declared media type requires (None: no type declared, any accepted
    container will do); InputError when the type names no accepted container."""
    if not mime:
        return None
    demuxer = MIME_DEMUXERS.get(mime.strip().lower())
    if demuxer is None:
        raise InputError(f"{where}: video type {mime[:64]!r} is not accepted; send {_ACCEPTED}",
                         kind="unsupported", param=where)
    return demuxer


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
        raise _bad(where, f"cannot open video: not an {_ACCEPTED} file, or corrupt "
                          f"({type(exc).__name__})") from None


def _header(raw: bytes, limits: VideoLimits, where: str, want: str | None, mime: str | None,
            declared_by: str) -> tuple[int, int, float, int]:
    """(height, width, fps, frames) from the container, checked against `limits` and the
    declared container `want`; counts packets when the header holds no frame count."""
    with _open(raw, where) as container:
        names = str(container.format.name).split(",")
        if want is not None and want not in names:
            seen = next((CONTAINER_NAMES[n] for n in names if n in CONTAINER_NAMES), names[0])
            raise _bad(where, f"{declared_by} says {mime} but the data is {seen}")
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


def _decode_frames(raw: bytes, indices: list[int], size: tuple[int, int], where: str,
                   deadline: float | None = None) -> tuple[list[Any], int]:
    """The frames at `indices` (sorted), resized to `size` (h, w), and how many frames were
    decoded; stops after the last index. DeadlineExceeded past `deadline` (monotonic)."""
    import numpy as np
    from PIL import Image

    wanted, last = set(indices), indices[-1]
    out: list[Any] = []
    count = 0
    with _open(raw, where) as container:
        for frame in container.decode(container.streams.video[0]):
            if deadline is not None and count % 8 == 0 and time.monotonic() > deadline:
                raise DeadlineExceeded("preprocessing did not finish before its deadline")
            if count in wanted:
                img = frame.to_image()  # RGB
                if img.size != (size[1], size[0]):
                    img = img.resize((size[1], size[0]), Image.BICUBIC)
                out.append(np.asarray(img, dtype=np.uint8))
            count += 1
            if count > last:
                break
    return out, count


@dataclass(frozen=True)
class OpenedVideo:
    """A video whose container header is read and checked, nothing decoded yet.

    `indices` are the frames sampling keeps and `size` (h, w) their size once resized.
    `pixels` is what the video counts against pixel budgets: its sampled frames (padded to
    whole temporal patches), each as large as the larger of its source and its resized size,
    which covers the frames its decoding keeps and its preprocessed pixel values. `work` is
    its decoding cost in pixels: every frame up to the last sampled one is decoded at source
    size (bounded by `VideoLimits`, not by the pixel budgets).
    """

    raw: bytes
    where: str
    sampling: VideoSampling
    height: int
    width: int
    fps: float
    total: int
    indices: tuple[int, ...]
    size: tuple[int, int]
    pixels: int
    work: int

    def __repr__(self) -> str:  # never the bytes
        return (f"OpenedVideo({self.where!r}, {self.width}x{self.height}, {self.total} frames "
                f"at {self.fps:g} fps, {len(self.indices)} sampled)")

    def decode(self, deadline: float | None = None) -> DecodedVideo:
        """The sampled, resized frames; InputError when the data is damaged, DeadlineExceeded
        past `deadline` (monotonic clock)."""
        import numpy as np

        where, sampling, total = self.where, self.sampling, self.total
        indices, size = list(self.indices), self.size
        try:
            for _ in range(2):  # a second pass when the header over-counts the frames
                frames, seen = _decode_frames(self.raw, indices, size, where, deadline)
                if len(frames) == len(indices):
                    break
                if seen < 1:
                    raise _bad(where, "no frame could be decoded")
                total = seen
                indices = sampling.sample(total, self.fps)
                size = sampling.frame_size(self.height, self.width, len(indices))
            else:
                raise _bad(where, "the frames decoded disagree with the container")
        except (InputError, DeadlineExceeded):
            raise
        except Exception as exc:  # PyAV / PIL raise many types; all mean "not a usable video"
            raise _bad(where, f"cannot decode video ({type(exc).__name__}: "
                              f"{safe_detail(exc)})") from None
        stack = np.stack(frames)
        sampled_fps = len(indices) / total * self.fps
        seconds = sampling.temporal_patch_size / sampled_fps
        return DecodedVideo(stack, self.fps, total, tuple(indices), seconds,
                            video_hash(stack, sampling, seconds))


def open_video(raw: bytes, limits: VideoLimits, sampling: VideoSampling, where: str = "video",
               *, mime: str | None = None, declared_by: str = "the data URL") -> OpenedVideo:
    """Read `raw`'s container header under `limits` (a declared `mime` must name the container
    the bytes are) and plan its sampling; nothing is decoded. InputError otherwise."""
    want = video_format_of_mime(mime, where)
    try:
        h, w, fps, total = _header(raw, limits, where, want, mime, declared_by)
        indices = sampling.sample(total, fps)
        size = sampling.frame_size(h, w, len(indices))
        largest = sampling.frame_size(h, w, 1)  # fewer frames never get larger ones
    except InputError:
        raise
    except Exception as exc:  # PyAV raises many types; frame_size an odd aspect ratio
        raise _bad(where, f"cannot read the video ({type(exc).__name__}: "
                          f"{safe_detail(exc)})") from None
    tps = sampling.temporal_patch_size
    frames = -(-len(indices) // tps) * tps
    pixels = frames * max(h * w, largest[0] * largest[1], size[0] * size[1])
    return OpenedVideo(raw, where, sampling, h, w, fps, total, tuple(indices), size, pixels,
                       (indices[-1] + 1) * h * w)


def decode_video(raw: bytes, limits: VideoLimits, sampling: VideoSampling,
                 where: str = "video", *, mime: str | None = None) -> DecodedVideo:
    """Encoded video bytes to sampled, resized frames under `limits`; InputError otherwise."""
    return open_video(raw, limits, sampling, where, mime=mime).decode()


def video_hash(frames: Any, sampling: VideoSampling, second_per_grid_ts: float) -> str:
    """Content hash of sampled frames under `sampling` (hex, 32 characters)."""
    h = hashlib.blake2b(digest_size=16, person=b"ss-video")
    h.update(sampling.fingerprint())
    h.update(repr((tuple(frames.shape), round(float(second_per_grid_ts), 9))).encode())
    h.update(memoryview(frames.tobytes()))
    return h.hexdigest()


def open_video_url(url: str, limits: ImageLimits, video_limits: VideoLimits,
                   sampling: VideoSampling, where: str = "video_url", *,
                   fetcher: Any = None) -> OpenedVideo:
    """Read one video URL (``data:``, ``file://`` under the allowed folder, or http(s) through
    `fetcher`) and its header under the limits; InputError otherwise."""
    raw, mime = load_url_media(url, where=where, max_bytes=video_limits.max_video_bytes,
                               allowed_local_dir=limits.allowed_local_dir, media="video",
                               fetcher=fetcher)
    return open_video(raw, video_limits, sampling, where, mime=mime,
                      declared_by=mime_source(url))


def load_video_url(url: str, limits: ImageLimits, video_limits: VideoLimits,
                   sampling: VideoSampling, where: str = "video_url", *,
                   fetcher: Any = None) -> DecodedVideo:
    """Decode one video URL (see `open_video_url`) under the limits; InputError otherwise."""
    return open_video_url(url, limits, video_limits, sampling, where, fetcher=fetcher).decode()


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


__all__ = ["CLIP_MEAN", "CLIP_STD", "DEMUXERS", "DecodedVideo", "OpenedVideo", "VideoLimits",
           "VideoSampling", "decode_video", "load_video", "load_video_url", "open_video",
           "open_video_url", "video_format_of_mime", "video_hash", "video_patches"]
