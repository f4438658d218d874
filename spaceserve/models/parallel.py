"""Tensor parallelism inside the models: which slice of every weight a rank holds, and the two
collectives the decoder needs.

Megatron-style split of the Qwen2-VL decoder over ``size`` ranks:
- Q/K/V and gate/up projections are *column-parallel*: rank r holds the output rows of its
  query heads, of its KV heads and of its share of the MLP's intermediate width, so attention
  and the gated MLP run on local heads / columns with no communication;
- o_proj and down_proj are *row-parallel*: rank r holds the input columns matching those heads
  / that width, each rank's product is a partial sum, and one all-reduce per projection gives
  every rank the full hidden state;
- embedding and LM head are *vocabulary-parallel*: rank r holds rows ``[r * V_r, (r + 1) *
  V_r)`` (``V_r = ceil(V / size)``; the last shard is zero-padded); an embedding lookup is local
  with the other ranks' tokens zeroed, then all-reduced; the logits shards are all-gathered.
- Query heads split evenly (``heads % size == 0``). KV heads split evenly when ``kv_heads %
  size == 0``; with fewer KV heads than ranks (``size % kv_heads == 0``) each KV head is
  *replicated* on ``size / kv_heads`` consecutive ranks, whose query heads all read it.
- Norms, biases of row-parallel layers (Qwen2 has none) and the vision tower are replicated.

The collectives go through a `Communicator` (rank, size, in-place `all_reduce`, `all_gather`
along dim 0, and `broadcast`, with which the runtime shares a data-parallel encoder's image
embeddings); the runtime supplies one over torch.distributed. Each collective takes the SM
budget of the stage issuing it (``num_sms``, as every kernel does; None: the whole device), so a
communicator can account the SMs it runs on. The models never create processes or groups.
`SingleRank` is the no-op communicator of an unsplit model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

Tensor = torch.Tensor


class Communicator(Protocol):
    """The collectives a tensor-parallel model issues (every rank calls them in the same order).
    Implementations must be capturable in a CUDA graph on GPU (no host sync, in place)."""

    rank: int
    size: int

    def all_reduce(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        ...

    def all_gather(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        """``[n, ...]`` on each rank -> ``[size * n, ...]``, rank 0's rows first."""
        ...

    def broadcast(self, x: Tensor, src: int, *, num_sms: int | None = None) -> Tensor:
        """Rank `src`'s `x` into `x` on every rank, in place; returns `x`."""
        ...


class SingleRank:
    """The communicator of a model that is not split: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        return x

    def all_gather(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        return x

    def broadcast(self, x: Tensor, src: int, *, num_sms: int | None = None) -> Tensor:
        return x


class Unconnected:
    """The communicator of a shard built without one (to inspect or count its weights): any
    collective raises."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def _fail(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        raise RuntimeError(f"rank {self.rank} of a tensor-parallel group of {self.size} was "
                           "built without a communicator: it cannot run a step")

    all_reduce = all_gather = broadcast = _fail


def _check_rank(rank: int, size: int) -> None:
    for name, value in (("rank", rank), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"tensor-parallel {name}={value!r} must be an int")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank={rank} must lie in 0..size-1 (size={size})")


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads ``[q_start, q_start + q_heads)`` and KV heads
    ``[kv_start, kv_start + kv_heads)`` of the model's, and how many ranks share each KV head."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    kv_replicas: int


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group of `size` ranks (see the module docstring)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        _check_rank(self.rank, self.size)

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        """The split of `num_heads` query / `num_kv_heads` KV heads; ValueError when the head
        counts do not divide over the group."""
        n = self.size
        if num_heads % n:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by "
                             f"tensor_parallel_size={n}")
        if num_kv_heads % n == 0:
            per = num_kv_heads // n
            return HeadSplit(self.rank * num_heads // n, num_heads // n, self.rank * per, per, 1)
        if n % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={n}: "
                             "one must divide the other (KV heads are split, or replicated "
                             "when there are fewer than ranks)")
        reps = n // num_kv_heads
        return HeadSplit(self.rank * num_heads // n, num_heads // n, self.rank // reps, 1, reps)

    def even(self, total: int, what: str) -> tuple[int, int]:
        """``[start, end)`` of this rank's equal share of `total` (ValueError naming `what`)."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size="
                             f"{self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, end, padded shard rows) of this rank's vocabulary shard; ``end - start`` is
        smaller than the padded rows on a last shard that runs past the vocabulary."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return start, min(start + per, vocab_size), per


def text_shard(name: str, shape: tuple[int, ...], text_config: Any, tp: TensorParallel
               ) -> tuple[slice, ...] | None:
    """The slice of language-model tensor `name` (internal name without the ``language.``
    prefix, or ``lm_head.weight``) that rank `tp` holds; None when it holds all of it."""
    if tp.size == 1:
        return None
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end, _ = tp.vocab(shape[0])
        return (slice(start, end),)
    if not name.startswith("layers."):
        return None
    h = int(text_config.hidden_size)
    nq = int(text_config.num_attention_heads)
    nkv = int(text_config.num_key_value_heads or nq)
    d = int(getattr(text_config, "head_dim", None) or h // nq)
    split = tp.heads(nq, nkv)
    q = slice(split.q_start * d, (split.q_start + split.q_heads) * d)
    kv = slice(split.kv_start * d, (split.kv_start + split.kv_heads) * d)
    leaf = name.split(".", 2)[2]
    if leaf.startswith("self_attn.q_proj."):
        return (q,)
    if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return (kv,)
    if leaf == "self_attn.o_proj.weight":
        return (slice(None), q)
    if leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return (slice(*tp.even(int(text_config.intermediate_size), "intermediate_size")),)
    if leaf == "mlp.down_proj.weight":
        return (slice(None), slice(*tp.even(int(text_config.intermediate_size),
                                           "intermediate_size")))
    return None


def check_text_config(text_config: Any, tp: TensorParallel) -> None:
    """ValueError, naming the field, when the decoder cannot be split over `tp.size` ranks."""
    nq = int(text_config.num_attention_heads)
    tp.heads(nq, int(text_config.num_key_value_heads or nq))
    tp.even(int(text_config.intermediate_size), "intermediate_size")
