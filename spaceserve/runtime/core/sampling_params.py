"""Sampling parameters of one request: what may be asked, validated on construction.

`SamplingParams` follows vLLM's names and semantics where OpenAI's are silent; the engine checks
what needs the model (token ids inside the vocabulary) when a request is added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spaceserve.checks import check_bool, check_float, check_int

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_STOP_STRINGS = 4
# Stop strings are matched against the detokenised tail on every generated token, so their
# length multiplies the per-token cost of a request; 1,000 characters covers any real stop text.
MAX_STOP_STRING_CHARS = 1000
MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's chat limit)
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100]
PLACEHOLDER = -1  # a sampled token still on the device (engine-internal)

__all__ = ["SamplingParams", "check_float", "check_int"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request; every field is validated (ValueError names it).

    Logits are processed in vLLM's order: `min_tokens` (end-of-sequence and stop tokens barred
    until that many tokens exist), `logit_bias` (added), `repetition_penalty` (logits of tokens
    seen in the prompt or the output divided by it when positive, multiplied when not),
    `frequency_penalty` and `presence_penalty` (subtracted per occurrence and once, over the
    output), then greedy when `temperature` is 0; otherwise softmax(logits / temperature)
    restricted by `min_p` (relative to the most likely token), `top_k` (0 or -1: off) and
    `top_p`. The draw for the token at sequence index ``i`` depends only on (seed, i), so
    batching, batch neighbours and preemption never change it; without a seed the engine picks
    one at arrival (a later choice of the same prompt would take seed + its index).

    `stop` (up to 4 strings, 1,000 characters each) ends the output before the first occurrence
    of any of them, matched on the detokenised text across token boundaries (kept when
    `include_stop_str_in_output`);
    `stop_token_ids` and the model's end-of-sequence tokens (unless `ignore_eos`) end it after
    that token. `logprobs` N asks for the log-probability of every sampled token and the N most
    likely alternatives (0..20), from the raw logits before any processing.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = None  # {token id: bias}; stored as a sorted tuple of (id, bias) pairs
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: Any = ()  # a str or a sequence of str; stored as a tuple
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1  # choices per prompt (parallel sampling: the prompt is processed once)

    def __post_init__(self) -> None:
        put = object.__setattr__
        check_int("max_tokens", self.max_tokens, 1)
        check_int("n", self.n, 1)
        put(self, "temperature", check_float("temperature", self.temperature, 0.0, math.inf))
        put(self, "top_p", check_float("top_p", self.top_p, 0.0, 1.0, low_open=True))
        put(self, "min_p", check_float("min_p", self.min_p, 0.0, 1.0))
        top_k = check_int("top_k", self.top_k, -1)
        put(self, "top_k", 0 if top_k < 0 else top_k)
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, check_float(name, getattr(self, name), -PENALTY_RANGE,
                                        PENALTY_RANGE))
        put(self, "repetition_penalty", check_float("repetition_penalty", self.repetition_penalty,
                                                    0.0, math.inf, low_open=True))
        put(self, "logit_bias", _check_bias(self.logit_bias))
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name, getattr(self, name))
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens="
                             f"{self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if isinstance(stop, bytes) or not isinstance(stop, Sequence):
            raise ValueError("stop must be a str or a sequence of str")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: {len(stop)} strings, at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty str")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: string {i} has {len(s)} characters, at most "
                                 f"{MAX_STOP_STRING_CHARS}")
        put(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError("stop_token_ids must be a sequence of ints")
        put(self, "stop_token_ids", tuple(check_int("stop_token_ids", t, 0) for t in ids))
        if self.logprobs is not None:
            n = check_int("logprobs", self.logprobs, 0)
            if n > MAX_LOGPROBS:
                raise ValueError(f"logprobs={n} must be <= {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty applies (the sampler then keeps token counts for the request)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def check_for_model(params: SamplingParams, vocab_size: int, has_tokenizer: bool) -> None:
    """What a `SamplingParams` cannot check alone: token ids inside the model's vocabulary, a
    tokenizer for stop strings. ValueError names the field."""
    for tok, _ in params.logit_bias:
        if tok >= vocab_size:
            raise ValueError(f"logit_bias: token id {tok} is outside the vocabulary "
                             f"({vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop: stop strings need a tokenizer, and this engine has none; "
                         "use stop_token_ids")


def _check_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs; keys may be ints or decimal strings (as
    JSON carries them). The vocabulary bound is the engine's to check."""
    if bias is None:
        return ()
    items = list(bias.items()) if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError("logit_bias must map token ids to numbers")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError("logit_bias must map token ids to numbers")
        key, value = pair
        if isinstance(key, str):
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            key = int(key)
        tok = check_int("logit_bias token id", key, 0)
        out[tok] = check_float(f"logit_bias[{tok}]", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
    return tuple(sorted(out.items()))
