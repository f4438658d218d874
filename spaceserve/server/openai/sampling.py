"""Sampling fields shared by /v1/chat/completions and /v1/completions, and what they become.

`SamplingFields` is the pydantic base of both request models: every generation parameter the
server honours (OpenAI's, and vLLM's extensions with vLLM's names), validated in strict mode.
`to_sampling_params` turns a validated request into the engine's `SamplingParams` once the
prompt's length is known (the default `max_tokens` fills the context). `REFUSED` lists what is
still answered with a 400, and why; docs/serving.md repeats it. `n` (parallel sampling) is
bounded by the engine's `max_num_seqs` (`check_n`), since the engine runs a request's n
sequences in one batch.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spaceserve.runtime.core.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from spaceserve.server.transport.errors import APIError

_TOKEN_ID = re.compile("[0-9]{1,19}")  # a logit_bias key (re's [0-9]: ASCII digits only)
MAX_LOGPROBS = 20  # = spaceserve.runtime.core.request.MAX_LOGPROBS (no torch import here)

# parameter -> the message of the 400 it gets (when set to anything but its neutral value)
REFUSED: dict[str, str] = {
    "best_of": "only best_of=1 or best_of=n is supported (every sampled sequence is returned; "
               "none are ranked or dropped)",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "response_format": "only response_format {'type': 'text'} is supported (no JSON mode or "
                       "structured outputs)",
    "suffix": "suffix (insertion) is not supported",
    "prompt_logprobs": "prompt logprobs are not computed",
    "echo": "echo with logprobs needs prompt logprobs, which are not computed",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "guided_json": "structured outputs are not supported",
    "guided_regex": "structured outputs are not supported",
    "guided_choice": "structured outputs are not supported",
    "guided_grammar": "structured outputs are not supported",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The generation parameters of both endpoints (unknown fields are ignored)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # extension: token ids in the response (as vLLM offers)
    return_tokens_as_token_ids: bool = False  # extension: logprob tokens as "token_id:<id>"
    user: str | None = None
    # refused unless neutral (checked in `check_refused`)
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    prompt_logprobs: int | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = v if isinstance(v, list) else [] if v is None else [v]
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(items)}")
        for i, s in enumerate(items):
            if not s:
                raise ValueError("stop sequences must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:  # matched on every token: bounded
                raise ValueError(f"stop sequence {i} has {len(s)} characters, at most "
                                 f"{MAX_STOP_STRING_CHARS}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not _TOKEN_ID.fullmatch(key):  # not str.isdigit: "١٢" or "²" are no token ids
                raise ValueError(f"keys must be token ids in ASCII decimal digits, got "
                                 f"{key[:32]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias {value} of token {key} must be in [-100, 100]")
        return v

    def check_refused(self) -> None:
        """APIError 400 naming the first parameter set to something not supported."""
        neutral = {"tool_choice": "none", "modalities": ["text"]}
        for name, message in REFUSED.items():
            value = getattr(self, name, None)
            if value is None or value == neutral.get(name) or (name == "tools" and not value):
                continue
            if name == "best_of" and value in (1, self.n):
                continue  # sample n, return all n: what n alone does
            if name == "response_format" and value.get("type") == "text":
                continue
            if name == "echo":
                continue  # checked by the completions endpoint (only with logprobs)
            raise APIError(400, f"{name}: {message}", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def max_choices(engine: Any) -> int | None:
    """The most choices one prompt may ask for: the engine's `max_num_seqs` (an engine's
    ``config``, or the replica client's engine facts); None when unknown."""
    cfg = getattr(engine, "config", None)
    limit = getattr(cfg, "max_num_seqs", None) if cfg is not None else None
    if limit is None:
        limit = getattr(engine, "max_num_seqs", None)
    return limit if isinstance(limit, int) else None


def check_n(n: int, limit: int | None) -> None:
    """APIError 400 (param ``n``) when `n` choices are more than the engine runs at once."""
    if limit is not None and n > limit:
        raise APIError(400, f"n: {n} choices are more than the engine runs at once "
                       f"(max_num_seqs={limit})", param="n")


def param_of(message: str) -> str | None:
    """The request field an engine's ValueError message opens with (``"n=5 ..."``,
    ``"logit_bias: ..."``), when it is one; ``n`` for a message about `max_num_seqs`."""
    name = message.split("=")[0].split(":")[0].split(" ")[0]
    if name in SamplingFields.model_fields:
        return name
    return "n" if "max_num_seqs" in message else None


def to_sampling_params(req: SamplingFields, num_prompt: int, context: int, limit: int | None,
                       logprobs: int | None, what: str = "messages",
                       default_cap: int | None = None) -> Any:
    """The engine's SamplingParams for a prompt of `num_prompt` tokens in a `context`-token
    model; `limit` is the requested output length (None: the rest of the context, at most
    `default_cap`: the request's share of its token budget, bounds.py). APIError 400 when the
    prompt and output do not fit, or a value is out of range."""
    from spaceserve.runtime.core.request import SamplingParams

    if num_prompt >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens, and "
                       f"the {what} alone {'is' if what == 'prompt' else 'are'} {num_prompt} "
                       "tokens long.", param=what)
    if limit is not None and num_prompt + limit > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens; you "
                       f"requested {num_prompt + limit} ({num_prompt} in the {what}, {limit} "
                       "in the completion).", param="max_tokens")
    max_tokens = limit if limit is not None else context - num_prompt
    if limit is None and default_cap is not None:
        max_tokens = min(max_tokens, default_cap)
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}",
                       param="min_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias, seed=req.seed, ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, stop=req.stop or (), stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens, n=req.n)
    except ValueError as exc:
        name = str(exc).split("=")[0].split(":")[0].split(" ")[0]
        raise APIError(400, str(exc), param=name or None) from None
