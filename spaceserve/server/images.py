"""Images of chat requests: ``data:`` URLs and local ``file://`` URLs, decoded under limits.

Every failure is an `ImageError` (a ValueError) whose message names the content part, so the
server answers 400 and stays up. Limits bound the encoded bytes, the pixel count (checked from
the header, before any pixel is decoded: no decompression bombs) and, for ``file://``, the
folder a path must resolve into (symbolic links resolved first). Remote URLs are refused: the
server never fetches on a client's behalf.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ImageLimits:
    """Per-image and per-request bounds; `allowed_local_dir` None refuses every file://."""

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    allowed_local_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")


def _data_bytes(url: str, where: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(f"{where}: a data: URL needs a ',' before its payload")
    if not header.endswith(";base64"):
        raise ImageError(f"{where}: only base64 data: URLs are accepted")
    mime = header[5:-7]
    if mime and not mime.startswith("image/"):
        raise ImageError(f"{where}: media type {mime!r} is not an image")
    if len(payload) > 4 * (limits.max_image_bytes // 3 + 2):
        raise ImageError(f"{where}: image larger than {limits.max_image_bytes} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{where}: invalid base64 ({exc})") from None
    if len(raw) > limits.max_image_bytes:
        raise ImageError(f"{where}: image larger than {limits.max_image_bytes} bytes")
    return raw


def _file_bytes(url: str, where: str, limits: ImageLimits) -> bytes:
    if limits.allowed_local_dir is None:
        raise ImageError(f"{where}: file:// URLs are disabled (start the server with "
                         "--allowed-local-media-path)")
    path = url[len("file://"):]
    if not path.startswith("/"):
        raise ImageError(f"{where}: a file:// URL needs an absolute path")
    root = Path(limits.allowed_local_dir).resolve()
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise ImageError(f"{where}: no such file") from None
    if real != root and root not in real.parents:
        raise ImageError(f"{where}: path is outside the allowed media folder")
    if not real.is_file():
        raise ImageError(f"{where}: not a regular file")
    if real.stat().st_size > limits.max_image_bytes:
        raise ImageError(f"{where}: image larger than {limits.max_image_bytes} bytes")
    with open(real, "rb") as f:
        return f.read(limits.max_image_bytes + 1)


def load_image_url(url: str, limits: ImageLimits, where: str = "image_url") -> Any:
    """Decode one image URL to an RGB PIL image, enforcing `limits`; ImageError otherwise."""
    from PIL import Image

    if not isinstance(url, str):
        raise ImageError(f"{where}: url must be a string")
    if url.startswith("data:"):
        raw = _data_bytes(url, where, limits)
    elif url.startswith("file://"):
        raw = _file_bytes(url, where, limits)
    elif url.startswith(("http://", "https://")):
        raise ImageError(f"{where}: remote image URLs are not fetched; send the image inline "
                         "as a data: URL")
    else:
        raise ImageError(f"{where}: unsupported URL scheme (use data: or file://)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            w, h = img.size
            if w < 1 or h < 1 or w * h > limits.max_image_pixels:
                raise ImageError(f"{where}: image of {w}x{h} pixels exceeds the limit of "
                                 f"{limits.max_image_pixels} pixels")
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # PIL raises many types; all mean "not a usable image"
        raise ImageError(f"{where}: cannot decode image ({type(exc).__name__}: {exc})") from None


def to_data_url(image: Any, fmt: str = "PNG") -> str:
    """An image (PIL or encoded bytes) as a base64 ``data:`` URL."""
    if isinstance(image, (bytes, bytearray)):
        raw = bytes(image)
    else:
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        raw = buf.getvalue()
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(raw).decode()


def check_dir(path: str | None) -> str | None:
    """Validate --allowed-local-media-path (an existing folder) and return it absolute."""
    if path is None:
        return None
    if not os.path.isdir(path):
        raise ValueError(f"allowed_local_dir={path!r} is not a directory")
    return os.path.abspath(path)
