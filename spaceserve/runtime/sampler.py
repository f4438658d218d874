"""Batched token sampling on the device, reproducible per request.

Random draws come from a counter-based hash of (request seed, sequence index, vocab id), not
from a generator's state, so a request's tokens do not depend on which other requests share its
batch, on batch order, or on whether it was preempted and recomputed. Sampling is the Gumbel-max
trick over temperature-scaled, top-p-filtered logits; temperature 0 rows take the argmax. The
whole batch is one short sequence of tensor ops; the caller makes the step's only device-to-host
transfer when it reads the sampled ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import Request

M32 = 0xFFFFFFFF
_GOLDEN = 0x61C88647  # 2**32 / phi, negated mod 2**32: odd and below 2**31


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


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise ``[B, vocab]`` (fp32) from per-row 32-bit seeds and sequence indices."""
    row = mix32(seeds ^ mix32(mul32(positions & M32, _GOLDEN) ^ 0x2545F491))
    h = mix32(row[:, None] ^ column_keys(vocab, seeds.device)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    use_top_p: bool = True,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64) for logits ``[B, V]``; per-row temperature (0 = greedy),
    top_p, 32-bit seed and sequence index of the token being drawn (all device tensors)."""
    greedy = logits.argmax(dim=-1)
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top_p 1: keep all
        scaled = torch.empty_like(scaled).scatter_(
            -1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    u = uniform_noise(seeds, positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


class Sampler:
    """Samples one token per logits row for the requests of a step."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Row ``i`` of `logits` belongs to ``reqs[i]`` and draws the token at sequence index
        ``len(reqs[i].token_ids)``. Returns int64 ids on the device."""
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(reqs)} rows")
        temps = [r.params.temperature for r in reqs]
        if not any(temps):
            return logits.argmax(dim=-1)
        top_ps = [r.params.top_p for r in reqs]
        meta = torch.tensor(
            [[fold_seed(r.seed) for r in reqs], [len(r.token_ids) for r in reqs]],
            dtype=torch.int64,
        )
        fmeta = torch.tensor([temps, top_ps], dtype=torch.float32)
        if self.device.type != "cpu":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
            fmeta = fmeta.pin_memory().to(self.device, non_blocking=True)
        return sample(logits, fmeta[0], fmeta[1], meta[0], meta[1],
                      use_top_p=any(p < 1.0 for p in top_ps))
