"""``POST /v1/completions``: OpenAI's (legacy) text completions, as vLLM serves them.

`prompt` is a string, a list of strings, a list of token ids or a list of token-id lists; each
prompt is one engine request with ``n`` choices (parallel sampling: the prompt is processed
once), choice j of prompt p having ``index`` p * n + j, as OpenAI and vLLM number them. Prompt
text is tokenised with special-token text kept plain (`runtime.inputs.encode_plain`, the rule
of chat text), in the preprocessing pool's light lane under the request's deadline, after its
size is checked against what the context can hold; token ids go in as they are. `echo` puts
the prompt's text before each choice's completion; `logprobs` N returns the
completions-format logprobs (the sampled token and the N most likely at every position, with
text offsets). Usage counts each prompt once and every choice's tokens. Streaming sends
``text_completion`` chunks per choice as text appears (the echoed prompt on a choice's first),
the finish reason on a choice's last chunk, a usage chunk when
``stream_options.include_usage``, then ``data: [DONE]``; nothing is sent until every prompt
has its first token, so a bad prompt is still a JSON error with a 400.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from spaceserve.server.handles import Cancelled, QueueFull
from spaceserve.server.openai import protocol as P
from spaceserve.server.openai.bounds import RequestBounds
from spaceserve.server.openai.logprobs import TokenText, completion_logprobs
from spaceserve.server.openai.preprocess import pool_error
from spaceserve.server.openai.sampling import (
    MAX_LOGPROBS,
    REFUSED,
    SamplingFields,
    check_n,
    max_choices,
    to_sampling_params,
)
from spaceserve.server.openai.streams import (
    error_of,
    failure_of,
    json_response,
    read_request,
    shutdown_error,
    until_disconnect,
)
from spaceserve.server.settings import request_fair_key
from spaceserve.server.transport.backpressure import SlowReaderGuard, WatchedStreamingResponse
from spaceserve.server.transport.errors import APIError
from spaceserve.server.transport.guard import new_id, release_body

if TYPE_CHECKING:
    from fastapi import FastAPI

    from spaceserve.runtime.core.request import RequestOutput
    from spaceserve.server.engine_client import AsyncEngine
    from spaceserve.server.handles import Handle

MAX_PROMPTS = 64  # prompts in one request at most (each is an engine request)


class CompletionRequest(SamplingFields):
    """The fields of /v1/completions SpaceServe honours (see sampling.py for the shared ones)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per choice; APIError 400 when there are none or too
        many, or one is empty."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        elif isinstance(p[0], int):
            out = [p]  # type: ignore[list-item]
        else:
            out = list(p)  # type: ignore[arg-type]
        if len(out) > MAX_PROMPTS:
            raise APIError(400, f"prompt: {len(out)} prompts, at most {MAX_PROMPTS} per request",
                           param="prompt")
        for i, one in enumerate(out):
            if isinstance(one, list) and not one:
                raise APIError(400, f"prompt[{i}]: empty token list", param="prompt")
        if self.suffix is not None:
            raise APIError(400, f"suffix: {REFUSED['suffix']}", param="suffix")
        if self.echo and self.logprobs is not None:
            raise APIError(400, f"echo: {REFUSED['echo']}", param="echo")
        return out


def prompt_error(exc: APIError) -> APIError:
    """`exc` with ``param`` "prompt" when it is about one prompt or a part of it
    (``prompt[2]``, ``prompt[0][5]``): the parameter is `prompt`; the message says where."""
    if exc.param is not None and exc.param.startswith("prompt["):
        exc.param = "prompt"
    return exc


def vocab_size(engine: Any) -> int | None:
    """The engine's vocabulary size (an `Engine`'s runner, or the replica client's engine
    facts); None when unknown (the engine checks token ids then)."""
    info = getattr(getattr(engine, "runner", None), "info", None)
    size = getattr(info, "vocab_size", None) if info is not None else None
    if size is None:
        size = getattr(engine, "vocab_size", None)
    return size if isinstance(size, int) else None


def check_token_ids(ids: list[int], i: int, vocab: int | None) -> list[int]:
    """Prompt `i`'s token ids, each in the vocabulary; APIError 400 (param ``prompt``)."""
    for j, t in enumerate(ids):
        if t < 0 or (vocab is not None and t >= vocab):
            raise APIError(400, f"prompt[{i}][{j}]: token id {t} is outside the vocabulary "
                           f"(0..{vocab - 1 if vocab else 'its size'})", param="prompt")
    return ids


class _Prompt:
    """One prompt's engine request (all its n choices): its handle, its text for `echo`, its
    first output (streaming)."""

    def __init__(self, index: int, handle: Handle) -> None:
        self.index, self.handle = index, handle
        self.prompt_text = ""
        self.first: RequestOutput | None = None


class _Choice:
    """One choice: its index in the response, its logprob text offset, whether its first
    chunk is sent, its latest output."""

    def __init__(self, index: int, prompt: _Prompt) -> None:
        self.index, self.prompt = index, prompt
        self.offset = 0
        self.started = False
        self.last: RequestOutput | None = None


def _usage(prompts: list[_Prompt], outs: list[RequestOutput]) -> dict[str, int]:
    """Every prompt counted once (its choices share it), every choice's tokens."""
    return P.usage(sum(len(p.first.prompt_token_ids) for p in prompts if p.first),
                   sum(len(o.token_ids) for o in outs))


def add_completions_route(app: FastAPI, client: AsyncEngine, preprocessor: Any, *,
                          model_name: str, limits: Any, texts: TokenText) -> None:
    """Register ``POST /v1/completions`` on `app` (module docstring)."""
    from spaceserve.runtime.inputs import (
        DeadlineExceeded,
        InputError,
        check_text_size,
        encode_plain,
        text_byte_limit,
    )
    from spaceserve.runtime.inputs import QueueFull as PoolFull

    tokenizer = getattr(preprocessor, "tokenizer", None)
    ctx = client.engine.max_model_len
    max_text = text_byte_limit(tokenizer, ctx) if tokenizer is not None else None
    choices_limit = max_choices(client.engine)  # n per prompt at most (max_num_seqs)
    bounds = RequestBounds.for_engine(client.engine, limits.max_seqs_per_request,
                                      limits.max_tokens_per_request)
    vocab = vocab_size(client.engine)

    def prepare(prompt: str | list[int], i: int) -> dict[str, Any]:
        if isinstance(prompt, list):
            return {"prompt_token_ids": check_token_ids(prompt, i, vocab)}
        try:
            if tokenizer is None:
                raise InputError("prompt: this checkpoint has no tokenizer; send token ids",
                                 kind="unsupported", param="prompt")
            if max_text is not None:
                check_text_size([prompt], max_text, context_len=ctx, param=f"prompt[{i}]")
            ids = encode_plain(tokenizer, prompt)
        except InputError as exc:
            raise prompt_error(P.input_error(exc)) from None
        if not ids:
            raise APIError(400, f"prompt[{i}]: the text holds no tokens", param="prompt")
        return {"prompt_token_ids": ids}

    def sampling(req: CompletionRequest, prompt: dict[str, Any], cap: int | None) -> Any:
        return to_sampling_params(req, len(prompt["prompt_token_ids"]),
                                  client.engine.max_model_len, req.max_tokens, req.logprobs,
                                  what="prompt", default_cap=cap)

    def echo_text(prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return tokenizer.decode(prompt, skip_special_tokens=False) if tokenizer else ""

    def choice_body(c: _Choice, out: RequestOutput, text: str, req: CompletionRequest,
                    whole: bool) -> dict[str, Any]:
        """A choice's body: its whole output (`whole`), or what is new in `out`."""
        lps = None
        if req.logprobs is not None:
            entries = (out.logprobs or []) if whole else (out.new_logprobs or [])
            lps, c.offset = completion_logprobs(entries, texts, c.offset,
                                                req.return_tokens_as_token_ids)
        body: dict[str, Any] = {"index": c.index, "text": text, "logprobs": lps,
                                "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            body["stop_reason"] = out.stop_reason
        if req.return_token_ids:
            body["token_ids"] = list(out.token_ids if whole else out.new_token_ids)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = await read_request(request, limits.max_body_bytes, CompletionRequest)
        except APIError as exc:
            raise prompt_error(exc) from None
        if req is None:
            return Response(status_code=499)
        prompts = req.prompts()
        if req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           type="NotFoundError", code="model_not_found")
        check_n(req.n, choices_limit)
        cap = bounds.check(len(prompts), req.n, req.max_tokens)
        if not client.alive or client.draining:
            raise APIError(503, "the engine is not running", type="server_error")
        rid = new_id("cmpl-")
        parts: list[_Prompt] = []
        try:
            for i in range(len(prompts)):
                parts.append(_Prompt(i, client.reserve(f"{rid}-{i}")))
        except QueueFull as exc:
            for p in parts:
                p.handle.close()
            raise APIError(503, f"server busy: {exc}; retry later", type="server_error",
                           code="queue_full") from None
        for part in parts:
            part.handle.fair_key = request_fair_key(request, req)
            part.handle.door = request.scope.get("state", {}).get("door")
        gone = asyncio.ensure_future(until_disconnect(request))
        streaming = False
        deadline = request.scope.get("state", {}).get("deadline") or \
            time.monotonic() + limits.preprocess_timeout_s  # from the body's arrival
        try:
            try:
                await asyncio.gather(*(
                    part.handle.start(lambda p=p, i=i: prepare(p, i),
                                      lambda x: sampling(req, x, cap), stream=req.stream,
                                      lane="light", deadline=deadline)
                    for i, (part, p) in enumerate(zip(parts, prompts, strict=True))))
            except (DeadlineExceeded, PoolFull) as exc:
                raise pool_error(exc, "preprocessing", limits.preprocess_timeout_s) from None
            except Cancelled as exc:
                raise shutdown_error(exc) from None
            for part, p in zip(parts, prompts, strict=True):
                part.prompt_text = echo_text(p) if req.echo else ""
            req.prompt = ""  # the engine holds the prompts: drop the body's text
            release_body(request.scope.get("state", {}))
            got = await _outputs(parts, gone, every=not req.stream)
            if got is None:
                return Response(status_code=499)
            failed = failure_of([o for outs in got for o in outs])
            if failed is not None:
                raise failed
            for part, outs in zip(parts, got, strict=True):
                part.first = outs[0]
            created_at = P.now()
            if not req.stream:
                body = [choice_body(_Choice(p.index * req.n + out.index, p), out,
                                    p.prompt_text + (out.text or ""), req, True)
                        for p, outs in zip(parts, got, strict=True) for out in outs]
                return json_response({"id": rid, "object": "text_completion",
                                      "created": created_at, "model": model_name,
                                      "choices": body,
                                      "usage": _usage(parts, [o for outs in got for o in outs])})
            streaming = True
            return WatchedStreamingResponse(  # paused while the client does not read
                _stream(req, rid, parts, gone, created_at), guard=SlowReaderGuard(
                    limits.stream, lambda: [p.handle.pause() for p in parts],
                    lambda: [p.handle.resume() for p in parts]),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finally:
            if not streaming:
                gone.cancel()
                for p in parts:
                    p.handle.close()

    async def _stream(req: CompletionRequest, rid: str, parts: list[_Prompt],
                      gone: asyncio.Task, created_at: int) -> AsyncIterator[bytes]:
        def chunk(body: dict[str, Any]) -> bytes:
            obj = {"id": rid, "object": "text_completion", "created": created_at,
                   "model": model_name, "choices": [body]}
            if req.include_usage():
                obj["usage"] = None
            return P.sse(obj)

        choices = [_Choice(p.index * req.n + j, p) for p in parts for j in range(req.n)]

        def send(out: RequestOutput, part: _Prompt) -> bytes | None:
            """The chunk of `out` for its choice (a choice's first chunk always, with the
            echoed prompt), or None when it holds nothing new."""
            c = choices[part.index * req.n + out.index]
            c.last = out
            if c.started and not (out.delta_text or out.finished or (
                    req.logprobs is not None and out.new_logprobs) or (
                    req.return_token_ids and out.new_token_ids)):
                return None
            text = out.delta_text if c.started else part.prompt_text + out.delta_text
            c.started = True
            return chunk(choice_body(c, out, text, req, False))

        waiting: dict[int, asyncio.Future] = {}
        try:
            for p in parts:  # the first outputs, already here
                assert p.first is not None
                data = send(p.first, p)
                if data is not None:
                    yield data
                if not p.handle.finished:
                    waiting[p.index] = asyncio.ensure_future(p.handle.next())
            while waiting:
                done, _ = await asyncio.wait((*waiting.values(), gone),
                                             return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    return
                for i, fut in list(waiting.items()):
                    if fut not in done:
                        continue
                    p, out = parts[i], fut.result()
                    if out.finish_reason == "error":
                        yield P.sse(error_of(out).body())
                        return
                    data = send(out, p)
                    if data is not None:
                        yield data
                    if p.handle.finished:
                        del waiting[i]
                    else:
                        waiting[i] = asyncio.ensure_future(p.handle.next())
            if req.include_usage():
                yield P.sse({"id": rid, "object": "text_completion", "created": created_at,
                             "model": model_name, "choices": [],
                             "usage": _usage(parts, [c.last for c in choices if c.last])})
            yield b"data: [DONE]\n\n"
        finally:
            for fut in waiting.values():
                fut.cancel()
            gone.cancel()
            for p in parts:
                p.handle.close()


async def _outputs(parts: list[_Prompt], gone: asyncio.Task, every: bool
                   ) -> list[list[RequestOutput]] | None:
    """Each prompt's first output, or (`every`: a non-streaming request, whose outputs are all
    final) the final outputs of all its choices in index order; None once the client has
    gone."""
    async def take(handle: Handle) -> list[RequestOutput]:
        outs = [await handle.next()]
        while every and not handle.finished:
            outs.append(await handle.next())
        return sorted(outs, key=lambda o: o.index)

    everything = asyncio.ensure_future(asyncio.gather(*(take(p.handle) for p in parts)))
    done, _ = await asyncio.wait((everything, gone), return_when=asyncio.FIRST_COMPLETED)
    if everything in done:
        return list(everything.result())
    everything.cancel()
    return None
