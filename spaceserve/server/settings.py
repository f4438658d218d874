"""What ``spaceserve serve``'s flags set beside the engine, shared by both entry points (one
engine in this process, app.py; replicas on Ray, replicas/deploy.py), so they bound, admit and
shut down alike.

`ServerLimits` is what one request may carry; `ServeSettings.from_args` builds it with the
admission middleware's bounds (`guard.GuardLimits`), the connection cap and header deadline
(`connections.ConnectionLimits`), the preprocessing pool and pixel budget, and the graceful
shutdown bound; `ServeSettings.server` is the uvicorn server draining a client within that
bound (`shutdown.DrainingServer`). Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from spaceserve.runtime.inputs import ImageLimits, RemotePolicy, VideoLimits, check_dir
from spaceserve.server.transport.backpressure import StreamLimits
from spaceserve.server.transport.prescan import ScanLimits


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may carry, and how long its preprocessing may take;
    `remote` None refuses http(s) media URLs."""

    max_body_bytes: int = 32 * 1024 * 1024
    images: ImageLimits = ImageLimits()
    videos: VideoLimits = VideoLimits()
    remote: RemotePolicy | None = None
    preprocess_timeout_s: float = 30.0
    # per-request bounds (openai/bounds.py); None: the engine's max_num_seqs, its KV capacity
    max_seqs_per_request: int | None = None
    max_tokens_per_request: int | None = None
    # the body pre-scan's bounds (messages, parts per message...; the context length is the
    # engine's) and the slow-reader bounds of a stream
    scan: ScanLimits = ScanLimits()
    stream: StreamLimits = StreamLimits()


@dataclass(frozen=True)
class FairShareKey:
    """Where a request's fair-share key (the user it shares the engine's fair share with,
    `EngineConfig.fair_share`) comes from: ``header:NAME`` (a header a trusted proxy sets)
    or ``user`` (the OpenAI body field, chosen by the client). None: each request its own."""

    source: str  # "header" or "user"
    name: str = ""  # the header's name (lower case)
    max_len: int = 256  # longer keys are cut (a key is a label, not data)

    @classmethod
    def parse(cls, spec: str | None) -> FairShareKey | None:
        """``header:NAME`` or ``user`` (None or "" for none); ValueError names the flag."""
        if not spec:
            return None
        if spec == "user":
            return cls("user")
        kind, _, name = spec.partition(":")
        if kind != "header" or not name.strip() or any(c in name for c in " :\r\n"):
            raise ValueError(f"--fair-share-key {spec!r} must be header:NAME (e.g. "
                             "header:X-User) or user")
        return cls("header", name.strip().lower())

    def of(self, headers: Any, user: str | None) -> str | None:
        """The key of a request with these headers and body `user` (None when it has none)."""
        value = headers.get(self.name) if self.source == "header" else user
        if not isinstance(value, str) or not value:
            return None
        return f"{self.source}:{value[:self.max_len]}"


def request_fair_key(request: Any, body: Any) -> str | None:
    """The fair-share key of an HTTP `request` with parsed `body` under the app's
    ``state.fair_share_key`` (`FairShareKey`; none set: None, each request its own)."""
    key = getattr(request.app.state, "fair_share_key", None)
    return None if key is None else key.of(request.headers, getattr(body, "user", None))


@dataclass(frozen=True)
class ServeSettings:
    """The server's bounds from the command line (see `build_parser` in flags.py)."""

    limits: ServerLimits
    guard: Any  # guard.GuardLimits
    connections: Any  # connections.ConnectionLimits
    max_pending: int = 256
    max_preprocess_pixels: int = 4 * 4096 * 4096
    preprocess_queue: int = 256
    graceful_shutdown_s: float = 30.0
    keep_alive_s: float = 5.0
    fair_share_key: FairShareKey | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        """Settings from parsed flags; ValueError names a bad value."""
        from spaceserve.server.media_args import media_limits
        from spaceserve.server.transport.connections import ConnectionLimits, parse_proxies
        from spaceserve.server.transport.guard import GuardLimits

        videos, remote = media_limits(args)
        limits = ServerLimits(args.max_body_bytes, ImageLimits(
            args.max_image_bytes, args.max_image_pixels, args.max_images_per_request,
            check_dir(args.allowed_local_media_path), args.max_request_pixels), videos, remote,
            args.preprocess_timeout)
        # per-request and per-client bounds (openai/bounds.py, transport/connections.py)
        from spaceserve.checks import require_int

        limits = replace(limits, max_seqs_per_request=require_int(
            "--max-seqs-per-request", args.max_seqs_per_request, optional=True),
            max_tokens_per_request=require_int(
            "--max-tokens-per-request", args.max_tokens_per_request, optional=True))
        per_client = dict(max_per_client=require_int(
            "--max-connections-per-client", args.max_connections_per_client),
                          client_header=args.forwarded_client_header,
                          trusted_proxies=parse_proxies(args.trusted_proxies))
        for flag, v in (("--max-messages-per-request", args.max_messages_per_request),
                        ("--max-parts-per-message", args.max_parts_per_message),
                        ("--stream-stall-timeout", args.stream_stall_timeout),
                        ("--stream-write-timeout", args.stream_write_timeout)):
            if not v > 0:
                raise ValueError(f"{flag} {v} must be > 0")
        limits = replace(limits, scan=ScanLimits(
            max_messages=args.max_messages_per_request, max_parts=args.max_parts_per_message),
            stream=StreamLimits(args.stream_stall_timeout, args.stream_write_timeout))
        guard = GuardLimits(max_body_bytes=args.max_body_bytes,
                            body_budget_bytes=args.max_buffered_body_bytes,
                            body_idle_timeout_s=args.body_idle_timeout,
                            body_timeout_s=args.body_timeout)
        if args.max_preprocess_pixels < args.max_request_pixels:
            raise ValueError(f"--max-preprocess-pixels {args.max_preprocess_pixels} must be at "
                             f"least --max-request-pixels {args.max_request_pixels}")
        if not args.graceful_shutdown_timeout >= 0:
            raise ValueError(f"--graceful-shutdown-timeout {args.graceful_shutdown_timeout} "
                             "must be >= 0")
        return cls(limits, guard, ConnectionLimits(args.max_connections, args.header_timeout,
                                                   **per_client),
                   args.max_pending, args.max_preprocess_pixels, args.preprocess_queue,
                   args.graceful_shutdown_timeout, args.keep_alive_timeout,
                   FairShareKey.parse(getattr(args, "fair_share_key", None)))

    def pool(self) -> Any:
        """A preprocessing pool with these queue bounds."""
        from spaceserve.runtime.inputs import PreprocessPool

        return PreprocessPool(max_queue=self.preprocess_queue)

    def pixels(self) -> Any:
        """The server's pixel budget."""
        from spaceserve.runtime.inputs import PixelBudget

        return PixelBudget(self.max_preprocess_pixels)

    def server(self, app: Any, client: Any, *, host: str, port: int, log_level: str) -> Any:
        """uvicorn serving `app` with the connection limits, draining `client` within the
        graceful-shutdown bound on SIGTERM / SIGINT (a second signal exits at once)."""
        from spaceserve.server.transport.shutdown import DrainingServer, uvicorn_config

        return DrainingServer(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                             limits=self.connections,
                                             keep_alive_s=self.keep_alive_s),
                              client, graceful_timeout_s=self.graceful_shutdown_s)


__all__ = ["FairShareKey", "ServeSettings", "ServerLimits", "request_fair_key"]
