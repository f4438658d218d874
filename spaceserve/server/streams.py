"""Request and response plumbing of the routes: bounded body reading, the next output of a
request (racing the client's disconnect and the server's cancellation), error mapping of
engine outputs, JSON responses (errors ASCII-escaped, with the request id), and the
incremental text of a stream."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError
from .handles import Cancelled, Handle

if TYPE_CHECKING:
    from spaceserve.runtime.request import RequestOutput


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")),
                    status_code=status, media_type="application/json", headers=headers)


def error_response(exc: APIError, request: Request) -> Response:
    """`exc` as a JSON response, ASCII-escaped so any echo of client text is safe to send (the
    middleware adds the request id header)."""
    return Response(json.dumps(exc.body(), separators=(",", ":")), status_code=exc.status,
                    media_type="application/json", headers=exc.headers())


async def read_body(request: Request, limit: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for part in request.stream():
        if len(body) + len(part) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        body += part
    return body


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def next_output(handle: Handle, gone: asyncio.Task) -> RequestOutput | None:
    """The request's next output, or None once the client has disconnected; Cancelled when
    the server ended the request (shutdown)."""
    get = asyncio.ensure_future(handle.next())
    stop = asyncio.ensure_future(handle.cancelled.wait())
    try:
        done, _ = await asyncio.wait((get, gone, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if get in done:
        out = get.result()
        if handle.cancelled.is_set() and out.finish_reason == "abort":
            raise Cancelled(handle.cancel_reason)
        return out
    get.cancel()
    if handle.cancelled.is_set():
        raise Cancelled(handle.cancel_reason)
    return None


def shutdown_error(exc: Cancelled) -> APIError:
    return APIError(503, str(exc) or "the server ended the request", type="server_error",
                    code="shutdown")


def error_of(out: RequestOutput) -> APIError:
    msg = out.error or "request failed"
    status = out.extra.get("status") if out.extra else None
    if isinstance(status, int):  # the engine client's verdict (503: a replica failed)
        return APIError(status, msg, type="server_error" if status >= 500 else
                        "invalid_request_error")
    if msg.startswith("engine step failed"):
        return APIError(500, msg, type="server_error")
    return APIError(400, msg)


class Deltas:
    """Incremental text of a stream; holds back a trailing partial UTF-8 character."""

    def __init__(self) -> None:
        self.sent = ""

    def take(self, text: str | None, final: bool) -> str:
        if not text:
            return ""
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        if len(text) <= len(self.sent):
            return ""
        # An earlier character that changed on decoding cannot be taken back; go on from here.
        delta, self.sent = text[len(self.sent):], text
        return delta
