"""OpenAI chat-completions wire format: validated requests, response and chunk builders, errors.

Input processing (`spaceserve.runtime.inputs`) takes a request's messages as plain dicts
(`chat_messages`); its `InputError`s become OpenAI-style errors here (`input_error`).

Requests are pydantic models validated in strict mode (a string is not a number, a number is
not a bool), so a malformed field is a 400 that names it; the generation parameters shared with
/v1/completions live in sampling.py, that endpoint's wire format in completions.py. Responses
are plain dicts built by the functions below: they sit on the per-token path of streaming,
where model validation would only add latency.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError

from spaceserve.runtime.inputs import (
    ChatPlan,
    ChatPreprocessor,
    ImageLimits,
    InputError,
    VideoLimits,
)
from spaceserve.server.openai.sampling import (
    MAX_LOGPROBS,
    REFUSED,
    SamplingFields,
    StreamOptions,
    Strict,
)
from spaceserve.server.transport.errors import APIError
from spaceserve.server.transport.prescan import ScanLimits, scan_json

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "StreamOptions"]
_Model = Strict
MAX_JSON_DEPTH = 32  # an OpenAI request nests about 6 deep
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # may be a lone surrogate: check it


class ImageURL(_Model):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Model):
    url: str = Field(min_length=1)


class VideoPart(_Model):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """The fields SpaceServe honours; unknown fields are ignored, unsupported ones refused."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def output_limit(self) -> int | None:
        """`max_completion_tokens` wins over the older `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top logprobs per token for the engine (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def _loc(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as a field path; union branch and tag names dropped."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or "-" in str(part) or part == "str":
            continue  # a union branch, not a field
        elif part in ("text", "image_url", "video_url") and i and isinstance(loc[i - 1], int) \
                and i + 1 < len(loc):
            continue  # the tag of a content part, followed by its field
        else:
            out += f".{part}" if out else str(part)
    return out


def check_json(data: Any) -> None:
    """APIError 400 for JSON nested deeper than `MAX_JSON_DEPTH` or holding a lone UTF-16
    surrogate (``"\\ud800"``: not Unicode text) in any string, key or value, naming where."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        obj, where, depth = stack.pop()
        if isinstance(obj, str):
            if not obj.isascii() and (m := _SURROGATE.search(obj)):
                where = _SURROGATE.sub("?", where)
                raise APIError(400, f"{where or 'body'}: a lone UTF-16 surrogate "
                               f"(U+{ord(m.group()):04X}) at character {m.start()} is not "
                               "valid Unicode text", param=where or None)
            continue
        if depth > MAX_JSON_DEPTH and isinstance(obj, (dict, list)):
            raise APIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(obj, dict):
            for key, value in obj.items():
                path = f"{where}.{key}" if where else str(key)
                stack.append((key, path if len(path) < 200 else "body", depth))
                stack.append((value, path if len(path) < 200 else "body", depth + 1))
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                stack.append((value, f"{where}[{i}]" if len(where) < 200 else "body",
                              depth + 1))


Req = TypeVar("Req", bound=SamplingFields)


def decode_body(body: bytes | bytearray) -> tuple[str, bool]:
    """A body's JSON text (UTF-8, or UTF-16/32 as `json.loads` detects them) and whether it
    may hold a lone surrogate (raw, or not UTF-8); a bytearray is emptied once decoded (its
    memory is free). APIError 400 for bytes that are no text."""
    enc = json.detect_encoding(body)
    try:
        try:
            text, raw_surrogates = (body.decode(enc), False) if enc == "utf-8" else \
                (body.decode(enc, "surrogatepass"), True)
        except UnicodeDecodeError:
            text, raw_surrogates = body.decode(enc, "surrogatepass"), True
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if isinstance(body, bytearray):
        body.clear()
    return text, raw_surrogates


def parse_body(body: bytes | bytearray, model: type[Req], scan: ScanLimits | None = None,
               cancel_point: Callable[[], None] = lambda: None) -> Req:
    """Bytes to a validated request of `model`, after the structural pre-scan (`scan`,
    prescan.py; the defaults when None) bounds what parsing it may cost; APIError 400 (413)
    naming the first bad field (the bound passed). A bytearray is emptied on the way."""
    text, maybe_surrogates = decode_body(body)
    scan_json(text, scan or ScanLimits(), cancel_point)
    cancel_point()
    maybe_surrogates = maybe_surrogates or _SURROGATE_ESCAPE.search(text) is not None
    try:
        data = json.loads(text)
    except RecursionError:
        raise APIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
                       ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # an integer past Python's digit limit for int(str)
        if "integer string conversion" in str(exc):
            raise APIError(400, f"a number in the body has more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    del text
    if maybe_surrogates:
        check_json(data)  # the pre-scan bounded the depth; this names a surrogate's place
    cancel_point()
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        err = max(exc.errors(include_url=False), key=lambda e: len(e.get("loc", ())))
        where = _loc(tuple(err.get("loc", ())))
        msg = err.get("msg", "invalid value")
        if err.get("type") == "value_error":  # our validators' own words, without pydantic's tag
            msg = msg.removeprefix("Value error, ")
        if where in REFUSED:
            msg = REFUSED[where]
        raise APIError(400, f"{where or 'body'}: {msg}", param=where or None) from None
    req.check_refused()
    return req


def parse_request(body: bytes | bytearray) -> ChatCompletionRequest:
    """Bytes to a validated chat request; APIError 400 naming the first bad field."""
    return parse_body(body, ChatCompletionRequest)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """A validated request's messages as the plain dicts input processing takes (no copy of
    the media URLs)."""
    out: list[dict[str, Any]] = []
    for m in req.messages:
        if m.content is None or isinstance(m.content, str):
            content: Any = m.content
        else:
            content = [{"type": "text", "text": part.text} if part.type == "text" else
                       {"type": part.type, part.type: {"url": getattr(part, part.type).url}}
                       for part in m.content]
        out.append({"role": m.role, "content": content})
    return out


# InputError kind -> HTTP status (OpenAI answers client input errors with a 400; a request
# over its pixel budget is 413, one the server is too busy to decode now 429 + Retry-After)
INPUT_ERROR_STATUS: dict[str, int] = {
    "invalid": 400,
    "too_large": 400,
    "over_budget": 413,
    "busy": 429,
    "bad_image": 400,
    "bad_video": 400,
    "not_allowed": 400,
    "fetch_failed": 400,
    "not_found": 400,
    "unsupported": 400,
}


def input_error(exc: InputError) -> APIError:
    """The OpenAI-style error answering an input-processing error."""
    status = INPUT_ERROR_STATUS.get(exc.kind, 400)
    return APIError(status, str(exc), param=exc.param,
                    type="server_error" if status == 429 else "invalid_request_error",
                    code="server_busy" if status == 429 else None,
                    retry_after=exc.retry_after)


def _answer(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn(*args, **kw)`, its InputError answered as an APIError."""
    try:
        return fn(*args, **kw)
    except InputError as exc:
        raise input_error(exc) from None


def prepare_chat(preprocessor: ChatPreprocessor, req: ChatCompletionRequest,
                 limits: ImageLimits, video_limits: VideoLimits | None = None, *,
                 fetcher: Any = None, **bounds: Any) -> dict[str, Any]:
    """A request's engine prompt (blocking: run it off the event loop; remote media through
    `fetcher`); APIError on anything the client got wrong. `bounds`:
    `ChatPreprocessor.plan`'s text bounds."""
    return finish_chat(preprocessor, plan_chat(preprocessor, req, limits, video_limits,
                                               fetcher=fetcher, **bounds))


def plan_chat(preprocessor: ChatPreprocessor, req: ChatCompletionRequest, limits: ImageLimits,
              video_limits: VideoLimits | None = None, *, fetcher: Any = None,
              **bounds: Any) -> ChatPlan:
    """The cheap, checking half of preprocessing (`ChatPreprocessor.plan`, given `bounds`);
    APIError."""
    return _answer(preprocessor.plan, chat_messages(req), limits, video_limits,
                   fetcher=fetcher, **bounds)


def start_chat(preprocessor: ChatPreprocessor, req: ChatCompletionRequest, limits: ImageLimits,
               video_limits: VideoLimits | None = None, *, fetcher: Any = None,
               **bounds: Any) -> ChatPlan:
    """`ChatPreprocessor.start_plan` (text bounds, template, counts; remote fetches started);
    APIError."""
    return _answer(preprocessor.start_plan, chat_messages(req), limits, video_limits,
                   fetcher=fetcher, **bounds)


def read_chat(preprocessor: ChatPreprocessor, plan: ChatPlan, **kw: Any) -> ChatPlan:
    """`ChatPreprocessor.read_media` (bytes, headers, the per-request budget); APIError."""
    return _answer(preprocessor.read_media, plan, **kw)


def finish_chat(preprocessor: ChatPreprocessor, plan: ChatPlan,
                deadline: float | None = None) -> dict[str, Any]:
    """The decoding half (`ChatPreprocessor.finish`); APIError."""
    return _answer(preprocessor.finish, plan, deadline=deadline)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int], *,
                return_token_ids: bool = False, logprobs: Any = None,
                stop_reason: int | str | None = None) -> dict[str, Any]:
    """One choice of a non-streaming ``chat.completion`` (`logprobs`: its ``{"content":
    [...]}``; `stop_reason`: the stop string or token id that ended it, as vLLM reports)."""
    choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                              "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def completion_response(rid: str, model: str, created: int, choices: list[dict[str, Any]],
                        prompt_ids: list[int], completion_tokens: int, *,
                        return_token_ids: bool = False) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object of `choices` (`chat_choice`s) for one prompt:
    usage counts the prompt once and `completion_tokens` over every choice."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created,
                           "model": model, "choices": choices,
                           "usage": usage(len(prompt_ids), completion_tokens)}
    if return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def chunk(rid: str, model: str, created: int, delta: dict[str, Any],
          finish_reason: str | None = None, *, include_usage: bool = False,
          token_ids: list[int] | None = None, logprobs: Any = None,
          stop_reason: int | str | None = None, index: int = 0) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice (choice `index`)."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


# Characters Python's str.splitlines() (and so httpx's aiter_lines) takes as line ends that
# json.dumps(ensure_ascii=False) leaves raw: escaped, so one event stays one line for every
# client (the JSON is the same).
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = obj if isinstance(obj, str) else json.dumps(
        obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_ENDS)
    return f"data: {data}\n\n".encode()


def now() -> int:
    return int(time.time())
