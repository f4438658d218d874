"""Images: decoded to RGB from an allow-list of formats, under pixel limits, from a URL (under
`ImageLimits`) or, for an offline prompt, from whatever the caller holds.

Only PNG, JPEG, WebP, GIF (first frame) and BMP are ever decoded: PIL is asked for those
formats alone (``Image.open(..., formats=...)``), so no other plugin parses untrusted bytes
(EPS, which would hand PostScript to Ghostscript, never runs). A media type the source declares
(a ``data:`` URL's, or the Content-Type of a remote image) must name one of them and match what
the bytes are. `open_image` reads only the header, so sizes are checked (per image here, per
request and per server by the caller) before any pixel is decoded. Messages never echo library
object reprs. `image_hash` is a decoded image's content hash (the key of an encoder-output
cache).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import Any

from spaceserve.runtime.inputs.errors import ImageError, InputError, safe_detail
from spaceserve.runtime.inputs.media.limits import ImageLimits
from spaceserve.runtime.inputs.media.urls import data_url_mime, load_url_media, mime_source

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"
MIME_FORMATS = {
    "image/png": "PNG", "image/apng": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
    "image/pjpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF", "image/bmp": "BMP",
    "image/x-bmp": "BMP", "image/x-ms-bmp": "BMP",
}
# What common refused formats start with: named in the message so a client knows why.
_MAGIC = ((b"%!PS", "PostScript/EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"%PDF", "PDF"),
          (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"),
          (b"<svg", "SVG"), (b"<?xml", "XML/SVG"), (b"8BPS", "PSD"))


def image_format_of_mime(mime: str | None, where: str) -> str | None:
    """The PIL format a declared media type requires (None: no type declared, any allowed
    format will do); InputError when the type is not an accepted image format."""
    if not mime:
        return None
    fmt = MIME_FORMATS.get(mime.strip().lower())
    if fmt is None:
        raise ImageError(f"{where}: image type {mime[:64]!r} is not accepted; send "
                         f"{FORMAT_NAMES}", kind="unsupported", param=where)
    return fmt


def _refused(raw: bytes, where: str) -> ImageError:
    head = raw[:16].lstrip()
    name = next((n for magic, n in _MAGIC if head.startswith(magic)), None)
    seen = f" (the data looks like {name})" if name else ""
    return ImageError(f"{where}: not a {FORMAT_NAMES} image{seen}", kind="bad_image",
                      param=where)


def open_image(raw: bytes, max_pixels: int, where: str = "image", *,
               mime: str | None = None, declared_by: str = "the data URL") -> Any:
    """A PIL image of `raw` with only its header read (nothing decoded yet): an accepted
    format, matching `mime` when one is declared (by `declared_by`, as the message names it),
    of at most `max_pixels`; ImageError otherwise."""
    from PIL import Image, UnidentifiedImageError

    want = image_format_of_mime(mime, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below
            img = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise _refused(raw, where) from None
    except Image.DecompressionBombError:
        raise ImageError(f"{where}: image exceeds the limit of {max_pixels} pixels",
                         kind="too_large", param=where) from None
    except Exception as exc:  # a damaged header: PIL raises many types
        raise ImageError(f"{where}: cannot read the image header ({safe_detail(exc)})",
                         kind="bad_image", param=where) from None
    if want is not None and img.format != want:
        raise ImageError(f"{where}: {declared_by} says {mime} but the data is {img.format}",
                         kind="bad_image", param=where)
    w, h = img.size
    if w < 1 or h < 1 or w * h > max_pixels:
        raise ImageError(f"{where}: image of {w}x{h} pixels exceeds the limit of "
                         f"{max_pixels} pixels", kind="too_large", param=where)
    return img


def load_rgb(img: Any, where: str = "image") -> Any:
    """Decode an image opened by `open_image` (its first frame) to RGB; ImageError if the
    data is damaged."""
    try:
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")  # no copy of a large image
    except Exception as exc:  # truncated or corrupt data: PIL raises many types
        raise ImageError(f"{where}: cannot decode the image ({safe_detail(exc)})",
                         kind="bad_image", param=where) from None


def decode_image(raw: bytes, max_pixels: int, where: str = "image", *,
                 mime: str | None = None, declared_by: str = "the data URL") -> Any:
    """Encoded image bytes to an RGB PIL image of at most `max_pixels`; ImageError otherwise."""
    return load_rgb(open_image(raw, max_pixels, where, mime=mime, declared_by=declared_by),
                    where)


def load_image_url(url: str, limits: ImageLimits, where: str = "image_url", *,
                   fetcher: Any = None) -> Any:
    """Decode one image URL (``data:``, ``file://``, or http(s) through `fetcher`) to an RGB
    PIL image under `limits`; InputError otherwise."""
    raw, mime = load_url_media(url, where=where, max_bytes=limits.max_image_bytes,
                               allowed_local_dir=limits.allowed_local_dir, media="image",
                               fetcher=fetcher)
    return decode_image(raw, limits.max_image_pixels, where, mime=mime,
                        declared_by=mime_source(url))


def image_hash(img: Any, settings: bytes = b"") -> str:
    """Content hash of a decoded image (its mode, size and pixels) under processor `settings`
    (hex, 32 characters): equal hashes mean equal encoder input."""
    h = hashlib.blake2b(digest_size=16, person=b"ss-image")
    h.update(settings)
    h.update(repr((img.mode, img.size)).encode())
    h.update(img.tobytes())
    return h.hexdigest()


def load_image(item: Any, index: int) -> Any:
    """Decode one image of an offline prompt (a trusted caller: no size limits): a PIL image,
    encoded bytes, a ``data:`` URL, a ``file://`` URL or a path. Encoded images go through
    the same format allow-list as a server's. InputError naming ``images[index]`` when it
    cannot be decoded."""
    import base64

    from PIL import Image

    where = f"images[{index}]"
    try:
        if isinstance(item, Image.Image):
            img = item
            img.load()
            return img.convert("RGB")
        if isinstance(item, (bytes, bytearray)):
            raw = bytes(item)
        elif isinstance(item, str) and item.startswith("data:"):
            raw = base64.b64decode(item.split(",", 1)[1], validate=True)
        elif isinstance(item, str):
            with open(item.removeprefix("file://"), "rb") as f:
                raw = f.read()
        else:
            raise TypeError(f"unsupported image type {type(item).__name__}")
    except Exception as exc:  # PIL, base64 and the file system raise many types
        raise ImageError(f"{where} cannot be decoded: {type(exc).__name__}: "
                         f"{safe_detail(exc)}", kind="bad_image", param=where) from exc
    mime = data_url_mime(item) if isinstance(item, str) else None
    try:
        return decode_image(raw, 1 << 62, where, mime=mime)
    except ImageError as exc:
        detail = str(exc).removeprefix(f"{where}: ")
        raise ImageError(f"{where} cannot be decoded: {detail}", kind=exc.kind,
                         param=where) from None


__all__ = ["FORMAT_NAMES", "IMAGE_FORMATS", "ImageError", "ImageLimits", "InputError",
           "decode_image", "image_format_of_mime", "image_hash", "load_image", "load_image_url",
           "load_rgb", "open_image"]
