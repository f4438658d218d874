"""Backpressure for streams whose client stops reading.

The ASGI server writes a chunk at once and blocks the *next* ``send`` while its transport's
buffer is over the high-water mark (the kernel's socket buffers full, the client not reading).
`SlowReaderGuard.send` times that wait: past `StreamLimits.stall_s` the request is paused
(``pause()``: its sequences preempted, KV blocks freed, it generates nothing), and when the
send goes through (the client reads again) it is resumed. Past `write_timeout_s` the stream is
given up: `WriteTimeout` is raised, the route's stream ends its request (the engine frees
everything, the admission slot is released) and `WatchedStreamingResponse` hands the error
event and ``[DONE]`` to the transport, waiting at most `final_wait_s` for them to leave. A
paused stream still holds its admission slot, so ``--max-pending`` counts paused streams; the
outputs produced before it paused wait in its queue (at most `stall_s` of them). The kernel's
send buffer of a connection is fixed small (`listening_socket`), so "not reading" shows within
a few dozen KiB of output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse

log = logging.getLogger("spaceserve.server")


@dataclass(frozen=True)
class StreamLimits:
    """Seconds a stream's client may leave its output unread before the request is paused
    (`stall_s`) and before the stream is ended (`write_timeout_s`)."""

    stall_s: float = 2.0
    write_timeout_s: float = 60.0
    final_wait_s: float = 1.0
    send_buffer_bytes: int = 64 * 1024  # SO_SNDBUF of the listening socket (`listening_socket`)

    def __post_init__(self) -> None:
        for name in ("stall_s", "write_timeout_s", "final_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}={v!r} must be a number > 0")
        if self.write_timeout_s < self.stall_s:
            raise ValueError(f"write_timeout_s={self.write_timeout_s} must be at least "
                             f"stall_s={self.stall_s} (--stream-write-timeout >= "
                             "--stream-stall-timeout)")


def listening_socket(host: str, port: int, send_buffer_bytes: int) -> socket.socket:
    """The server's bound TCP socket, its connections' kernel send buffers fixed at
    `send_buffer_bytes` (Linux doubles it) instead of auto-tuned up to megabytes: so a client
    that stops reading blocks the stream after a few dozen KiB, not after seconds of output,
    and `SlowReaderGuard` can pause it soon. A token stream needs far less."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so (else every
    # response waits ~40 ms for a delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class WriteTimeout(Exception):
    """The client left a stream's output unread for longer than the write timeout."""


class SlowReaderGuard:
    """Times each ``send`` of one stream (module docstring); `pause()` / `resume()` act on its
    request (any exception they raise is logged, not the stream's)."""

    def __init__(self, limits: StreamLimits, pause: Callable[[], Any],
                 resume: Callable[[], Any], on_pause: Callable[[bool], Any] = lambda p: None
                 ) -> None:
        self.limits = limits
        self._pause, self._resume, self._on_pause = pause, resume, on_pause
        self.paused = False
        self.pauses = 0
        self.timed_out = False

    def _call(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # the request may have ended meanwhile
            log.warning("stream pause/resume failed: %s", exc)

    def wrap(self, send: Callable[[dict[str, Any]], Awaitable[None]]
             ) -> Callable[[dict[str, Any]], Awaitable[None]]:
        async def guarded(message: dict[str, Any]) -> None:
            if self.timed_out:
                raise WriteTimeout("the stream's client stopped reading")
            task = asyncio.ensure_future(send(message))
            done, _ = await asyncio.wait((task,), timeout=self.limits.stall_s)
            if not done:
                self.paused, self.pauses = True, self.pauses + 1
                self._on_pause(True)
                self._call(self._pause)
                left = self.limits.write_timeout_s - self.limits.stall_s
                done, _ = await asyncio.wait((task,), timeout=left)
                if not done:
                    task.cancel()
                    self.timed_out = True
                    raise WriteTimeout(f"the client took no stream output for "
                                       f"{self.limits.write_timeout_s:g} s")
                self.paused = False
                self._on_pause(False)
                self._call(self._resume)
            task.result()

        return guarded


def timeout_event(message: str) -> bytes:
    """The final SSE error event of a stream whose client stopped reading."""
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "stream_write_timeout"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class WatchedStreamingResponse(StreamingResponse):
    """A `StreamingResponse` whose sends go through `guard` (`SlowReaderGuard`). On a write
    timeout the body iterator is closed (its ``finally`` ends the request) and the error event
    and ``[DONE]`` are offered to the transport for `final_wait_s`; a client that never reads
    again keeps its connection (and at most the transport's buffer) until it closes it, counted
    against ``--max-connections``."""

    def __init__(self, content: Any, *, guard: SlowReaderGuard, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.guard = guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, self.guard.wrap(send))
        except WriteTimeout as exc:
            await self._close_body()
            try:
                await asyncio.wait_for(send({"type": "http.response.body",
                                             "body": timeout_event(str(exc)),
                                             "more_body": False}),
                                       self.guard.limits.final_wait_s)
            except (asyncio.TimeoutError, OSError):
                pass
        finally:
            # Starlette stops iterating when the client disconnects (a paused stream's send is
            # cancelled then): close the iterator now, so its request ends at once
            await self._close_body()

    async def _close_body(self) -> None:
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["SlowReaderGuard", "StreamLimits", "WatchedStreamingResponse", "WriteTimeout",
           "listening_socket", "timeout_event"]
