"""The one exception type of input processing.

An `InputError` is a ValueError (so the engine ends a request that carries one with finish
reason "error" and the message) with a machine-readable `kind` and the `param` it concerns (the
content part, e.g. ``messages[0].content[1].image_url``, or None). The input layer knows no
transport: the server maps each kind to its HTTP status and OpenAI-style error body.
"""

from __future__ import annotations

# kind -> what it means; a new loader adds its kind here (and the server maps it to a status).
KINDS: dict[str, str] = {
    "invalid": "malformed input (messages, placeholders, template)",
    "too_large": "over a size limit (bytes, pixels, frames, number of images or videos)",
    "bad_image": "not a decodable or usable image",
    "bad_video": "not a decodable or usable video",
    "not_allowed": "refused by policy (file:// outside the allowed folder, a remote URL off "
                   "the allowed domains or resolving to a non-public address)",
    "fetch_failed": "an allowed remote URL could not be fetched (connection, timeout, status)",
    "not_found": "a referenced local file does not exist or is not a regular file",
    "unsupported": "something this model or build does not take (images, a URL scheme)",
}


class InputError(ValueError):
    """Input that cannot be used; the message says which part and why."""

    def __init__(self, message: str, *, kind: str = "invalid", param: str | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
        super().__init__(message)
        self.kind = kind
        self.param = param

    def with_prefix(self, prefix: str, param: str | None) -> InputError:
        """The same error, its message prefixed (``"messages: ..."``) and its param replaced."""
        return InputError(f"{prefix}: {self}", kind=self.kind, param=param)


class ImageError(InputError):
    """An image that cannot be used (its `param` names the content part)."""
