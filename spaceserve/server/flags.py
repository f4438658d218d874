"""OpenAI-compatible HTTP server for Qwen2-VL / Qwen2.5-VL on SpaceServe's engine.

One engine in this process, or with --data-parallel-size N (or --ray-address) N engine
replicas on Ray Serve behind the same endpoint: the same API, errors, bounds, /health,
/metrics and graceful shutdown either way (docs/serving.md, docs/hardening.md, docs/replicas.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from spaceserve.cli_args import HelpFormatter
from spaceserve.runtime.engine.args import (
    SERVE_FIELDS,
    SM_BUDGET_FIELDS,
    add_engine_args,
    add_load_args,
    add_sm_budget_args,
    engine_kwargs,
    load_kwargs,
)
from spaceserve.runtime.inputs import ImageLimits
from spaceserve.server.media_args import add_media_args
from spaceserve.server.replicas.args import add_data_parallel_args
from spaceserve.server.settings import ServerLimits, ServeSettings
from spaceserve.server.transport.backpressure import StreamLimits
from spaceserve.server.transport.connections import ConnectionLimits
from spaceserve.server.transport.guard import GuardLimits
from spaceserve.server.transport.prescan import ScanLimits


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``spaceserve serve`` (`settings.ServeSettings.from_args` reads them)."""
    p = argparse.ArgumentParser(prog="spaceserve serve", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    p.add_argument("--served-model-name", help="name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_load_args(p, ("device", "dtype", "attention_backend"))
    add_engine_args(p, SERVE_FIELDS[:-2])  # the engine's flags, declared beside its config
    p.add_argument("--max-pending", type=int, default=ServeSettings.max_pending,
                   help="requests in flight before answering 503 (per replica with replicas)")
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                   help="request body size limit; larger bodies get 413")
    p.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_image_bytes,
                   help="encoded size limit of one image")
    p.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_image_pixels,
                   help="pixel limit of one image (checked before decoding)")
    p.add_argument("--max-images-per-request", type=int,
                   default=ImageLimits.max_images_per_request, help="images per request at most")
    p.add_argument("--allowed-local-media-path",
                   help="folder file:// image and video URLs may read from (default: none "
                        "allowed)")
    add_media_args(p)
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    add_engine_args(p, SERVE_FIELDS[-2:])
    add_sm_budget_args(p)
    h = p.add_argument_group("hardening (bounds on what clients can make the server hold; "
                             "see docs/hardening.md)")
    h.add_argument("--max-request-pixels", type=int, default=ImageLimits.max_request_pixels,
                   help="decoded pixels of all images and sampled video frames of one request "
                        "at most (from headers, before decoding); more is 413")
    h.add_argument("--max-preprocess-pixels", type=int,
                   default=ServeSettings.max_preprocess_pixels,
                   help="decoded image and video pixels in preprocessing across the server; a "
                        "request that would pass it gets 429 with Retry-After")
    h.add_argument("--preprocess-timeout", type=float, default=ServerLimits.preprocess_timeout_s,
                   help="seconds a request's preprocessing may take, queueing and remote "
                        "fetches included (then 503)")
    h.add_argument("--preprocess-queue", type=int, default=ServeSettings.preprocess_queue,
                   help="requests waiting per preprocessing lane (light, heavy) before 503")
    h.add_argument("--max-connections", type=int, default=1000,
                   help="open connections; a request on one beyond gets 503 with Retry-After")
    h.add_argument("--max-buffered-body-bytes", type=int, default=GuardLimits.body_budget_bytes,
                   help="bytes of request bodies over 64 KiB held at once (from the body's "
                        "first byte to the end of its preprocessing); beyond, 503")
    h.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's line and headers may take; then the connection "
                        "closes")
    h.add_argument("--body-idle-timeout", type=float, default=GuardLimits.body_idle_timeout_s,
                   help="seconds a request body may pause; then 408 and the connection closes")
    h.add_argument("--body-timeout", type=float, default=GuardLimits.body_timeout_s,
                   help="seconds a whole request body may take; then 408")
    h.add_argument("--keep-alive-timeout", type=float, default=ServeSettings.keep_alive_s,
                   help="seconds an idle keep-alive connection stays open")
    h.add_argument("--graceful-shutdown-timeout", type=float,
                   default=ServeSettings.graceful_shutdown_s,
                   help="on SIGTERM/SIGINT: seconds in-flight requests may finish (new ones get "
                        "503 meanwhile) before they are ended and the server exits; a second "
                        "signal exits at once")
    add_request_bounds_args(h)
    add_body_shape_args(h)
    f = p.add_argument_group("fair share (the engine's, see --no-fair-share and docs/engine.md)")
    f.add_argument("--fair-share-key", metavar="header:NAME|user",
                   help="share the batch and KV cache fairly per user, the user named by a "
                        "request header (header:X-User, set by a trusted proxy) or the OpenAI "
                        "body's `user` field (user: chosen by the client); default: per "
                        "request")
    add_data_parallel_args(p)
    return p


def add_request_bounds_args(h: Any) -> None:
    """Per-request bounds (openai/bounds.py) and the per-client connection bound
    (transport/connections.py), in the hardening group `h`."""
    h.add_argument("--max-seqs-per-request", type=int, default=None,
                   help="sequences one request may run, prompts x n (default: the engine's "
                        "--max-num-seqs); more is a 400")
    h.add_argument("--max-tokens-per-request", type=int, default=None,
                   help="tokens one request may generate in all, sequences x max_tokens "
                        "(default: none; the engine's fair share keeps one request to its "
                        "share of the batch and KV cache); more is a 400, and a request "
                        "without max_tokens gets at most its share")
    h.add_argument("--max-connections-per-client", type=int,
                   default=ConnectionLimits.max_per_client,
                   help="open connections of one client (its address, or behind "
                        "--trusted-proxies the --forwarded-client-header's); a request on "
                        "one beyond gets 503 with Retry-After, and it does not count toward "
                        "--max-connections")
    h.add_argument("--forwarded-client-header",
                   help="header naming the client behind a trusted proxy (X-Forwarded-For, "
                        "X-Real-IP, ...; default: none, the peer address is the client)")
    h.add_argument("--trusted-proxies", default="",
                   help="comma-separated addresses or networks (10.0.0.0/8) whose "
                        "--forwarded-client-header is believed (default: none)")
def add_body_shape_args(h: Any) -> None:
    """The flags bounding a body's structure before it is parsed (transport/prescan.py) and
    the slow-reader bounds of streams (transport/backpressure.py)."""
    h.add_argument("--max-messages-per-request", type=int, default=ScanLimits.max_messages,
                   help="chat messages in one request at most (counted before the body is "
                        "parsed); more is 400")
    h.add_argument("--max-parts-per-message", type=int, default=ScanLimits.max_parts,
                   help="content parts (text, images, videos) in one message at most; more is "
                        "400")
    h.add_argument("--stream-stall-timeout", type=float, default=StreamLimits.stall_s,
                   help="seconds a stream's client may leave its output unread before the "
                        "request is paused (its KV blocks freed; it resumes when the client "
                        "reads again)")
    h.add_argument("--stream-write-timeout", type=float, default=StreamLimits.write_timeout_s,
                   help="seconds a stream's client may leave its output unread before the "
                        "stream is ended with an error event")


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of `engine_client.load_engine` from ``spaceserve serve``'s flags: the
    loader's, the engine's (`runtime.engine.args`), and --max-images-per-request as the
    prompt's image bound. One engine (app.py) and every replica (replicas/deploy.py) get these;
    ValueError names a bad flag (a malformed --curves file among them)."""
    return {**load_kwargs(args), **engine_kwargs(args, SERVE_FIELDS + SM_BUDGET_FIELDS),
            "max_images_per_prompt": args.max_images_per_request}


__all__ = ["build_parser", "engine_args"]
