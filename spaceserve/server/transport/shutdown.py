"""uvicorn configured for SpaceServe, with a bounded graceful shutdown.

`uvicorn_config` applies the connection limits (`connections.limited_protocol`) and read
timeouts. `DrainingServer` replaces uvicorn's signal handling:

1. The first SIGTERM or SIGINT starts draining: the listener stays open but every new request
   gets 503 "draining" with ``Retry-After`` (and ``/health`` 503), so a load balancer moves
   on; requests in flight go on.
2. When none is left, or `graceful_timeout_s` after the signal, the server stops. At the
   deadline, requests still running are ended: a stream gets a final SSE error event (then
   ``data: [DONE]``), a waiting non-streaming request a 503 with ``Retry-After``; their KV
   blocks are freed. The process exits about half a second after the deadline (at most
   ~4 s more when final events are slow to go out: ABORT_GRACE_S, then uvicorn's own 2 s).
3. A second SIGTERM or SIGINT exits at once.

The exit code is 0 after a drain (the signal is not re-raised, unlike plain uvicorn).
`thread.ServerThread` runs the same server on a background thread (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from spaceserve.server.transport.connections import ConnectionLimits, limited_protocol

if TYPE_CHECKING:
    from spaceserve.server.engine_client import AsyncEngine

log = logging.getLogger("spaceserve.server")
SHUTDOWN_MESSAGE = "the server is shutting down; retry the request"
ABORT_GRACE_S = 1.5  # after ending the last requests: time for their final events to go out


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 0,
                   log_level: str = "info", limits: ConnectionLimits | None = None,
                   keep_alive_s: float = 5.0, **kw: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` with SpaceServe's connection limits."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          http=limited_protocol(limits or ConnectionLimits()),
                          timeout_keep_alive=keep_alive_s, **kw)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains `client` within `graceful_timeout_s`."""

    def __init__(self, config: uvicorn.Config, client: AsyncEngine, *,
                 graceful_timeout_s: float = 30.0) -> None:
        if not graceful_timeout_s >= 0:
            raise ValueError(f"graceful_timeout_s={graceful_timeout_s!r} must be >= 0")
        # uvicorn's own wait after ours: what is left is only the final events going out
        config.timeout_graceful_shutdown = 2
        super().__init__(config)
        self.client = client
        self.graceful_timeout_s = graceful_timeout_s
        self.drain_started: float | None = None
        self.aborted_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def begin_drain(self) -> None:
        """Start draining (what the first SIGTERM / SIGINT does); safe from any thread."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.client.draining = True
            log.warning("draining: %d requests in flight, exiting within %g s",
                        self.client.num_pending, self.graceful_timeout_s)

    def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's signal handler
        if self.drain_started is None:
            self.begin_drain()
            return
        log.warning("second signal: exiting now")
        self.force_exit = True
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.client.abort_all, SHUTDOWN_MESSAGE)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            now = time.monotonic()
            if self.client.num_pending == 0:
                self.should_exit = True
            elif self.aborted_at is None and now - self.drain_started >= self.graceful_timeout_s:
                log.warning("drain deadline: ending %d requests", self.client.num_pending)
                self.client.abort_all(SHUTDOWN_MESSAGE)
                self.aborted_at = now
            elif self.aborted_at is not None and now - self.aborted_at >= ABORT_GRACE_S:
                self.should_exit = True
        return await super().on_tick(counter)

