"""Images: decoded to RGB under a pixel limit, from a URL (under `ImageLimits`) or, for an
offline prompt, from whatever the caller holds.

The pixel count is checked from the header before any pixel is decoded (no decompression
bombs). Every failure of `load_image_url` is an `InputError` naming the content part; a format
allow-list or a pixel budget across a request's images goes beside `decode_image`.
`image_hash` is a decoded image's content hash (the key of an encoder-output cache).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import Any

from .errors import ImageError, InputError
from .limits import ImageLimits
from .media import load_url_bytes


def decode_image(raw: bytes, max_pixels: int, where: str = "image") -> Any:
    """Encoded image bytes to an RGB PIL image of at most `max_pixels`; ImageError otherwise."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            w, h = img.size
            if w < 1 or h < 1 or w * h > max_pixels:
                raise ImageError(f"{where}: image of {w}x{h} pixels exceeds the limit of "
                                 f"{max_pixels} pixels", kind="too_large", param=where)
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # PIL raises many types; all mean "not a usable image"
        raise ImageError(f"{where}: cannot decode image ({type(exc).__name__}: {exc})",
                         kind="bad_image", param=where) from None


def load_image_url(url: str, limits: ImageLimits, where: str = "image_url", *,
                   fetcher: Any = None) -> Any:
    """Decode one image URL (``data:``, ``file://``, or http(s) through `fetcher`) to an RGB
    PIL image under `limits`; InputError otherwise."""
    raw = load_url_bytes(url, where=where, max_bytes=limits.max_image_bytes,
                         allowed_local_dir=limits.allowed_local_dir, media="image",
                         fetcher=fetcher)
    return decode_image(raw, limits.max_image_pixels, where)


def image_hash(img: Any, settings: bytes = b"") -> str:
    """Content hash of a decoded image (its mode, size and pixels) under processor `settings`
    (hex, 32 characters): equal hashes mean equal encoder input."""
    h = hashlib.blake2b(digest_size=16, person=b"ss-image")
    h.update(settings)
    h.update(repr((img.mode, img.size)).encode())
    h.update(img.tobytes())
    return h.hexdigest()


def load_image(item: Any, index: int) -> Any:
    """Decode one image of an offline prompt (a trusted caller: no limits): a PIL image,
    encoded bytes, a ``data:`` URL, a ``file://`` URL or a path. InputError naming
    ``images[index]`` when it cannot be decoded."""
    import base64

    from PIL import Image

    try:
        if isinstance(item, Image.Image):
            img = item
        elif isinstance(item, (bytes, bytearray)):
            img = Image.open(io.BytesIO(item))
        elif isinstance(item, str) and item.startswith("data:"):
            img = Image.open(io.BytesIO(base64.b64decode(item.split(",", 1)[1], validate=True)))
        elif isinstance(item, str):
            img = Image.open(item.removeprefix("file://"))
        else:
            raise TypeError(f"unsupported image type {type(item).__name__}")
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # PIL raises many types; all mean "not an image"
        raise ImageError(f"images[{index}] cannot be decoded: {type(exc).__name__}: {exc}",
                         kind="bad_image", param=f"images[{index}]") from exc


__all__ = ["ImageError", "ImageLimits", "InputError", "decode_image", "image_hash", "load_image",
           "load_image_url"]
