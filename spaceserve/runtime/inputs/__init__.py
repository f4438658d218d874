"""Input processing: what a request carries, turned into the engine's token ids and pixels.

chat.py (`ChatPreprocessor`: chat messages -> templated text, image loading, image-token
expansion, as a cheap `plan` and a decoding `finish`; also the engine's processor call),
text.py (client text: special tokens as plain text, `encode_plain`; byte bounds from the context
length), images.py (format allow-list, header-first decoding under pixel limits), media.py
(``data:`` / ``file://`` URLs to bytes under a byte limit; remote URLs refused; local files
"not allowed or not found"), limits.py (`ImageLimits`), budget.py (`PixelBudget`: the server's
decoded pixels in preprocessing), pool.py (`PreprocessPool`: light and heavy lanes, bounded
queues, deadlines), errors.py (`InputError`: a ValueError with a machine-readable `kind` and
the `param` at fault), processor.py (`load_processor`: a checkpoint's tokenizer and
processor), prompt.py (`process_prompt`: an engine prompt validated against the
model and the engine's limits).

Nothing here knows HTTP: the server maps an `InputError`'s kind to a status code. Importing this
package is light (no torch); `process_prompt` loads torch when first asked for.
"""

from __future__ import annotations

from typing import Any

from .budget import PixelBudget, PixelLease
from .chat import ChatPlan, ChatPreprocessor, MediaRef
from .errors import KINDS, ImageError, InputError, safe_detail
from .images import (
    IMAGE_FORMATS,
    decode_image,
    image_format_of_mime,
    load_image,
    load_image_url,
    open_image,
)
from .limits import ImageLimits
from .media import (
    LOADERS,
    check_dir,
    data_url_mime,
    load_url_bytes,
    resolve_local_file,
    to_data_url,
)
from .pool import DeadlineExceeded, PreprocessPool, QueueFull
from .processor import load_processor
from .text import (
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
    "ImageError",
    "ImageLimits",
    "InputError",
    "MediaRef",
    "PixelBudget",
    "PixelLease",
    "PreprocessPool",
    "QueueFull",
    "check_dir",
    "check_text_size",
    "control_tokens",
    "data_url_mime",
    "decode_image",
    "encode_marked",
    "encode_plain",
    "image_format_of_mime",
    "load_image",
    "load_image_url",
    "load_processor",
    "load_url_bytes",
    "mark_plain",
    "open_image",
    "process_prompt",
    "resolve_local_file",
    "safe_detail",
    "text_byte_limit",
    "to_data_url",
]


def __getattr__(name: str) -> Any:
    if name == "process_prompt":  # torch-heavy: loaded on first use
        from .prompt import process_prompt

        return process_prompt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
