"""Where benchmark requests go: the server over HTTP (SSE streaming), or the engine in-process.

Both send the same body - a chat body (an image as a base64 PNG ``data:`` URL, greedy,
``ignore_eos``), or with ``endpoint="/v1/completions"`` a text completion (text-only workloads)
- and return a `Result` on the caller's monotonic clock. Over HTTP, a token's time is the arrival
of its SSE chunk and the output count is the usage chunk's; in-process, the engine's own
timestamps are used (same clock), with the request sent through the server's preprocessing
path (chat template, image decoding in the worker pool) minus HTTP - or, for a model without a
tokenizer (random weights), as a token-id prompt built before the clock starts.
"""

from __future__ import annotations

import json
import time
from typing import Any

from spaceserve.bench.metrics import Result
from spaceserve.bench.prompts import prompt_shape
from spaceserve.bench.workload import BenchRequest, image_png
from spaceserve.runtime.inputs import ImageLimits, to_data_url
from spaceserve.server.transport.errors import APIError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


def check_endpoint(endpoint: str, image_mix: dict[str, float]) -> None:
    """ValueError naming ``--endpoint`` when it is unknown, or is /v1/completions with images
    in the mix (a text completion carries no image)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
    if endpoint == COMPLETIONS and any(w > 0 for k, w in image_mix.items() if k != "text"):
        raise ValueError("--endpoint /v1/completions takes text prompts only: use an image mix "
                         "of text alone (--image-mix text=1)")


def completion_body(req: BenchRequest, model: str, *, stream: bool = True) -> dict[str, Any]:
    """A /v1/completions body for a text request (greedy, ``ignore_eos``)."""
    if req.kind == "image":
        raise ValueError("a text completion carries no image")
    body: dict[str, Any] = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body

JSON_HEADERS = {"Content-Type": "application/json"}


def chat_body(req: BenchRequest, model: str, *, stream: bool = True) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": req.prompt}]
    if req.kind == "image":  # after the text, as vLLM's benchmark and aiperf send it
        url = to_data_url(image_png(req.resolution, req.image_seed))
        content.append({"type": "image_url", "image_url": {"url": url}})
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
                 limits: ImageLimits | None = None, *, prompts: Any = None,
                 endpoint: str = CHAT) -> None:
        if preprocessor is None and prompts is None:
            raise ValueError("preprocessor: needed when no prompts function is given")
        self.client, self.pre, self.model = client, preprocessor, model
        self.limits = limits or ImageLimits()
        self.prompts = prompts
        self.endpoint = endpoint

    def body(self, req: BenchRequest, model: str) -> Any:
        """What `send` takes for `req` (built before the run's clock starts)."""
        if self.prompts is not None:
            return self.prompts(req)
        return completion_body(req, model) if self.endpoint == COMPLETIONS else \
            chat_body(req, model)

    def _prepare(self, body: Any) -> Any:
        if self.prompts is not None:
            return body
        if self.endpoint == COMPLETIONS:  # the server's prompt-text path
            from spaceserve.runtime.inputs import encode_plain

            return {"prompt_token_ids": encode_plain(self.pre.tokenizer, body["prompt"])}
        # pydantic: chat bodies only
        from spaceserve.server.openai.protocol import ChatCompletionRequest, prepare_chat

        chat = ChatCompletionRequest.model_validate(body | {"stream": False,
                                                            "stream_options": None})
        return prepare_chat(self.pre, chat, self.limits)

    async def send(self, req: BenchRequest, body: Any) -> Result:
        from spaceserve.runtime.core.request import SamplingParams

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


class Unreachable(Exception):
    """The server did not answer (connection refused, DNS, timeout): the benchmark stops."""


class HttpBackend:
    """Requests to a running server's /v1/chat/completions (or `endpoint`), streamed, over
    aiohttp.

    The client keeps its own time small, as trusted load generators do: bodies are serialised
    before the run's clock starts (`body`), each SSE line is stamped on arrival before it is
    parsed, and aiohttp's C-accelerated HTTP parser reads the stream (httpx's pure-Python
    one added about 2 ms to every TTFT on a loaded 2-core CPU). `poll_metrics`: the benchmark
    scrapes /metrics every `POLL_S` for the SM split timeline while it runs.
    """

    name = "http"
    POLL_S = 0.5

    def __init__(self, base_url: str, model: str, timeout: float = 600.0, *,
                 poll_metrics: bool = True, endpoint: str = CHAT) -> None:
        self.base_url, self.model, self.endpoint = base_url.rstrip("/"), model, endpoint
        self.poll_metrics, self.timeout = poll_metrics, timeout
        self._session: Any = None

    def _http(self) -> Any:
        """The session, made inside the running event loop on first use."""
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                self.base_url, timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        return self._session

    async def info(self, timeout: float = 10.0) -> dict[str, Any]:
        """The served model names and the device (``/v1/models``, ``/health``); raises
        `Unreachable` with the connection error when the server does not answer."""
        import aiohttp

        out: dict[str, Any] = {"models": [], "device": None}
        try:
            wait = aiohttp.ClientTimeout(total=timeout)
            async with self._http().get("/v1/models", timeout=wait) as resp:
                models = await resp.read()
            async with self._http().get("/health", timeout=wait) as resp:
                health = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unreachable(f"cannot reach the server at {self.base_url}: "
                              f"{type(exc).__name__}: {exc or 'timed out'}") from None
        try:
            out["models"] = [m["id"] for m in json.loads(models).get("data", [])]
            out["device"] = json.loads(health).get("device")
        except (ValueError, AttributeError, KeyError, TypeError):
            pass  # not a SpaceServe server: no device named
        return out

    def body(self, req: BenchRequest, model: str) -> bytes:
        """The request's JSON body, serialised (before the clock starts)."""
        body = completion_body(req, model) if self.endpoint == COMPLETIONS else \
            chat_body(req, model)
        return json.dumps(body).encode()

    async def send(self, req: BenchRequest, body: bytes | dict[str, Any]) -> Result:
        res = Result(req.idx, req.kind, req.resolution, time.monotonic())
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        text: list[str] = []
        try:
            async with self._http().post(self.endpoint, data=body,
                                         headers=JSON_HEADERS) as resp:
                if resp.status != 200:
                    data = await resp.read()
                    res.error = f"HTTP {resp.status}: {data[:200].decode(errors='replace')}"
                    return res
                async for line in resp.content:
                    now = time.monotonic()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        res.finish = now
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"].get("message"))
                        return res
                    if obj.get("usage"):
                        res.prompt_tokens = obj["usage"]["prompt_tokens"]
                        res.output_tokens = obj["usage"]["completion_tokens"]
                    if obj.get("choices"):
                        if res.first_token is None:
                            res.first_token = now
                        res.token_times.append(now)
                        choice = obj["choices"][0]
                        piece = choice.get("text") if "text" in choice else \
                            choice.get("delta", {}).get("content")
                        text.append(piece or "")
        except Exception as exc:  # connection errors count as failed requests
            res.error = f"{type(exc).__name__}: {exc}"
        res.text = "".join(text)
        return res

    async def metrics_text(self) -> str:
        async with self._http().get("/metrics") as resp:
            return await resp.text()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
