"""Request and response plumbing of the routes: bounded body reading and parsing, the next
output of a request (racing the client's disconnect and the server's cancellation) and all of
its n choices' final ones, error mapping of engine outputs, JSON responses (errors
ASCII-escaped, with the request id), the incremental text of a stream, and the chat
completion's body and SSE stream over its n choices."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from spaceserve.server.handles import Cancelled, Handle
from spaceserve.server.openai import protocol as P
from spaceserve.server.openai.logprobs import TokenText, chat_logprobs
from spaceserve.server.transport.errors import APIError

if TYPE_CHECKING:
    from spaceserve.runtime.core.request import RequestOutput
    from spaceserve.server.metrics import ServerMetrics

log = logging.getLogger("spaceserve.server")
INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the event loop (well under 10 ms)
PARSE_BYTES_PER_PIXEL = 8  # light-lane cost of parsing a body byte, in pixels of decoding


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


async def read_request(request: Request, limit: int, model: type[P.Req]) -> P.Req | None:
    """The body of `request` (at most `limit` bytes) validated as `model` (APIError 400
    naming the first bad field; 413 for a body over a pre-scan bound); None when the client
    went away while sending it (answer 499). The request's preprocessing deadline starts when
    its body has arrived (``scope["state"]["deadline"]``, from ``app.state.preprocess_timeout_s``)
    and bounds its parsing too: a body over `INLINE_PARSE_BYTES` is pre-scanned, parsed and
    validated in the light lane of the client's preprocessing pool (503 past the deadline; the
    scan then stops), so the event loop never parses a large body. The raw bytes are dropped
    on return."""
    try:
        body = await read_body(request, limit)
    except ClientDisconnect:
        return None
    app_state = request.app.state
    scan = getattr(app_state, "scan", None)
    timeout_s = getattr(app_state, "preprocess_timeout_s", None)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    request.scope.setdefault("state", {})["deadline"] = deadline
    pool = getattr(getattr(app_state, "client", None), "pool", None)
    if pool is None or len(body) <= INLINE_PARSE_BYTES:
        return P.parse_body(body, model, scan)
    from spaceserve.runtime.inputs import DeadlineExceeded, QueueFull, cancel_point
    from spaceserve.server.openai.preprocess import pool_error

    try:
        return await pool.run(lambda: P.parse_body(body, model, scan, cancel_point),
                              lane="light", cost=len(body) / PARSE_BYTES_PER_PIXEL,
                              deadline=deadline)
    except (DeadlineExceeded, QueueFull) as exc:
        raise pool_error(exc, "parsing the request body", timeout_s) from None


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


async def final_outputs(handle: Handle, gone: asyncio.Task, first: RequestOutput
                        ) -> list[RequestOutput] | None:
    """The final output of every one of the request's n choices, in index order, `first`
    among them (a non-streaming request's outputs are all final); None once the client has
    disconnected; Cancelled when the server ended the request."""
    outs = [first]
    while not handle.finished:
        out = await next_output(handle, gone)
        if out is None:
            return None
        outs.append(out)
    return sorted(outs, key=lambda o: o.index)


def failure_of(outs: list[RequestOutput]) -> APIError | None:
    """The error answering a request whose outputs include a failed choice (an error, or an
    abort before any token); None when every choice has an answer."""
    for out in outs:
        if out.finish_reason == "error" or (out.finish_reason == "abort" and not out.token_ids):
            return error_of(out)
    return None


def shutdown_error(exc: Cancelled) -> APIError:
    return APIError(503, str(exc) or "the server ended the request", type="server_error",
                    code="shutdown")


def error_of(out: RequestOutput) -> APIError:
    msg = out.error or "request failed"
    status = out.extra.get("status") if out.extra else None
    if isinstance(status, int):  # the engine client's verdict (503: a replica failed)
        return APIError(status, msg, type="server_error" if status >= 500 else
                        "invalid_request_error", param=out.extra.get("param"),
                        retry_after=out.extra.get("retry_after"))
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


def chat_body(req: P.ChatCompletionRequest, rid: str, model: str, created: int,
              outs: list[RequestOutput], texts: TokenText) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` of one prompt's final outputs (one per choice, in
    index order): the prompt counted once in usage, completion tokens summed over choices."""
    choices = []
    for out in outs:
        lps = None
        if req.logprobs and out.logprobs is not None:
            lps = chat_logprobs(out.logprobs, texts, req.return_tokens_as_token_ids)
        choices.append(P.chat_choice(out.index, out.text or "", out.finish_reason,
                                     list(out.token_ids), return_token_ids=req.return_token_ids,
                                     logprobs=lps, stop_reason=out.stop_reason))
    return P.completion_response(rid, model, created, choices, outs[0].prompt_token_ids,
                                 sum(len(o.token_ids) for o in outs),
                                 return_token_ids=req.return_token_ids)


async def chat_stream(req: P.ChatCompletionRequest, handle: Handle, gone: asyncio.Task,
                      first: RequestOutput, created: int, *, model: str, texts: TokenText,
                      metrics: ServerMetrics) -> AsyncIterator[bytes]:
    """The SSE stream of a chat completion from its first output on: chunks of the n choices
    as their outputs interleave (each choice's first chunk carries the role, its last one its
    finish reason), one usage chunk over every choice when asked for, then ``[DONE]``. An
    error on any choice ends the stream with an error event; a client that goes away ends it
    at once (closing the handle aborts every choice)."""
    rid, usage = handle.request_id, req.include_usage()
    as_ids = req.return_tokens_as_token_ids
    out: RequestOutput | None = first
    started: set[int] = set()  # choices whose first chunk (with the role) is sent
    completion_tokens = 0
    try:
        while out is not None:
            text = out.delta_text
            ids = out.new_token_ids if req.return_token_ids else None
            reason = out.finish_reason if out.finished else None
            lps = chat_logprobs(out.new_logprobs, texts, as_ids) if req.logprobs and \
                out.new_logprobs else None
            if reason == "error":
                yield P.sse(error_of(out).body())
                break
            role = out.index not in started
            if role or text or reason or ids or lps:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text or role:
                    delta["content"] = text
                yield P.sse(P.chunk(rid, model, created, delta, reason, include_usage=usage,
                                    token_ids=ids, logprobs=lps, stop_reason=out.stop_reason,
                                    index=out.index))
                started.add(out.index)
            if out.finished:
                completion_tokens += len(out.token_ids)
                if handle.finished:  # every choice has ended
                    if usage:
                        yield P.sse(P.usage_chunk(rid, model, created,
                                                  len(out.prompt_token_ids), completion_tokens))
                    break
            out = await next_output(handle, gone)
    except Cancelled as exc:  # the server is shutting down: say so, then end the stream
        metrics.http_error(503)
        yield P.sse(shutdown_error(exc).body())
    except Exception as exc:  # an unexpected failure mid-stream: a final error event
        log.error("stream %s failed", rid, exc_info=exc)
        metrics.http_error(500)
        yield P.sse(APIError(500, f"internal server error (request id {rid})",
                             type="server_error", code="internal_error").body())
    else:
        if out is None:  # the client went away: nobody reads a [DONE]
            return
    finally:
        gone.cancel()
        handle.close()
    yield b"data: [DONE]\n\n"
