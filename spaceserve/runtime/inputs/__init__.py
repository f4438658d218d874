"""Input processing: what a request carries, turned into the engine's token ids and pixels.

chat.py (`ChatPreprocessor`: chat messages -> templated text, media loading, image- and
video-token expansion; also the engine's processor call), images.py (decoding under a pixel
limit), video.py (PyAV decoding under `VideoLimits`, frame sampling and patches as Qwen2-VL's
processor does), media.py (``data:`` / ``file://`` URLs to bytes under a byte limit; http(s)
only through a fetcher), remote.py (`RemoteFetcher`: http(s) under an allow-list of domains,
public addresses only, off by default), limits.py (`ImageLimits`, `VideoLimits`), errors.py
(`InputError`: a ValueError with a machine-readable `kind` and the `param` at fault),
processor.py (`load_processor`: a checkpoint's tokenizer and processor), prompt.py
(`process_prompt`: an engine prompt validated against the model and the engine's limits).

Nothing here serves HTTP: the server maps an `InputError`'s kind to a status code (the remote
fetcher is an HTTP client). Importing this package is light (no torch, httpx or PyAV); they load
when first needed.
"""

from __future__ import annotations

from typing import Any

from .chat import ChatPreprocessor, MediaRef
from .errors import KINDS, ImageError, InputError
from .images import decode_image, image_hash, load_image, load_image_url
from .limits import ImageLimits, VideoLimits
from .media import LOADERS, check_dir, load_url_bytes, to_data_url
from .processor import load_processor
from .remote import RemoteFetcher, RemotePolicy, address_problem
from .video import DecodedVideo, VideoSampling, decode_video, load_video, load_video_url

__all__ = [
    "KINDS",
    "LOADERS",
    "ChatPreprocessor",
    "DecodedVideo",
    "ImageError",
    "ImageLimits",
    "InputError",
    "MediaRef",
    "RemoteFetcher",
    "RemotePolicy",
    "VideoLimits",
    "VideoSampling",
    "address_problem",
    "check_dir",
    "decode_image",
    "decode_video",
    "image_hash",
    "load_image",
    "load_image_url",
    "load_processor",
    "load_url_bytes",
    "load_video",
    "load_video_url",
    "process_prompt",
    "to_data_url",
]


def __getattr__(name: str) -> Any:
    if name == "process_prompt":  # torch-heavy: loaded on first use
        from .prompt import process_prompt

        return process_prompt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
