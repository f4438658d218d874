"""The OpenAI-compatible HTTP server (`spaceserve serve`): FastAPI over an `AsyncEngine`.

Routes: ``POST /v1/chat/completions`` (non-streaming, or SSE with ``stream``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Every client mistake is an
OpenAI-style JSON error with a 4xx status: 400 for a malformed body, field or image, 404 for an
unknown model, 413 for an oversized body or a request over its pixel budget, 429 when the
server's pixel budget is taken; 503 when a bound on work in flight is reached (every 503 and
429 carries Retry-After). Prompt rendering and image decoding run in the preprocessing pool
(text-only requests and image-header reads in a light lane, decoding in a heavy one, under a
per-request deadline); the engine steps on its own thread. A client that goes away
(non-streaming or streaming) aborts its request, which frees its KV blocks. In front of the
routes, `guard.AdmissionMiddleware` bounds body buffering, times out stalled bodies, answers
503 while draining and turns any unexpected exception into a JSON 500 with a request id; the
connection cap and header timeout sit in the uvicorn protocol (`connections`), the bounded
graceful shutdown in `shutdown.DrainingServer`.

A stream sends its first chunk only once the first token exists (so a request that fails
before generating anything still gets a JSON error and a 4xx), then one chunk per new text,
the finish reason on the last content chunk, a usage chunk with empty ``choices`` when
``stream_options.include_usage``, and ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# starlette's Request and responses are fastapi's own; FastAPI itself, the engine and torch are
# imported where they are used, so `spaceserve serve --help` answers at once
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from spaceserve.cli_args import HelpFormatter
from spaceserve.runtime.inputs import ChatPreprocessor, ImageLimits, check_dir, text_byte_limit

from . import protocol as P
from .engine_client import AsyncEngine, Cancelled, QueueFull, RequestHandle
from .guard import AdmissionMiddleware, GuardLimits, release_body
from .preprocess import prepare_chat_request
from .protocol import APIError
from .streams import (
    Deltas,
    error_of,
    error_response,
    json_response,
    next_output,
    read_body,
    shutdown_error,
    until_disconnect,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from spaceserve.runtime.request import RequestOutput

log = logging.getLogger("spaceserve.server")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may carry, and how long its preprocessing may take."""

    max_body_bytes: int = 32 * 1024 * 1024
    images: ImageLimits = ImageLimits()
    preprocess_timeout_s: float = 30.0


def create_app(client: AsyncEngine, preprocessor: ChatPreprocessor, *, model_name: str,
               limits: ServerLimits | None = None, root: str | None = None,
               guard: GuardLimits | None = None) -> FastAPI:
    """The FastAPI application serving `client`'s engine under the name `model_name`."""
    from fastapi import FastAPI

    from spaceserve.runtime.request import SamplingParams

    limits = limits or ServerLimits()
    guard = guard or GuardLimits(max_body_bytes=limits.max_body_bytes,
                                 body_budget_bytes=max(GuardLimits.body_budget_bytes,
                                                       limits.max_body_bytes))
    app = FastAPI(title="SpaceServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client = client
    created = P.now()
    metrics = client.metrics
    app.add_middleware(AdmissionMiddleware, limits=guard, draining=lambda: client.draining,
                       on_error=metrics.http_error)
    ctx = client.engine.max_model_len
    max_text = text_byte_limit(preprocessor.tokenizer, ctx) \
        if getattr(preprocessor, "tokenizer", None) is not None else None

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        metrics.http_error(exc.status)
        return error_response(exc, request)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        metrics.http_error(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail)), request)

    @app.get("/health")
    async def health() -> Response:
        status = "draining" if client.draining else "ok" if client.alive else "dead"
        body = {"status": status, "mode": client.mode, "note": client.mode_note}
        if status == "ok":
            return json_response(body)
        return json_response(body, 503, {"Retry-After": "1"})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "spaceserve",
            "root": root or model_name, "max_model_len": client.engine.max_model_len}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = client.metrics.render(client.gauges())
        text += (f'# HELP spaceserve:mode_info Engine mode.\n# TYPE spaceserve:mode_info gauge\n'
                 f'spaceserve:mode_info{{mode="{client.mode}"}} 1\n')
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def sampling(req: P.ChatCompletionRequest, prompt: dict[str, Any]) -> SamplingParams:
        n = len(prompt["prompt_token_ids"])
        ctx = client.engine.max_model_len
        limit = req.output_limit()
        if n >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the "
                           f"messages take {n}.", param="messages")
        if limit is not None and n + limit > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; you "
                           f"requested {n + limit} ({n} in the messages, {limit} in the "
                           "completion).", param="max_tokens")
        return SamplingParams(max_tokens=limit if limit is not None else ctx - n,
                              temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                              ignore_eos=req.ignore_eos)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await read_body(request, limits.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        req = P.parse_request(body)
        del body
        if req.model != model_name:
            raise APIError(404, f"The model `{req.model[:128]}` does not exist.", param="model",
                           type="NotFoundError", code="model_not_found")
        if not client.alive or client.draining:
            raise APIError(503, "the engine is not running", type="server_error")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            handle = client.reserve(rid)
        except QueueFull as exc:
            raise APIError(503, f"server busy: {exc}; retry later", type="server_error",
                           code="queue_full") from None
        gone = asyncio.ensure_future(until_disconnect(request))
        streaming = False
        try:
            try:
                await prepare_chat_request(
                    client, preprocessor, req, handle, limits.images, lambda p: sampling(req, p),
                    timeout_s=limits.preprocess_timeout_s, max_text_bytes=max_text,
                    context_len=ctx, on_body_done=lambda: release_body(request.scope.get(
                        "state", {})))
                first = await next_output(handle, gone)
            except Cancelled as exc:
                raise shutdown_error(exc) from None
            handle.release_held()  # an output exists: the images are encoded
            if first is None:
                return Response(status_code=499)
            if first.finish_reason in ("error", "abort") and not first.token_ids:
                raise error_of(first)
            created_at = P.now()
            if not req.stream:
                if first.finish_reason == "error":
                    raise error_of(first)
                return json_response(P.completion_response(
                    rid, model_name, created_at, first.text or "", first.finish_reason,
                    first.prompt_token_ids, first.token_ids,
                    return_token_ids=req.return_token_ids))
            streaming = True
            return StreamingResponse(_stream(req, handle, gone, first, created_at),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        finally:
            if not streaming:
                gone.cancel()
                handle.close()

    async def _stream(req: P.ChatCompletionRequest, handle: RequestHandle, gone: asyncio.Task,
                      first: RequestOutput, created_at: int) -> AsyncIterator[bytes]:
        rid, usage = handle.request_id, bool(req.stream_options and
                                            req.stream_options.include_usage)
        deltas = Deltas()
        out: RequestOutput | None = first
        role = True
        try:
            while out is not None:
                text = deltas.take(out.text, out.finished)
                ids = out.new_token_ids if req.return_token_ids else None
                reason = out.finish_reason if out.finished else None
                if reason == "error":
                    yield P.sse(error_of(out).body())
                    break
                if role or text or reason or ids:
                    delta: dict[str, Any] = {"role": "assistant"} if role else {}
                    if text or role:
                        delta["content"] = text
                    yield P.sse(P.chunk(rid, model_name, created_at, delta, reason,
                                        include_usage=usage, token_ids=ids))
                    role = False
                if out.finished:
                    if usage:
                        yield P.sse(P.usage_chunk(rid, model_name, created_at,
                                                  len(out.prompt_token_ids), len(out.token_ids)))
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

    return app


def __getattr__(name: str) -> Any:
    if name == "ServerThread":  # uvicorn is imported only when a server runs
        from .shutdown import ServerThread

        return ServerThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spaceserve serve", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    p.add_argument("--served-model-name", help="name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--mode", default="temporal",
                   help="engine mode: temporal, spatial, spatial-static, shared")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", help="float32, float16, bfloat16 (default: the checkpoint's)")
    p.add_argument("--attention-backend",
                   help="triton or torch (default: triton on CUDA, torch on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step at most (chunked prefill)")
    p.add_argument("--num-kv-blocks", type=int,
                   help="KV cache blocks (default: sized from free device memory)")
    p.add_argument("--max-model-len", type=int,
                   help="context length (default: the model's, capped by the KV cache)")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed for requests that bring none")
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests in flight before answering 503")
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                   help="request body size limit; larger bodies get 413")
    p.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_image_bytes,
                   help="encoded size limit of one image")
    p.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_image_pixels,
                   help="pixel limit of one image (checked before decoding)")
    p.add_argument("--max-images-per-request", type=int,
                   default=ImageLimits.max_images_per_request, help="images per request at most")
    p.add_argument("--allowed-local-media-path",
                   help="folder file:// image URLs may read from (default: none allowed)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    h = p.add_argument_group("hardening (bounds on what clients can make the server hold; "
                             "see README, Serving under attack)")
    h.add_argument("--max-request-pixels", type=int, default=ImageLimits.max_request_pixels,
                   help="decoded pixels of all images of one request at most (from headers, "
                        "before decoding); more is 413")
    h.add_argument("--max-preprocess-pixels", type=int, default=4 * 4096 * 4096,
                   help="decoded pixels in preprocessing across the server; a request that "
                        "would pass it gets 429 with Retry-After")
    h.add_argument("--preprocess-timeout", type=float, default=ServerLimits.preprocess_timeout_s,
                   help="seconds a request's preprocessing may take, queueing included "
                        "(then 503)")
    h.add_argument("--preprocess-queue", type=int, default=256,
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
    h.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    h.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests may finish (new ones get "
                        "503 meanwhile) before they are ended and the server exits; a second "
                        "signal exits at once")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from spaceserve.runtime.inputs import PixelBudget, PreprocessPool

    from .connections import ConnectionLimits
    from .engine_client import load_engine
    from .shutdown import DrainingServer, uvicorn_config

    try:
        limits = ServerLimits(args.max_body_bytes, ImageLimits(
            args.max_image_bytes, args.max_image_pixels, args.max_images_per_request,
            check_dir(args.allowed_local_media_path), args.max_request_pixels),
            args.preprocess_timeout)
        guard = GuardLimits(max_body_bytes=args.max_body_bytes,
                            body_budget_bytes=args.max_buffered_body_bytes,
                            body_idle_timeout_s=args.body_idle_timeout,
                            body_timeout_s=args.body_timeout)
        connections = ConnectionLimits(args.max_connections, args.header_timeout)
        if args.max_preprocess_pixels < args.max_request_pixels:
            raise ValueError(f"--max-preprocess-pixels {args.max_preprocess_pixels} must be at "
                             f"least --max-request-pixels {args.max_request_pixels}")
        pixels = PixelBudget(args.max_preprocess_pixels)
        pool = PreprocessPool(max_queue=args.preprocess_queue)
        engine, pre, note = load_engine(
            args.model, mode=args.mode, device=args.device, dtype=args.dtype,
            attention_backend=args.attention_backend, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len, seed=args.seed,
            max_images_per_prompt=args.max_images_per_request)
    except ValueError as exc:
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"spaceserve serve: {note}", file=sys.stderr)
    client = AsyncEngine(engine, max_pending=args.max_pending, pool=pool, pixels=pixels,
                         mode_note=note)
    app = create_app(client, pre, model_name=args.served_model_name or args.model,
                     limits=limits, root=args.model, guard=guard)
    print(f"spaceserve serve: {args.model} ({client.mode}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    server = DrainingServer(uvicorn_config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, limits=connections,
                                           keep_alive_s=args.keep_alive_timeout),
                            client, graceful_timeout_s=args.graceful_shutdown_timeout)
    try:
        server.run()
    finally:
        client.close()
    # Tearing down the interpreter (the model, torch's threads) can take seconds: after a
    # drain the bound is what was promised, so leave now (logs and streams flushed first).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
