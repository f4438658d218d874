"""The one exception type of input processing.

An `InputError` is a ValueError (so the engine ends a request that carries one with finish
reason "error" and the message) with a machine-readable `kind`, the `param` it concerns (the
content part, e.g. ``messages[0].content[1].image_url``, or None) and, for "busy", the seconds
after which a retry may succeed. The input layer knows no transport: the server maps each kind
to its HTTP status and OpenAI-style error body. Messages name the problem in the caller's
terms: `safe_detail` keeps library messages free of object reprs and memory addresses.
"""

from __future__ import annotations

import re

from spaceserve.checks import require_choice

# kind -> what it means; a new loader adds its kind here (and the server maps it to a status).
KINDS: dict[str, str] = {
    "invalid": "malformed input (messages, placeholders, template)",
    "too_large": "over a size limit (bytes, pixels, frames, number of images or videos, text "
                 "the context cannot hold)",
    "over_budget": "the request's media together are over the per-request pixel budget",
    "busy": "the server's preprocessing budget is taken now; retry after `retry_after` s",
    "bad_image": "not a decodable or usable image",
    "bad_video": "not a decodable or usable video",
    "not_allowed": "refused by policy (file:// outside the allowed folder or missing, a remote "
                   "URL off the allowed domains or resolving to a non-public address)",
    "fetch_failed": "an allowed remote URL could not be fetched (connection, timeout, status)",
    "not_found": "a referenced resource does not exist",
    "unsupported": "something this model or build does not take (images, videos, a URL scheme, "
                   "a media format)",
}


class InputError(ValueError):
    """Input that cannot be used; the message says which part and why."""

    def __init__(self, message: str, *, kind: str = "invalid", param: str | None = None,
                 retry_after: float | None = None) -> None:
        require_choice("kind", kind, tuple(KINDS))
        super().__init__(message)
        self.kind = kind
        self.param = param
        self.retry_after = retry_after

    def with_prefix(self, prefix: str, param: str | None) -> InputError:
        """The same error, its message prefixed (``"messages: ..."``) and its param replaced."""
        return InputError(f"{prefix}: {self}", kind=self.kind, param=param,
                          retry_after=self.retry_after)


class ImageError(InputError):
    """An image that cannot be used (its `param` names the content part)."""


_REPR = re.compile(r"<[^<>]{0,200}? (?:object|at) [^<>]{0,200}?>")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def safe_detail(exc: BaseException, limit: int = 200) -> str:
    """A library exception's message fit to show a client: object reprs and addresses
    removed, one line, at most `limit` characters."""
    text = _ADDRESS.sub("0x…", _REPR.sub("<object>", str(exc)))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
