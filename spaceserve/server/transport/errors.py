"""`APIError`: an error answered as OpenAI-style JSON with an HTTP status. Kept apart from the
request models (protocol.py, pydantic) so that the engine client and the in-process serving
benchmark import without pydantic, which the GPU image lacks."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status; `retry_after` (seconds)
    becomes a ``Retry-After`` header, which every 503 and 429 carries."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code
        if retry_after is None and status in (429, 503):
            retry_after = 1
        self.retry_after = retry_after
        self.extra_headers = dict(headers or {})

    def headers(self) -> dict[str, str]:
        out = dict(self.extra_headers)
        if self.retry_after is not None:
            out["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))
        return out

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
