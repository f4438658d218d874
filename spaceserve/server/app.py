"""The OpenAI-compatible HTTP server (`spaceserve serve`): FastAPI over an `AsyncEngine`.

Routes: ``POST /v1/chat/completions`` (non-streaming, or SSE with ``stream``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Every client mistake is an
OpenAI-style JSON error with a 4xx status: 400 for a malformed body, field or medium, 404 for an
unknown model, 413 for an oversized body, 503 when the bounded queue is full. Prompt rendering
and media decoding run in a worker pool (remote media fetches on the fetcher's own bounded
pool); the engine steps on its own thread. A client that goes away (non-streaming or
streaming) aborts its request, which frees its KV blocks.

A stream sends its first chunk only once the first token exists (so a request that fails
before generating anything still gets a JSON error and a 4xx), then one chunk per new text,
the finish reason on the last content chunk, a usage chunk with empty ``choices`` when
``stream_options.include_usage``, and ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# starlette's Request and responses are fastapi's own; FastAPI itself, the engine and torch are
# imported where they are used, so `spaceserve serve --help` answers at once
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from spaceserve.cli_args import HelpFormatter
from spaceserve.runtime.inputs import (
    ChatPreprocessor,
    ImageLimits,
    RemoteFetcher,
    RemotePolicy,
    VideoLimits,
    check_dir,
)
from spaceserve.runtime.slo import DEFAULT_SLO_TEXT

from . import protocol as P
from .engine_client import AsyncEngine, QueueFull, RequestHandle
from .media_args import add_media_args, media_limits
from .protocol import APIError
from .replicas.args import add_data_parallel_args
from .thread import ServerThread

if TYPE_CHECKING:
    from fastapi import FastAPI

    from spaceserve.runtime.request import RequestOutput

# ServerThread lives in thread.py; tests and benchmarks import it from here too
__all__ = ["ServerLimits", "ServerThread", "build_parser", "create_app", "main"]


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may carry; `remote` None refuses http(s) media URLs."""

    max_body_bytes: int = 32 * 1024 * 1024
    images: ImageLimits = ImageLimits()
    videos: VideoLimits = VideoLimits()
    remote: RemotePolicy | None = None


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


class _Deltas:
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


def create_app(client: AsyncEngine, preprocessor: ChatPreprocessor, *, model_name: str,
               limits: ServerLimits | None = None, root: str | None = None) -> FastAPI:
    """The FastAPI application serving `client`'s engine under the name `model_name`."""
    from fastapi import FastAPI

    from spaceserve.runtime.request import SamplingParams

    limits = limits or ServerLimits()
    app = FastAPI(title="SpaceServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client = client
    # remote media fetches: the server's own bounded pool, off the loop and the step thread
    fetcher = app.state.fetcher = RemoteFetcher(limits.remote) if limits.remote else None
    created = P.now()
    metrics = client.metrics

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        metrics.http_error(exc.status)
        return _json(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        metrics.http_error(exc.status_code)
        return _json(APIError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        metrics.http_error(500)
        return _json(APIError(500, f"internal error: {type(exc).__name__}",
                              type="server_error").body(), 500)

    @app.get("/health")
    async def health() -> Response:
        body = {"status": "ok" if client.alive else "dead", "mode": client.mode,
                "note": client.mode_note}
        if getattr(client, "device", None):
            body["device"] = client.device
        if not client.alive and client.last_error:
            body["error"] = client.last_error
        return _json(body, 200 if client.alive else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "spaceserve",
            "root": root or model_name, "max_model_len": client.engine.max_model_len}]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = client.metrics.render(client.gauges(), client.counters())
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
                              ignore_eos=req.ignore_eos, n=req.n)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = P.parse_request(await _read_body(request, limits.max_body_bytes))
        if req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           type="NotFoundError", code="model_not_found")
        if not client.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            handle = client.reserve(rid)
        except QueueFull as exc:
            raise APIError(503, f"server busy: {exc}; retry later", type="server_error",
                           code="queue_full") from None
        gone = asyncio.ensure_future(_until_disconnect(request))
        streaming = False
        try:
            await handle.start(lambda: P.prepare_chat(preprocessor, req, limits.images,
                                                      limits.videos, fetcher=fetcher),
                               lambda prompt: sampling(req, prompt), stream=req.stream)
            first = await _next(handle, gone)
            if first is None:
                return Response(status_code=499)
            if first.finish_reason in ("error", "abort") and not first.token_ids:
                raise _error_of(first)
            created_at = P.now()
            if not req.stream:
                outs = [first]  # one final output per choice (n > 1: in any order)
                while not handle.finished:
                    out = await _next(handle, gone)
                    if out is None:
                        return Response(status_code=499)
                    outs.append(out)
                outs.sort(key=lambda o: o.index)
                if any(o.finish_reason == "error" for o in outs):
                    raise _error_of(next(o for o in outs if o.finish_reason == "error"))
                return _json(P.completion_response(
                    rid, model_name, created_at, first.text or "", outs[0].finish_reason,
                    first.prompt_token_ids, outs[0].token_ids,
                    return_token_ids=req.return_token_ids,
                    more=[(o.text or "", o.finish_reason, o.token_ids) for o in outs[1:]]))
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
        deltas = [_Deltas() for _ in range(handle.n)]  # per choice (n > 1: interleaved)
        out: RequestOutput | None = first
        role = [True] * handle.n
        completion = 0
        try:
            while out is not None:
                i = out.index
                text = deltas[i].take(out.text, out.finished)
                ids = out.new_token_ids if req.return_token_ids else None
                reason = out.finish_reason if out.finished else None
                if reason == "error":
                    yield P.sse(_error_of(out).body())
                    break
                if role[i] or text or reason or ids:
                    delta: dict[str, Any] = {"role": "assistant"} if role[i] else {}
                    if text or role[i]:
                        delta["content"] = text
                    yield P.sse(P.chunk(rid, model_name, created_at, delta, reason,
                                        include_usage=usage, token_ids=ids, index=i))
                    role[i] = False
                completion += len(out.token_ids) if out.finished else 0
                if handle.finished:
                    if usage:
                        yield P.sse(P.usage_chunk(rid, model_name, created_at,
                                                  len(out.prompt_token_ids), completion))
                    break
                out = await _next(handle, gone)
            if out is not None:
                yield b"data: [DONE]\n\n"
        finally:
            gone.cancel()
            handle.close()

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spaceserve serve", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    p.add_argument("--served-model-name", help="name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--mode", default="temporal",
                   help="engine mode: temporal, temporal-chunked, spatial, spatial-static, shared")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", help="float32, float16, bfloat16 (default: the checkpoint's)")
    p.add_argument("--attention-backend",
                   help="triton or torch (default: triton on CUDA, torch on CPU)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the decoder is split over (one process and GPU each)")
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
    p.add_argument("--encoder-cache-bytes", type=int,
                   help="encoder output cache budget in bytes; 0 turns it off (default: 5%% "
                        "of free GPU memory, at most 8 GiB; 512 MiB on CPU)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn automatic prefix caching of KV blocks off")
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
                   help="folder file:// image and video URLs may read from (default: none "
                        "allowed)")
    add_media_args(p)
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    add_data_parallel_args(p)
    p.add_argument("--slo", default=DEFAULT_SLO_TEXT,
                   help="latency SLO finished requests are judged by (/metrics "
                        "request_slo_total), ms: any of ttft, tpot, itl (p99 per request), "
                        f"e2el (default {DEFAULT_SLO_TEXT})")
    p.add_argument("--encoder-window-ms", type=float, default=20.0,
                   help="encoder time window: temporal-chunked's chunk between decode steps, "
                        "TWSRFT's grant in the spatial modes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from spaceserve.runtime.tp.group import TensorParallelError

    from .engine_client import load_engine

    try:
        videos, remote = media_limits(args)
        limits = ServerLimits(args.max_body_bytes, ImageLimits(
            args.max_image_bytes, args.max_image_pixels, args.max_images_per_request,
            check_dir(args.allowed_local_media_path)), videos, remote)
        engine, pre, note = load_engine(
            args.model, mode=args.mode, device=args.device, dtype=args.dtype,
            attention_backend=args.attention_backend, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len, seed=args.seed,
            max_images_per_prompt=args.max_images_per_request,
            tensor_parallel_size=args.tensor_parallel_size, slo=args.slo,
            encoder_window_s=args.encoder_window_ms / 1e3,
            encoder_cache_bytes=args.encoder_cache_bytes,
            enable_prefix_caching=args.prefix_caching)
    except ValueError as exc:
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 2
    except TensorParallelError as exc:  # a worker failed to start
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 1
    if note:
        print(f"spaceserve serve: {note}", file=sys.stderr)
    client = AsyncEngine(engine, max_pending=args.max_pending, mode_note=note)
    app = create_app(client, pre, model_name=args.served_model_name or args.model,
                     limits=limits, root=args.model)
    print(f"spaceserve serve: {args.model} ({client.mode}, SLO {engine.config.slo}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        client.close()
        engine.close()  # partitions, and a tensor-parallel group's workers
        if app.state.fetcher is not None:
            app.state.fetcher.close()
    return 0
