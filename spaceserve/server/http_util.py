"""Small pieces both endpoints' handlers use: JSON responses, bounded body reads, waiting for
a request's next output or its client's disconnect, and the error of a failed output."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError

if TYPE_CHECKING:
    from spaceserve.runtime.request import RequestOutput

    from .engine_client import RequestHandle


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")),
                    status_code=status, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(handle: RequestHandle, gone: asyncio.Task) -> RequestOutput | None:
    """The request's next output, or None once the client has disconnected."""
    get = asyncio.ensure_future(handle.next())
    done, _ = await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


def _error_of(out: RequestOutput) -> APIError:
    msg = out.error or "request failed"
    status = out.extra.get("status") if out.extra else None
    if isinstance(status, int):  # the engine client's verdict (503: a replica failed)
        return APIError(status, msg, type="server_error" if status >= 500 else
                        "invalid_request_error")
    if msg.startswith("engine step failed"):
        return APIError(500, msg, type="server_error")
    return APIError(400, msg)
