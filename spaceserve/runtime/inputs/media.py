"""Media URLs to bytes: ``data:`` URLs and local ``file://`` URLs, under a byte limit.

`load_url_bytes` picks a loader by the URL's prefix from `LOADERS`; every failure is an
`InputError` whose message starts with `where` (the content part). ``file://`` reads only inside
an allowed folder (symbolic links resolved first) and is off unless one is given. Remote
(``http(s)://``) URLs are fetched only through a `fetcher` (`remote.RemoteFetcher`: an allow-list
of domains, public addresses only, the same byte limit); without one they are refused. The
media kind ("image", "video") words the messages and checks a ``data:`` URL's media type.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import InputError

# a loader: (url, where, media, max_bytes, allowed_local_dir) -> bytes
Loader = Callable[[str, str, str, int, "str | None"], bytes]

_ARTICLE = {"image": "an", "audio": "an"}


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
    mime = header[5:-7]
    if mime and not mime.startswith(f"{media}/"):
        raise InputError(f"{where}: media type {mime!r} is not {_ARTICLE.get(media, 'a')} "
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


def _file_bytes(url: str, where: str, media: str, max_bytes: int,
                allowed_local_dir: str | None) -> bytes:
    if allowed_local_dir is None:
        raise InputError(f"{where}: file:// URLs are disabled (start the server with "
                         "--allowed-local-media-path)", kind="not_allowed", param=where)
    path = url[len("file://"):]
    if not path.startswith("/"):
        raise InputError(f"{where}: a file:// URL needs an absolute path", kind="invalid",
                         param=where)
    root = Path(allowed_local_dir).resolve()
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise InputError(f"{where}: no such file", kind="not_found", param=where) from None
    if real != root and root not in real.parents:
        raise InputError(f"{where}: path is outside the allowed media folder",
                         kind="not_allowed", param=where)
    if not real.is_file():
        raise InputError(f"{where}: not a regular file", kind="not_found", param=where)
    if real.stat().st_size > max_bytes:
        raise _too_large(where, media, max_bytes)
    with open(real, "rb") as f:
        return f.read(max_bytes + 1)


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
