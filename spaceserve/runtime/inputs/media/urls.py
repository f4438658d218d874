"""Media URLs to bytes: ``data:`` URLs and local ``file://`` URLs, under a byte limit.

`load_url_bytes` picks a loader by the URL's prefix from `LOADERS`; every failure is an
`InputError` whose message starts with `where` (the content part). ``file://`` reads only inside
an allowed folder (symbolic links resolved first) and is off unless one is given; the URL is
percent-decoded, and a path outside the folder, missing or not a regular file gets one message
("not allowed or not found"), so answers never tell which files exist (`resolve_local_file`,
shared by every loader of local files, images and videos alike). Remote (``http(s)://``) URLs
are fetched only through a `fetcher` (`remote.RemoteFetcher`: an allow-list of domains, public
addresses only, the same byte limit); without one they are refused. The media kind ("image",
"video") words the messages and checks a ``data:`` URL's media type. `load_url_media` also
gives the media type the source declares (a ``data:`` URL's, an http(s) answer's
Content-Type) to the decoder, which checks it against the bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from spaceserve.runtime.inputs.errors import InputError

# a loader: (url, where, media, max_bytes, allowed_local_dir) -> bytes
Loader = Callable[[str, str, str, int, "str | None"], bytes]

_ARTICLE = {"image": "an", "audio": "an"}
# media types a video may declare beside "video/*" (remote.VIDEO_TYPES, the same for http(s)
# answers): animated GIFs are clips, and some containers are registered under application/
_ALSO = {"video": frozenset({"image/gif", "application/mp4", "application/ogg",
                             "application/x-matroska"})}


def _too_large(where: str, media: str, max_bytes: int) -> InputError:
    return InputError(f"{where}: {media} larger than {max_bytes} bytes", kind="too_large",
                      param=where)


def _data_bytes(url: str, where: str, media: str, max_bytes: int,
                allowed_local_dir: str | None) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InputError(f"{where}: a data: URL needs a ',' before its payload",
                         kind="invalid", param=where)
    if not header.endswith(";base64"):
        raise InputError(f"{where}: only base64 data: URLs are accepted", kind="invalid",
                         param=where)
    mime = header[5:-7].split(";", 1)[0].strip().lower()
    if mime and not mime.startswith(f"{media}/") and mime not in _ALSO.get(media, ()):
        raise InputError(f"{where}: media type {mime[:64]!r} is not {_ARTICLE.get(media, 'a')} "
                         f"{media}", kind="unsupported", param=where)
    if len(payload) > 4 * (max_bytes // 3 + 2):
        raise _too_large(where, media, max_bytes)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{where}: invalid base64 ({exc})", kind="invalid",
                         param=where) from None
    if len(raw) > max_bytes:
        raise _too_large(where, media, max_bytes)
    return raw


def resolve_local_file(url: str, allowed_local_dir: str | None, where: str,
                       media: str = "image") -> Path:
    """The regular file a ``file://`` URL names inside `allowed_local_dir` (percent-decoded,
    symbolic links resolved); one InputError for "outside the folder", "missing" and "not a
    regular file", so the answer never tells which files exist."""
    if allowed_local_dir is None:
        raise InputError(f"{where}: file:// URLs are disabled (start the server with "
                         "--allowed-local-media-path)", kind="not_allowed", param=where)
    try:
        parts = urlsplit(url)
    except ValueError:
        raise InputError(f"{where}: malformed file:// URL", param=where) from None
    if parts.netloc not in ("", "localhost"):
        raise InputError(f"{where}: a file:// URL names no host (file:///path)", param=where)
    path = unquote(parts.path, errors="strict") if "%" in parts.path else parts.path
    if not path.startswith("/"):
        raise InputError(f"{where}: a file:// URL needs an absolute path", param=where)
    refused = InputError(f"{where}: {media} file is not allowed or not found",
                         kind="not_allowed", param=where)
    try:
        root = Path(allowed_local_dir).resolve()
        real = Path(path).resolve(strict=True)
        if (real != root and root not in real.parents) or not real.is_file():
            raise refused
    except (OSError, RuntimeError, ValueError, UnicodeError):  # missing, loop, NUL byte
        raise refused from None
    return real


def _file_bytes(url: str, where: str, media: str, max_bytes: int,
                allowed_local_dir: str | None) -> bytes:
    real = resolve_local_file(url, allowed_local_dir, where, media)
    try:
        with open(real, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError:
        raise InputError(f"{where}: {media} file is not allowed or not found",
                         kind="not_allowed", param=where) from None
    if len(raw) > max_bytes:
        raise _too_large(where, media, max_bytes)
    return raw


def _remote_refused(url: str, where: str, media: str, max_bytes: int,
                    allowed_local_dir: str | None) -> bytes:
    raise InputError(f"{where}: remote {media} URLs are not fetched by this server (it fetches "
                     "only from its allowed media domains); send the "
                     f"{media} inline as a data: URL", kind="not_allowed", param=where)


# URL prefix -> loader, matched in order as written (http(s) go to a fetcher when given one)
LOADERS: dict[str, Loader] = {
    "data:": _data_bytes,
    "file://": _file_bytes,
    "http://": _remote_refused,
    "https://": _remote_refused,
}


def load_url_bytes(url: Any, *, where: str, max_bytes: int, allowed_local_dir: str | None,
                   media: str = "image", fetcher: Any = None) -> bytes:
    """The bytes `url` names (at most `max_bytes`), by its prefix in `LOADERS`, or through
    `fetcher` (``fetcher.fetch(url, where=, media=, max_bytes=)``) for an http(s) URL;
    InputError otherwise."""
    if not isinstance(url, str):
        raise InputError(f"{where}: url must be a string", kind="invalid", param=where)
    if fetcher is not None and url.startswith(("http://", "https://")):
        return fetcher.fetch(url, where=where, media=media, max_bytes=max_bytes)
    for prefix, loader in LOADERS.items():
        if url.startswith(prefix):
            return loader(url, where, media, max_bytes, allowed_local_dir)
    raise InputError(f"{where}: unsupported URL scheme (use data: or file://)",
                     kind="unsupported", param=where)


def load_url_media(url: Any, *, where: str, max_bytes: int, allowed_local_dir: str | None,
                   media: str = "image", fetcher: Any = None) -> tuple[bytes, str | None]:
    """(`load_url_bytes`'s bytes, the media type their source declares): a ``data:`` URL's
    type, or the Content-Type of an http(s) answer (``fetcher.fetch_media``); None when the
    source declares none or only a generic one, and for local files."""
    if fetcher is not None and isinstance(url, str) and url.startswith(("http://", "https://")) \
            and hasattr(fetcher, "fetch_media"):
        return fetcher.fetch_media(url, where=where, media=media, max_bytes=max_bytes)
    raw = load_url_bytes(url, where=where, max_bytes=max_bytes,
                         allowed_local_dir=allowed_local_dir, media=media, fetcher=fetcher)
    return raw, data_url_mime(url) or None


def mime_source(url: Any) -> str:
    """Who declared a URL's media type, as error messages name it."""
    return "the data URL" if isinstance(url, str) and url.startswith("data:") else \
        "the Content-Type"


def data_url_mime(url: Any) -> str | None:
    """The media type a ``data:`` URL declares (lower case; "" when it declares none), None
    for any other URL."""
    if not isinstance(url, str) or not url.startswith("data:"):
        return None
    header = url[5:url.find(",")] if "," in url[:512] else url[5:512]
    return header.split(";", 1)[0].strip().lower()


def to_data_url(data: Any, fmt: str = "PNG", media: str = "image") -> str:
    """An image (PIL, or encoded bytes) as a base64 ``data:`` URL."""
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        buf = io.BytesIO()
        data.save(buf, format=fmt)
        raw = buf.getvalue()
    return f"data:{media}/{fmt.lower()};base64," + base64.b64encode(raw).decode()


def check_dir(path: str | None) -> str | None:
    """Validate an allowed local media folder (an existing directory) and return it absolute."""
    if path is None:
        return None
    if not os.path.isdir(path):
        raise ValueError(f"allowed_local_dir={path!r} is not a directory")
    return os.path.abspath(path)
