"""`ServerThread`: the app served by uvicorn on a background thread, for loopback tests and
benchmarks that need a real HTTP server in their own process: the server's connection limits,
and given an engine client, its bounded graceful shutdown (`shutdown.DrainingServer`)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from spaceserve.server.transport.connections import ConnectionLimits
from spaceserve.server.transport.shutdown import DrainingServer, uvicorn_config

if TYPE_CHECKING:
    from spaceserve.server.engine_client import AsyncEngine


class ServerThread:
    """uvicorn serving `app` on a background thread (loopback tests, benchmarks), with the
    server's connection limits; port 0 picks a free port, readable as `port` once started.
    Given `client`, `server` drains it on `server.begin_drain()` (signals go to the main
    thread only)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", *, connections: ConnectionLimits | None = None,
                 client: AsyncEngine | None = None, graceful_timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        # uvicorn binds the socket itself: asyncio then sets TCP_NODELAY on every connection
        # (a socket passed in without IPPROTO_TCP misses it, and each response waits ~40 ms
        # for a delayed ACK).
        config = uvicorn_config(app, host=host, port=port, log_level=log_level,
                                limits=connections, timeout_graceful_shutdown=1)
        self.server = DrainingServer(config, client, graceful_timeout_s=graceful_timeout_s) \
            if client is not None else uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
