"""Where benchmark requests go: the server over HTTP (SSE streaming), or the engine in-process.

Both send the same chat body (an image as a base64 PNG ``data:`` URL, greedy, ``ignore_eos``)
and return a `Result` on the caller's monotonic clock. Over HTTP, a token's time is the arrival
of its SSE chunk and the output count is the usage chunk's; in-process, the engine's own
timestamps are used (same clock), with the request sent through the server's preprocessing
path (chat template, image decoding in the worker pool) minus HTTP - or, for a model without a
tokenizer (random weights), as a token-id prompt built before the clock starts.
"""

from __future__ import annotations

import json
import time
from typing import Any

from spaceserve.runtime.inputs import ImageLimits, to_data_url
from spaceserve.server.errors import APIError

from .metrics import Result
from .prompts import prompt_shape
from .workload import BenchRequest, image_png


def chat_body(req: BenchRequest, model: str, *, stream: bool = True) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if req.kind == "image":
        url = to_data_url(image_png(req.resolution, req.image_seed))
        content.append({"type": "image_url", "image_url": {"url": url}})
    content.append({"type": "text", "text": req.prompt})
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": req.max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class InProcessBackend:
    """Requests into an `AsyncEngine` (no HTTP): chat bodies through `preprocessor`, or, when
    `prompts` is given (a function of a `BenchRequest`, e.g. `TokenPrompts`), its prompts."""

    name = "inprocess"

    def __init__(self, client: Any, preprocessor: Any, model: str = "tiny",
                 limits: ImageLimits | None = None, *, prompts: Any = None) -> None:
        if preprocessor is None and prompts is None:
            raise ValueError("preprocessor: needed when no prompts function is given")
        self.client, self.pre, self.model = client, preprocessor, model
        self.limits = limits or ImageLimits()
        self.prompts = prompts

    def body(self, req: BenchRequest, model: str) -> Any:
        """What `send` takes for `req` (built before the run's clock starts)."""
        return self.prompts(req) if self.prompts is not None else chat_body(req, model)

    def _prepare(self, body: Any) -> Any:
        if self.prompts is not None:
            return body
        # pydantic: chat bodies only
        from spaceserve.server.protocol import ChatCompletionRequest, prepare_chat

        chat = ChatCompletionRequest.model_validate(body | {"stream": False,
                                                            "stream_options": None})
        return prepare_chat(self.pre, chat, self.limits)

    async def send(self, req: BenchRequest, body: Any) -> Result:
        from spaceserve.runtime.request import SamplingParams

        res = Result(req.idx, req.kind, req.resolution, time.monotonic())
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        info = getattr(getattr(getattr(self.client, "engine", None), "runner", None), "info",
                       None)
        merge = int(getattr(info, "spatial_merge_size", 2))
        try:
            handle = self.client.reserve()
        except Exception as exc:  # queue full
            res.error = str(exc)
            return res
        try:
            prompt = await handle.start(lambda: self._prepare(body), params, stream=False)
            res.prompt_tokens, res.image_tokens = prompt_shape(prompt, merge)
            out = await handle.next()
        except APIError as exc:
            res.error = exc.message
            return res
        finally:
            handle.close()
        m = out.metrics
        if out.finish_reason not in ("stop", "length"):
            res.error = out.error or f"finished with {out.finish_reason}"
            return res
        res.first_token, res.token_times = m.first_token_time, list(m.token_times)
        res.finish, res.text = m.finished_time, out.text or ""
        res.prompt_tokens, res.output_tokens = len(out.prompt_token_ids), len(out.token_ids)
        return res


class HttpBackend:
    """Requests to a running server's /v1/chat/completions, streamed."""

    name = "http"

    def __init__(self, base_url: str, model: str, timeout: float = 600.0) -> None:
        import httpx

        self.base_url, self.model = base_url.rstrip("/"), model
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                      limits=httpx.Limits(max_connections=1024,
                                                          max_keepalive_connections=1024))

    def body(self, req: BenchRequest, model: str) -> dict[str, Any]:
        return chat_body(req, model)

    async def send(self, req: BenchRequest, body: dict[str, Any]) -> Result:
        res = Result(req.idx, req.kind, req.resolution, time.monotonic())
        text: list[str] = []
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    data = await resp.aread()
                    res.error = f"HTTP {resp.status_code}: {data[:200].decode(errors='replace')}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        res.finish = time.monotonic()
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"].get("message"))
                        return res
                    if obj.get("usage"):
                        res.prompt_tokens = obj["usage"]["prompt_tokens"]
                        res.output_tokens = obj["usage"]["completion_tokens"]
                    if obj.get("choices"):
                        now = time.monotonic()
                        if res.first_token is None:
                            res.first_token = now
                        res.token_times.append(now)
                        text.append(obj["choices"][0]["delta"].get("content") or "")
        except Exception as exc:  # connection errors count as failed requests
            res.error = f"{type(exc).__name__}: {exc}"
        res.text = "".join(text)
        return res

    async def metrics_text(self) -> str:
        resp = await self.http.get("/metrics")
        return resp.text

    async def close(self) -> None:
        await self.http.aclose()
