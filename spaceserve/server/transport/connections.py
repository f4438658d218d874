"""Connection-level limits uvicorn lacks: a cap on open connections, a cap per client, and a
deadline for request headers, so idle or trickling clients cannot pin the server.

`limited_protocol(limits)` is uvicorn's h11 protocol with three additions:

- a connection beyond `max_connections` is answered 503 with ``Retry-After`` and
  ``Connection: close`` as soon as its request line and headers arrive (uvicorn's own
  ``limit_concurrency`` answer has no ``Retry-After``), without reaching the application;
- so is a connection beyond `max_per_client` of one client, which then does not count toward
  `max_connections`: one client's idle sockets cannot take every slot. The client is the peer
  address; a connection from one of `trusted_proxies` is counted per request instead, under
  the client its `client_header` names (X-Forwarded-For: the right-most address that is not a
  trusted proxy), for as long as it carries that client's request, and answered 503 without
  closing the proxy's connection;
- a request's headers must arrive within `header_timeout_s` of the connection opening or of
  the first byte after the previous response; otherwise the connection is closed. (Idle
  keep-alive connections close after uvicorn's ``timeout_keep_alive``; a stalled body is the
  admission middleware's 408.)

Headers are bounded by h11's incomplete-event limit (16 KiB by default; larger is a 400), and
a body is read at most 64 KiB ahead of the application, so each open connection costs a
bounded amount of memory. uvicorn is imported only when the protocol is built.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def parse_proxies(text: str | None) -> tuple[str, ...]:
    """``--trusted-proxies``: comma-separated addresses or networks, each checked; ValueError
    names a bad one."""
    out = []
    for item in (text or "").split(","):
        if item := item.strip():
            try:
                out.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ValueError(f"--trusted-proxies: {item[:64]!r} is not an address or "
                                 "network (10.0.0.1, 10.0.0.0/8, ::1)") from None
    return tuple(out)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None


@dataclass(frozen=True)
class ConnectionLimits:
    """Open connections at most, of one client at most (`max_per_client`: a quarter of
    the default cap, the requests in flight one server admits by default, ``--max-pending``),
    and seconds a request's headers may take; `client_header` names the client behind
    `trusted_proxies` (addresses or networks; see the module docstring)."""

    max_connections: int = 1000
    header_timeout_s: float = 10.0
    retry_after_s: int = 1
    max_per_client: int = 256
    client_header: str | None = None
    trusted_proxies: tuple[str, ...] = ()
    _networks: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s={self.header_timeout_s!r} must be > 0")
        if self.trusted_proxies and not self.client_header:
            raise ValueError("trusted proxies need the header naming the client "
                             "(--forwarded-client-header)")
        object.__setattr__(self, "_networks", tuple(
            ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies))

    def trusted(self, host: str | None) -> bool:
        """Whether `host` (a peer address) is a trusted proxy whose header is believed."""
        addr = _address(host) if host and self.client_header else None
        return addr is not None and any(addr in net for net in self._networks)

    def forwarded_client(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The client a trusted proxy's request names in `client_header`: the right-most
        entry that is not a trusted proxy itself (the left-most when all are); None when the
        header is absent."""
        name = (self.client_header or "").lower().encode("latin-1")
        values = [v.decode("latin-1") for k, v in headers if k.lower() == name]
        entries = [e.strip() for v in values for e in v.split(",") if e.strip()]
        for entry in reversed(entries):
            if not self.trusted(entry):
                return entry[:64]
        return entries[0][:64] if entries else None


def _refusal_app(retry_after: int, message: str, close: bool = True):
    """An ASGI app answering every request 503 with `message` and Retry-After (and
    ``Connection: close`` when `close`)."""
    body = json.dumps({"error": {
        "message": message, "type": "server_error", "param": None,
        "code": "too_many_connections"}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(retry_after).encode())]
    if close:
        headers.append((b"connection", b"close"))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


class ClientCounts:
    """One server's open connections: those counted toward the cap (`admitted`) and each
    client's (`per_client`: peer addresses, and forwarded clients while their request
    runs)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.admitted = 0
        self.per_client: Counter[str] = Counter()
        self.over_capacity = _refusal_app(limits.retry_after_s,
                                          "too many open connections; retry later")
        self.over_client = _refusal_app(
            limits.retry_after_s, f"too many open connections from this client (at most "
            f"{limits.max_per_client}, --max-connections-per-client); retry later")
        self.over_forwarded = _refusal_app(
            limits.retry_after_s, f"too many requests at once from this client behind the "
            f"proxy (at most {limits.max_per_client}, --max-connections-per-client); retry "
            "later", close=False)

    def add(self, key: str) -> bool:
        """Count one more connection of client `key`; whether it is within its bound."""
        self.per_client[key] += 1
        return self.per_client[key] <= self.limits.max_per_client

    def remove(self, key: str) -> None:
        self.per_client[key] -= 1
        if self.per_client[key] <= 0:
            del self.per_client[key]

    def forwarded(self, app: Any) -> Any:
        """`app` behind a trusted proxy: each request counted under the client its header
        names while it runs, 503 beyond the bound."""
        async def bounded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            key = self.limits.forwarded_client(scope.get("headers", [])) \
                if scope["type"] == "http" else None
            if key is None:
                return await app(scope, receive, send)
            try:
                if self.add(key):
                    return await app(scope, receive, send)
                return await self.over_forwarded(scope, receive, send)
            finally:
                self.remove(key)

        return bounded


def limited_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class with `limits` applied (pass it as ``Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    counts = ClientCounts(limits)

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._seen_cycle = None
            host = self.client[0] if self.client else "local"
            self._client_key: str | None = None
            self._admitted = True
            if limits.trusted(host):
                self.app = counts.forwarded(self.app)
            else:
                self._client_key = host
                self._admitted = counts.add(host)
            if not self._admitted:
                self.app = counts.over_client  # not counted toward the server's cap
            else:
                counts.admitted += 1
                if counts.admitted > limits.max_connections:
                    self.app = counts.over_capacity
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
            if self._client_key is not None:
                counts.remove(self._client_key)
                self._client_key = None
            if self._admitted:
                counts.admitted -= 1
                self._admitted = False
            super().connection_lost(exc)

    LimitedH11Protocol.counts = counts  # type: ignore[attr-defined]  # for tests and gauges
    return LimitedH11Protocol
