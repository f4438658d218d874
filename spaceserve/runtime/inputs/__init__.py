"""Input processing: what a request carries, turned into the engine's token ids and pixels.

chat.py (`ChatPreprocessor`: chat messages -> templated text, media loading, image- and
video-token expansion, as a cheap `plan` (`start_plan`, `read_media`) and a decoding `finish`),
prompt_encoder.py (`PromptEncoder`: prompt text and decoded media -> token ids and pixel values;
the engine's processor call), text.py (client text: special tokens as plain text,
`encode_plain`; byte bounds from the context length), pool.py (`PreprocessPool`: light and heavy
lanes, bounded queues, deadlines, `cancel_point`), errors.py (`InputError`: a ValueError with a
machine-readable `kind` and the `param` at fault), processor.py (`load_processor`: a
checkpoint's tokenizer and processor), family.py (`model_family`: the checkpoint's
``model_type``, which picks its video sampling and, when its tokenizer has none, its chat
template), prompt.py (`process_prompt`: an engine prompt validated
against the model and the engine's limits).

media/: images.py (format allow-list, header-first decoding under pixel limits), video.py (PyAV:
container allow-list, header-first decoding under `VideoLimits`), frames.py (`VideoSampling`:
frame sampling and patches as Qwen2-VL's processor does), frames_qwen3.py
(`Qwen3VideoSampling`: Qwen3-VL's sampling, clip-wide resize rule and per-temporal-patch
timestamps), urls.py (``data:`` / ``file://`` URLs
to bytes under a byte limit, local files "not allowed or not found"; http(s) only through a
fetcher), remote.py (`RemoteFetcher`: http(s) under an allow-list of domains, public addresses
only, off by default), limits.py (`ImageLimits`, `VideoLimits`), budget.py (`PixelBudget`: the
server's decoded pixels in preprocessing).

Nothing here serves HTTP: the server maps an `InputError`'s kind to a status code (the remote
fetcher is an HTTP client). Importing this package is light (no torch, httpx or PyAV); they load
when first needed.
"""

from __future__ import annotations

from typing import Any

from spaceserve.runtime.inputs.chat import ChatPlan, ChatPreprocessor, MediaRef
from spaceserve.runtime.inputs.errors import KINDS, ImageError, InputError, safe_detail
from spaceserve.runtime.inputs.family import model_family
from spaceserve.runtime.inputs.media.budget import PixelBudget, PixelLease
from spaceserve.runtime.inputs.media.frames import VideoSampling
from spaceserve.runtime.inputs.media.frames_qwen3 import Qwen3VideoSampling
from spaceserve.runtime.inputs.media.images import (
    IMAGE_FORMATS,
    decode_image,
    image_format_of_mime,
    image_hash,
    load_image,
    load_image_url,
    open_image,
)
from spaceserve.runtime.inputs.media.limits import ImageLimits, VideoLimits
from spaceserve.runtime.inputs.media.remote import RemoteFetcher, RemotePolicy, address_problem
from spaceserve.runtime.inputs.media.urls import (
    LOADERS,
    check_dir,
    data_url_mime,
    load_url_bytes,
    load_url_media,
    resolve_local_file,
    to_data_url,
)
from spaceserve.runtime.inputs.media.video import (
    DecodedVideo,
    OpenedVideo,
    decode_video,
    load_video,
    load_video_url,
    open_video,
    video_format_of_mime,
)
from spaceserve.runtime.inputs.pool import (
    DeadlineExceeded,
    PreprocessPool,
    QueueFull,
    cancel_point,
)
from spaceserve.runtime.inputs.processor import load_processor
from spaceserve.runtime.inputs.prompt_encoder import PromptEncoder
from spaceserve.runtime.inputs.text import (
    check_text_size,
    control_tokens,
    encode_marked,
    encode_plain,
    mark_plain,
    text_byte_limit,
)

__all__ = [
    "IMAGE_FORMATS",
    "KINDS",
    "LOADERS",
    "ChatPlan",
    "ChatPreprocessor",
    "DeadlineExceeded",
    "DecodedVideo",
    "ImageError",
    "ImageLimits",
    "InputError",
    "MediaRef",
    "OpenedVideo",
    "PixelBudget",
    "PixelLease",
    "PreprocessPool",
    "PromptEncoder",
    "QueueFull",
    "Qwen3VideoSampling",
    "RemoteFetcher",
    "RemotePolicy",
    "VideoLimits",
    "VideoSampling",
    "address_problem",
    "cancel_point",
    "check_dir",
    "check_text_size",
    "control_tokens",
    "data_url_mime",
    "decode_image",
    "decode_video",
    "encode_marked",
    "encode_plain",
    "image_format_of_mime",
    "image_hash",
    "load_image",
    "load_image_url",
    "load_processor",
    "load_url_bytes",
    "load_url_media",
    "load_video",
    "load_video_url",
    "mark_plain",
    "model_family",
    "open_image",
    "open_video",
    "process_prompt",
    "resolve_local_file",
    "safe_detail",
    "text_byte_limit",
    "to_data_url",
    "video_format_of_mime",
]


def __getattr__(name: str) -> Any:
    if name == "process_prompt":  # torch-heavy: loaded on first use
        from spaceserve.runtime.inputs.prompt import process_prompt

        return process_prompt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
