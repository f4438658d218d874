"""The OpenAI-compatible HTTP server (`spaceserve serve`): FastAPI over an engine client (an
`AsyncEngine`, or a `replicas.ReplicaClient` over engine replicas on Ray).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (completions.py; both
non-streaming, or SSE with ``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). Every client mistake is an
OpenAI-style JSON error with a 4xx status: 400 for a malformed body, field or medium, 404 for
an unknown model, 413 for an oversized body or a request over its pixel budget, 429 when the
server's pixel budget is taken; 503 when a bound on work in flight is reached (every 503 and
429 carries Retry-After). Prompt rendering and media decoding run in the preprocessing pool
(text-only requests and media-header reads in a light lane, decoding in a heavy one, under a
per-request deadline; remote media download on the fetcher's own bounded pool meanwhile);
the engine steps on its own thread. Every body is first pre-scanned for its structure
(transport/prescan.py: 400 or 413 naming the bound passed), then parsed and validated in the
light lane when over 64 KiB, under the request's deadline, which starts when its body has
arrived. A client that goes away (while its request is preprocessed, generated or streamed)
stops it, which frees its KV blocks; a stream whose client stops reading is paused and, after
a write timeout, ended (transport/backpressure.py). In front of the
routes, `guard.AdmissionMiddleware` bounds body buffering, times out stalled bodies, answers
503 while draining and turns any unexpected exception into a JSON 500 with a request id; the
connection cap and header timeout sit in the uvicorn protocol (`connections`), the bounded
graceful shutdown in `shutdown.DrainingServer`.

A stream sends its first chunk only once the first token exists (so a request that fails
before generating anything still gets a JSON error and a 4xx), then one chunk per new text
(and per token when logprobs are asked for), the finish reason on the last content chunk, a
usage chunk with empty ``choices`` when ``stream_options.include_usage``, and
``data: [DONE]``. With ``n`` > 1 (parallel sampling; at most the engine's ``max_num_seqs``)
the prompt is processed once and its n choices share its KV blocks: a response holds n
choices (``index`` 0..n-1), a stream interleaves their chunks, each carrying its choice's
index (streams.py), and usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

# starlette's Request and responses are fastapi's own; FastAPI itself, the engine and torch are
# imported where they are used, so `spaceserve serve --help` answers at once
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from spaceserve.runtime.inputs import ChatPreprocessor, RemoteFetcher, text_byte_limit
from spaceserve.server.flags import build_parser, engine_args
from spaceserve.server.handles import Cancelled, QueueFull
from spaceserve.server.openai import protocol as P
from spaceserve.server.openai.bounds import RequestBounds
from spaceserve.server.openai.logprobs import TokenText
from spaceserve.server.openai.preprocess import prepare_chat_request
from spaceserve.server.openai.protocol import APIError
from spaceserve.server.openai.sampling import check_n, max_choices, to_sampling_params
from spaceserve.server.openai.streams import (
    chat_body,
    chat_stream,
    error_response,
    failure_of,
    final_outputs,
    json_response,
    next_output,
    read_request,
    shutdown_error,
    until_disconnect,
)
from spaceserve.server.settings import ServerLimits, request_fair_key
from spaceserve.server.transport.backpressure import (
    SlowReaderGuard,
    WatchedStreamingResponse,
    listening_socket,
)
from spaceserve.server.transport.guard import (
    AdmissionMiddleware,
    GuardLimits,
    new_id,
    release_body,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from spaceserve.server.engine_client import AsyncEngine

# and ServerThread, lazily
__all__ = ["ServerLimits", "build_parser", "build_server", "create_app", "main"]


def create_app(client: AsyncEngine | Any, preprocessor: ChatPreprocessor, *, model_name: str,
               limits: ServerLimits | None = None, root: str | None = None,
               guard: GuardLimits | None = None, fair_share_key: Any = None) -> FastAPI:
    """The FastAPI application serving `client`'s engine under the name `model_name`; the
    client is an `AsyncEngine` or anything with its surface (`handles.Admission` and the
    engine facts: `engine.max_model_len`, `alive`, `last_error`, `mode`, `metrics`,
    `gauges`), as `replicas.ReplicaClient` is. http(s) media are fetched under
    `limits.remote` (``app.state.fetcher``; close it when done). `fair_share_key`
    (`settings.FairShareKey`) names each request's user for the engine's fair share."""
    from fastapi import FastAPI

    from spaceserve.server.openai.completions import add_completions_route

    limits = limits or ServerLimits()
    guard = guard or GuardLimits(max_body_bytes=limits.max_body_bytes,
                                 body_budget_bytes=max(GuardLimits.body_budget_bytes,
                                                       limits.max_body_bytes))
    app = FastAPI(title="SpaceServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client = client
    # read_request's body pre-scan (token-id prompts up to the context) and parse deadline
    app.state.scan = replace(limits.scan, max_prompt_ids=client.engine.max_model_len)
    app.state.preprocess_timeout_s = limits.preprocess_timeout_s
    app.state.fair_share_key = fair_share_key
    # remote media fetches: the server's own bounded pool, off the loop and the step thread
    fetcher = app.state.fetcher = RemoteFetcher(limits.remote) if limits.remote else None
    created = P.now()
    metrics = client.metrics
    app.add_middleware(AdmissionMiddleware, limits=guard, draining=lambda: client.draining,
                       on_error=metrics.http_error,
                       at_door=getattr(client, "at_door", None),
                       left_door=getattr(client, "left_door", None))
    ctx = client.engine.max_model_len
    choices_limit = max_choices(client.engine)  # n per prompt at most (max_num_seqs)
    bounds = RequestBounds.for_engine(client.engine, limits.max_seqs_per_request,
                                      limits.max_tokens_per_request)
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
        if getattr(client, "device", None):
            body["device"] = client.device
        if status == "dead" and client.last_error:
            body["error"] = client.last_error
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
        text = client.metrics.render(client.gauges(), client.counters())
        text += (f'# HELP spaceserve:mode_info Engine mode.\n# TYPE spaceserve:mode_info gauge\n'
                 f'spaceserve:mode_info{{mode="{client.mode}"}} 1\n')
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    texts = TokenText(preprocessor.tokenizer if preprocessor is not None else None)
    add_completions_route(app, client, preprocessor, model_name=model_name, limits=limits,
                          texts=texts)

    def sampling(req: P.ChatCompletionRequest, prompt: dict[str, Any], cap: int | None) -> Any:
        return to_sampling_params(req, len(prompt["prompt_token_ids"]),
                                  client.engine.max_model_len, req.output_limit(),
                                  req.num_logprobs(), default_cap=cap)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_request(request, limits.max_body_bytes, P.ChatCompletionRequest)
        if req is None:
            return Response(status_code=499)
        req.num_logprobs()  # top_logprobs without logprobs is a 400 before any work
        if req.model != model_name:
            raise APIError(404, f"The model `{req.model[:128]}` does not exist.", param="model",
                           type="NotFoundError", code="model_not_found")
        check_n(req.n, choices_limit)
        cap = bounds.check(1, req.n, req.output_limit(), "max_completion_tokens"
                           if req.max_completion_tokens is not None else "max_tokens")
        if not client.alive or client.draining:
            raise APIError(503, "the engine is not running", type="server_error")
        rid = new_id("chatcmpl-")
        try:
            handle = client.reserve(rid)
        except QueueFull as exc:
            raise APIError(503, f"server busy: {exc}; retry later", type="server_error",
                           code="queue_full") from None
        handle.fair_key = request_fair_key(request, req)
        handle.door = request.scope.get("state", {}).get("door")
        gone = asyncio.ensure_future(until_disconnect(request))
        streaming = False
        try:
            try:
                prep = asyncio.ensure_future(prepare_chat_request(
                    client, preprocessor, req, handle, limits.images,
                    lambda p: sampling(req, p, cap),
                    video_limits=limits.videos, fetcher=fetcher,
                    timeout_s=limits.preprocess_timeout_s, max_text_bytes=max_text,
                    deadline=request.scope.get("state", {}).get("deadline"),
                    context_len=ctx, on_body_done=lambda: release_body(request.scope.get(
                        "state", {}))))
                await asyncio.wait((prep, gone), return_when=asyncio.FIRST_COMPLETED)
                if not prep.done():  # the client went away: stop its preprocessing too
                    prep.cancel()
                    return Response(status_code=499)
                prep.result()
                first = await next_output(handle, gone)
                handle.release_held()  # an output exists: the images are encoded
                outs = None if first is None or req.stream else \
                    await final_outputs(handle, gone, first)
            except Cancelled as exc:
                raise shutdown_error(exc) from None
            if first is None or (outs is None and not req.stream):
                return Response(status_code=499)
            failed = failure_of(outs if outs is not None else [first])
            if failed is not None and (outs is not None or not first.token_ids):
                raise failed
            created_at = P.now()
            if outs is not None:
                return json_response(chat_body(req, rid, model_name, created_at, outs, texts))
            streaming = True
            return WatchedStreamingResponse(
                chat_stream(req, handle, gone, first, created_at, model=model_name,
                            texts=texts, metrics=metrics),
                guard=SlowReaderGuard(limits.stream, handle.pause, handle.resume),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finally:
            if not streaming:
                gone.cancel()
                handle.close()

    return app


def __getattr__(name: str) -> Any:
    if name == "ServerThread":  # uvicorn is imported only when a server runs
        from spaceserve.server.transport.thread import ServerThread

        return ServerThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_server(args: Any) -> tuple[Any, AsyncEngine, FastAPI, Any]:
    """(engine, client, app, settings) of ``spaceserve serve``'s parsed flags (one engine in
    this process), ready to serve; ValueError names a bad flag, a malformed --curves file
    among them."""
    from spaceserve.server.engine_client import AsyncEngine, load_engine
    from spaceserve.server.settings import ServeSettings

    settings = ServeSettings.from_args(args)
    engine, pre, note = load_engine(args.model, **engine_args(args))
    if note:
        print(f"spaceserve serve: {note}", file=sys.stderr)
    client = AsyncEngine(engine, max_pending=settings.max_pending, pool=settings.pool(),
                         pixels=settings.pixels(), mode_note=note)
    app = create_app(client, pre, model_name=args.served_model_name or args.model,
                     limits=settings.limits, root=args.model, guard=settings.guard,
                     fair_share_key=settings.fair_share_key)
    return engine, client, app, settings


def main(argv: list[str] | None = None) -> int:
    """``spaceserve serve`` with one engine in this process (serve.py picks this or
    replicas)."""
    args = build_parser().parse_args(argv)
    from spaceserve.runtime.tp.group import TensorParallelError

    try:
        engine, client, app, settings = build_server(args)
    except ValueError as exc:
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 2
    except TensorParallelError as exc:  # a worker failed to start
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 1
    enc, dec = client.sm_split()  # the static split; spatial's changes per step
    budget = f", encoder {enc} / decoder {dec} SMs" if client.mode == "spatial-static" else ""
    print(f"spaceserve serve: {args.model} ({client.mode}{budget}, SLO {engine.config.slo}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server = settings.server(app, client, host=args.host, port=args.port,
                             log_level=args.log_level)
    from spaceserve.server.engine_client import tune_interpreter

    tune_interpreter()  # collections then scan only what requests allocate
    try:
        try:  # connections with small kernel send buffers (backpressure.py)
            sock = listening_socket(args.host, args.port,
                                    settings.limits.stream.send_buffer_bytes)
        except OSError as exc:
            print(f"spaceserve serve: cannot listen on {args.host}:{args.port}: {exc}",
                  file=sys.stderr)
            return 1
        server.run(sockets=[sock])
    finally:
        client.close()
        engine.close()  # partitions, and a tensor-parallel group's workers
        if app.state.fetcher is not None:
            app.state.fetcher.close()
    # Tearing down the interpreter (the model, torch's threads) can take seconds: after a
    # drain the bound is what was promised, so leave now (logs and streams flushed first).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
