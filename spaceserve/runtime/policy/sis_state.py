"""What SIS observes each scheduling round: waiting encoder jobs, prompts to prefill, the decode
load and the image arrivals (built by the engine's spatial runtime and by the simulator)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingEncode:
    """An encoder job: its batch's ViT tokens, layers left and its requests' prompt tokens,
    how long its oldest request has waited and how many requests it carries."""

    patches: int
    layers_left: int
    prefill_tokens: int = 0
    age_s: float = 0.0
    requests: int = 1


@dataclass(frozen=True)
class SisState:
    """What SIS observes each round."""

    encode: Sequence[PendingEncode] = ()
    prefill: Sequence[int] = ()  # prompt tokens of requests whose embeddings are ready
    decode_batch: int = 0
    decode_context: float = 0.0  # mean tokens in each decoding request's KV cache
    prefill_age_s: Sequence[float] = ()  # how long each `prefill` request has waited
    arrival_rate: float = 0.0  # images/s over the last couple of seconds
    arrival_patches: float = 0.0  # their mean ViT patches
    arrival_prompt: float = 0.0  # their mean prompt tokens
