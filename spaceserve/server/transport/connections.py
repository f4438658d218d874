"""Connection-level limits uvicorn lacks: a cap on open connections and a deadline for request
headers, so idle or trickling clients cannot pin the server.

`limited_protocol(limits)` is uvicorn's h11 protocol with two additions:

- a connection beyond `max_connections` is answered 503 with ``Retry-After`` and
  ``Connection: close`` as soon as its request line and headers arrive (uvicorn's own
  ``limit_concurrency`` answer has no ``Retry-After``), without reaching the application;
- a request's headers must arrive within `header_timeout_s` of the connection opening or of
  the first byte after the previous response; otherwise the connection is closed. (Idle
  keep-alive connections close after uvicorn's ``timeout_keep_alive``; a stalled body is the
  admission middleware's 408.)

Headers are bounded by h11's incomplete-event limit (16 KiB by default; larger is a 400), and
a body is read at most 64 KiB ahead of the application, so each open connection costs a
bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    """Open connections at most, and seconds a request's headers may take."""

    max_connections: int = 1000
    header_timeout_s: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections!r} must be an int >= 1")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s={self.header_timeout_s!r} must be > 0")


def _over_capacity_app(retry_after: int):
    body = json.dumps({"error": {
        "message": "too many open connections; retry later", "type": "server_error",
        "param": None, "code": "too_many_connections"}}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


def limited_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class with `limits` applied (pass it as ``Config(http=...)``)."""

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._seen_cycle = None
            if len(self.connections) > limits.max_connections:
                self.app = _over_capacity_app(limits.retry_after_s)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout_s,
                                                          self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._seen_cycle and not self.transport.is_closing():
                self.transport.close()  # still no complete request line and headers

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._arm_header_timer()  # the first bytes of a new request
            super().data_received(data)
            if self.cycle is not self._seen_cycle:  # its headers arrived
                self._seen_cycle = self.cycle
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is not self._seen_cycle:  # a pipelined request started at once
                self._seen_cycle = self.cycle
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return LimitedH11Protocol
