"""`APIError`: an error answered as OpenAI-style JSON with an HTTP status. Kept apart from the
request models (protocol.py, pydantic) so that the engine client and the in-process serving
benchmark import without pydantic, which the GPU image lacks."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
