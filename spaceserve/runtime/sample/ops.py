"""The tensor operations of sampling: counter-based noise, logits processing, log-probabilities.

Every function here is a short sequence of batched tensor ops with no host synchronisation, so
the whole batch is processed on the device in one go; `Sampler` (sampler.py) keeps the
per-request state they read. They are also the reference the engine is tested against.

Random draws come from a hash of (request seed, sequence index, vocab id), not from a
generator's state, so a request's tokens do not depend on which other requests share its
batch, on batch order, or on whether it was preempted and recomputed. A token is drawn by the
Gumbel-max trick: argmax(logits / temperature + Gumbel noise) samples softmax(logits /
temperature), and masked (-inf) entries are never drawn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

M32 = 0xFFFFFFFF
_GOLDEN = 0x61C88647  # 2**32 / phi, negated mod 2**32: odd and below 2**31
NEG_INF = float("-inf")


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 `x` in [0, 2**32) and a constant c < 2**31 (no overflow)."""
    return (x * c) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x68E31DA5)
    return x ^ (x >> 16)


def fold_seed(seed: int) -> int:
    """Fold any non-negative seed into 32 bits."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32) ^ 0x5BD1E995) & M32


_COLUMN_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """Per-vocab-id hash keys ``[vocab]`` (cached per vocabulary size and device)."""
    key = (vocab, str(device))
    keys = _COLUMN_KEYS.get(key)
    if keys is None:
        ids = torch.arange(vocab, device=device, dtype=torch.int64)
        keys = _COLUMN_KEYS[key] = mix32(mul32(ids, 0x2C1B3C6D) ^ 0x297A2D39)
    return keys


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row keys ``[B]`` from 32-bit folded seeds and the sequence index of the drawn token:
    distinct for every index of one seed (the golden multiplier is odd, so a bijection)."""
    return seeds ^ mul32(positions & M32, _GOLDEN)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[B, vocab]`` (fp32) from per-row keys (`row_keys`)."""
    h = mix32(keys[:, None] ^ column_keys(vocab, keys.device)[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return u.log_().neg_().log_().neg_()


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise ``[B, vocab]`` (fp32) of the same hash as `gumbel_noise` (for tests)."""
    h = mix32(row_keys(seeds, positions)[:, None] ^ column_keys(vocab, seeds.device)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def apply_penalties(x: torch.Tensor, counts: torch.Tensor | None,
                    rep_scale: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None, rep_mode: str = "where") -> torch.Tensor:
    """vLLM's penalties on fp32 logits ``[B, V]``.

    `rep_scale` ``[B, V]`` holds each row's repetition penalty at the tokens seen in its prompt
    or output and 1 elsewhere: a seen token's logit is divided by it when positive, multiplied
    by it when not (1 changes nothing, exactly). `rep_mode` "min" (every penalty >= 1) or
    "max" (every one <= 1) picks that case without a comparison; "where" compares. `counts`
    ``[B, V]`` (occurrences in the output) with `frequency` and `presence` ``[B, 1]``:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    if rep_scale is not None:
        down, up = x / rep_scale, x * rep_scale
        x = torch.minimum(down, up) if rep_mode == "min" else \
            torch.maximum(down, up) if rep_mode == "max" else torch.where(x > 0, down, up)
    if counts is not None and frequency is not None and presence is not None:
        x = x - counts * frequency - counts.clamp(max=1.0) * presence
    return x


def apply_min_p(x: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely one's:
    ``x - max(x) < log(min_p)`` on temperature-scaled logits (`log_min_p` ``[B, 1]``, -inf =
    off)."""
    return x.masked_fill(x < x.amax(dim=-1, keepdim=True) + log_min_p, NEG_INF)


def apply_top_k(x: torch.Tensor, kth: torch.Tensor, k_max: int,
                off: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's `k` largest logits (ties at the k-th kept). `kth` ``[B, 1]`` holds
    ``k - 1`` (an index below `k_max`); rows where `off` ``[B, 1]`` is true keep everything."""
    top = x.topk(k_max, dim=-1).values
    threshold = top.gather(1, kth)
    if off is not None:
        threshold = threshold.masked_fill(off, NEG_INF)
    return x.masked_fill(x < threshold, NEG_INF)


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` ``[B, 1]``
    (1: keep all)."""
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop = (before >= top_p) & (top_p < 1.0)
    return torch.empty_like(x).scatter_(-1, order, sorted_x.masked_fill(drop, NEG_INF))


def logprob_rows(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Raw log-probabilities of the sampled `ids` and the `k` most likely tokens, packed in one
    fp64 tensor ``[B, 3 + 2k]``: id, its logprob, its rank (1 = most likely), then the top-k
    logprobs and their ids (exact in fp64). From the logits before any processing."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, ids[:, None])
    rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1
    parts = [ids[:, None].double(), chosen.double(), rank.double()]
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    return torch.cat(parts, dim=1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, *, use_top_p: bool = True
           ) -> torch.Tensor:
    """Token ids ``[B]`` (int64) for logits ``[B, V]``; per-row temperature (0 = greedy), top_p,
    32-bit folded seed and sequence index of the token being drawn (all device tensors): the
    functional form of the sampler without penalties, top-k or min-p (a reference)."""
    greedy = logits.argmax(dim=-1)
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if use_top_p:
        scaled = apply_top_p(scaled, top_p[:, None])
    drawn = (scaled + gumbel_noise(row_keys(seeds, positions), logits.shape[-1])).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


def reference_next_token(logits: torch.Tensor, params: Any, seed: int, prompt: Sequence[int],
                         output: Sequence[int], eos: Sequence[int] = ()) -> int:
    """The token `params` (a SamplingParams) picks from one row of raw `logits` ``[V]``, given
    the request's `prompt` and `output` so far: a plain per-token restatement of the sampler
    (Python loops over the vocabulary ids involved), the reference it is tested against."""
    x = logits.detach().to("cpu", torch.float32).clone()
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    if len(output) < params.min_tokens:
        for t in stops:
            if t < x.shape[0]:
                x[t] = NEG_INF
    for t, b in params.logit_bias:
        x[t] = x[t] + b
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        for t in set(prompt) | set(output):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        x[t] = x[t] - params.frequency_penalty * c - params.presence_penalty
    if params.temperature == 0.0:
        return int(x.argmax())
    x = x / params.temperature
    if params.min_p > 0:
        p = x.softmax(dim=-1)
        x[p < params.min_p * p.max()] = NEG_INF
    if params.top_k > 0:
        kth = x.sort(descending=True).values[min(params.top_k, x.shape[0]) - 1]
        x[x < kth] = NEG_INF
    if params.top_p < 1.0:
        order = x.argsort(descending=True, stable=True)
        probs = x[order].softmax(dim=-1).tolist()
        mass = 0.0
        for rank, t in enumerate(order.tolist()):
            if rank and mass >= params.top_p:
                x[t] = NEG_INF
            mass += probs[rank]
    pos = torch.tensor([len(prompt) + len(output)])
    g = gumbel_noise(row_keys(torch.tensor([fold_seed(seed)]), pos), x.shape[0])[0]
    return int((x + g).argmax())


def reference_logprobs(logits: torch.Tensor, token: int, k: int
                       ) -> tuple[float, int, list[tuple[int, float]]]:
    """(logprob of `token`, its rank, the `k` most likely (id, logprob)) under the raw
    `logits` ``[V]``, in fp64: the reference for `logprob_rows`."""
    lp = logits.detach().double().log_softmax(dim=-1)
    rank = 1 + int((lp > lp[token]).sum())
    top = lp.topk(k) if k else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(),
                                            strict=True))
    return float(lp[token]), rank, pairs

