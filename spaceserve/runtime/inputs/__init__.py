"""Input processing: what a request carries, turned into the engine's token ids and pixels.

chat.py (`ChatPreprocessor`: chat messages -> templated text, image loading, image-token
expansion; also the engine's processor call), images.py (decoding under a pixel limit),
media.py (``data:`` / ``file://`` URLs to bytes under a byte limit; remote URLs refused),
limits.py (`ImageLimits`), errors.py (`InputError`: a ValueError with a machine-readable `kind`
and the `param` at fault), processor.py (`load_processor`: a checkpoint's tokenizer and
processor), prompt.py (`process_prompt`: an engine prompt validated against the
model and the engine's limits).

Nothing here knows HTTP: the server maps an `InputError`'s kind to a status code. Importing this
package is light (no torch); `process_prompt` loads torch when first asked for.
"""

from __future__ import annotations

from typing import Any

from .chat import ChatPreprocessor, MediaRef
from .errors import KINDS, ImageError, InputError
from .images import decode_image, load_image, load_image_url
from .limits import ImageLimits
from .media import LOADERS, check_dir, load_url_bytes, to_data_url
from .processor import load_processor

__all__ = [
    "KINDS",
    "LOADERS",
    "ChatPreprocessor",
    "ImageError",
    "ImageLimits",
    "InputError",
    "MediaRef",
    "check_dir",
    "decode_image",
    "load_image",
    "load_image_url",
    "load_processor",
    "load_url_bytes",
    "process_prompt",
    "to_data_url",
]


def __getattr__(name: str) -> Any:
    if name == "process_prompt":  # torch-heavy: loaded on first use
        from .prompt import process_prompt

        return process_prompt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
