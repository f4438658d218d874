"""The step context: one object carrying a language-model step's metadata to every layer.

Flattened-batch layout
----------------------
A step runs ``B`` sequences as one flattened token batch of ``T`` tokens. Sequence ``i``
contributes its ``num_new_tokens[i]`` newest tokens, contiguous and in the order the caller
listed the sequences: a prefill chunk (many tokens) or a decode token (one). Its first
``num_cached_tokens[i]`` tokens are already in the paged KV cache; the step writes the new
tokens' K/V at the slots its block table gives and attends causally over cached + new tokens.
``cu_seqlens_q`` gives each sequence's token range, ``seq_lens[i] = cached + new``.

Logits are produced for the *last* token of each sequence whose ``need_logits[i]`` is true (a
prefill chunk that does not end its prompt needs none), in sequence order; ``logits_seqs``
says which sequence each returned row belongs to.

Placing all single-token sequences first lets a backend run them through its decode kernel and
only the rest through the prefill kernel (``num_decode_seqs`` counts that leading run); any
order is correct. For CUDA-graph capture, ``pad_seqs_to`` pads the batch with one-token padding
sequences (``seq_len`` 0, slot -1: nothing stored, output ignored) that also get logits rows,
at the end, so shapes stay fixed.

Layers receive the context explicitly (not through a global), so the encoder and decoder stages
can run in different threads at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .mrope import text_positions


@dataclass
class HostMeta:
    """Host copies of the step metadata (planning, checks and the torch backend read these)."""

    num_cached_tokens: list[int]
    num_new_tokens: list[int]
    seq_lens: list[int]
    cu_seqlens_q: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    logits_seqs: list[int]
    positions: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class StepContext:
    """Device tensors of one LM step, their host copies, and the attention backend's plan."""

    num_seqs: int
    num_tokens: int
    num_real_seqs: int
    num_decode_seqs: int
    block_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    positions: torch.Tensor  # [3, T] int64 (M-RoPE rows t, h, w)
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new (0 = padding)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [R] int64, flattened token index of each logits row
    host: HostMeta
    plan: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def copy_from(self, other: StepContext) -> None:
        """Copy `other`'s metadata into this context's tensors in place (same shapes), so a
        CUDA graph captured with this context replays `other`'s step; the plan is dropped."""
        for name in ("positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables",
                     "logits_indices"):
            dst, src = getattr(self, name), getattr(other, name)
            if dst.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)
        for name in ("num_seqs", "num_tokens", "num_real_seqs", "num_decode_seqs", "block_size",
                     "max_seqlen_q", "max_seqlen_k", "host"):
            setattr(self, name, getattr(other, name))


def _as_list(name: str, values: Sequence[Any] | None, n: int, default: Any) -> list[Any]:
    if values is None:
        return [default] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return values


def plan_step(
    num_cached_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    device: torch.device | str | None = None,
    mrope_positions: Sequence[torch.Tensor | None] | None = None,
    rope_deltas: Sequence[int] | None = None,
    need_logits: Sequence[bool] | None = None,
    pad_seqs_to: int | None = None,
    max_blocks_per_seq: int | None = None,
    backend: Any = None,
) -> StepContext:
    """Build the `StepContext` of one step on the host (see the module docstring for layout).

    Per sequence: `num_cached_tokens` already in the cache, `num_new_tokens` in this step,
    `block_tables` (KV block ids covering cached + new tokens). Positions: a prompt token at
    cache index ``p`` takes column ``p`` of `mrope_positions[i]` (the prompt's ``[3, L]``
    M-RoPE positions from `mrope_positions()`) when given and ``p < L``; any other token takes
    ``p + rope_deltas[i]`` on all three rows. `need_logits` defaults to all true. When
    `backend` is given its host-side plan is stored in ``ctx.plan``. No sequences with
    `pad_seqs_to` gives an all-padding step (to warm up and capture CUDA graphs). Raises
    ValueError on inconsistent inputs.
    """
    b = len(num_cached_tokens)
    if b == 0 and not pad_seqs_to:
        raise ValueError("num_cached_tokens: a step needs at least one sequence")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    cached = [int(c) for c in num_cached_tokens]
    new = [int(n) for n in _as_list("num_new_tokens", num_new_tokens, b, 0)]
    tables = [[int(x) for x in t] for t in _as_list("block_tables", block_tables, b, [])]
    mpos = _as_list("mrope_positions", mrope_positions, b, None)
    deltas = [int(d) for d in _as_list("rope_deltas", rope_deltas, b, 0)]
    want = [bool(w) for w in _as_list("need_logits", need_logits, b, True)]
    for i in range(b):
        if cached[i] < 0:
            raise ValueError(f"num_cached_tokens[{i}]={cached[i]} is negative")
        if new[i] < 1:
            raise ValueError(f"num_new_tokens[{i}]={new[i]} must be >= 1")
        need = -(-(cached[i] + new[i]) // block_size)
        if len(tables[i]) < need:
            raise ValueError(
                f"block_tables[{i}] has {len(tables[i])} blocks, {need} needed for "
                f"{cached[i] + new[i]} tokens of block size {block_size}"
            )
        if any(x < 0 for x in tables[i][:need]):
            raise ValueError(f"block_tables[{i}] holds a negative block id")
        if mpos[i] is not None and (mpos[i].dim() != 2 or mpos[i].shape[0] != 3):
            raise ValueError(f"mrope_positions[{i}] must be [3, L], got {tuple(mpos[i].shape)}")

    pad = 0
    if pad_seqs_to is not None:
        if pad_seqs_to < b:
            raise ValueError(f"pad_seqs_to={pad_seqs_to} is smaller than the batch ({b})")
        if any(n != 1 for n in new):
            raise ValueError("pad_seqs_to pads decode-only steps; num_new_tokens must all be 1")
        pad = pad_seqs_to - b
    width = max([len(t) for t in tables], default=1)
    if max_blocks_per_seq is not None:
        needed = max([-(-(c + n) // block_size) for c, n in zip(cached, new, strict=True)],
                     default=0)
        if max_blocks_per_seq < needed:
            raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} is too small")
        width = max_blocks_per_seq

    pos_parts: list[torch.Tensor] = []
    slot_parts: list[torch.Tensor] = []
    cu = [0]
    logits_idx: list[int] = []
    logits_seqs: list[int] = []
    for i in range(b):
        start, n = cached[i], new[i]
        idx = torch.arange(start, start + n, dtype=torch.long)
        table = torch.tensor(tables[i], dtype=torch.long)
        slot_parts.append(table[idx // block_size] * block_size + idx % block_size)
        p = mpos[i]
        if p is not None and start < p.shape[1]:
            stop = min(start + n, p.shape[1])
            piece = [p[:, start:stop].to(torch.long)]
            if stop < start + n:
                piece.append(text_positions(stop, start + n - stop, deltas[i]))
            pos_parts.append(torch.cat(piece, dim=1))
        else:
            pos_parts.append(text_positions(start, n, deltas[i]))
        cu.append(cu[-1] + n)
        if want[i]:
            logits_idx.append(cu[-1] - 1)
            logits_seqs.append(i)
    for j in range(pad):
        pos_parts.append(torch.zeros(3, 1, dtype=torch.long))
        slot_parts.append(torch.full((1,), -1, dtype=torch.long))
        cu.append(cu[-1] + 1)
        logits_idx.append(cu[-1] - 1)
        logits_seqs.append(b + j)
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)] + [0] * pad
    table_rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    table_rows += [[0] * width for _ in range(pad)]
    news = new + [1] * pad

    num_decode = 0
    while num_decode < len(news) and news[num_decode] == 1:
        num_decode += 1

    positions = torch.cat(pos_parts, dim=1).contiguous()
    slots = torch.cat(slot_parts).contiguous()
    host = HostMeta(
        num_cached_tokens=cached + [0] * pad,
        num_new_tokens=news,
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        block_tables=table_rows,
        logits_indices=logits_idx,
        logits_seqs=logits_seqs,
        positions=positions,
        slot_mapping=slots,
    )
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def put(t: torch.Tensor) -> torch.Tensor:
        if dev.type == "cpu":
            return t
        return t.pin_memory().to(dev, non_blocking=True)

    ctx = StepContext(
        num_seqs=b + pad,
        num_tokens=cu[-1],
        num_real_seqs=b,
        num_decode_seqs=num_decode,
        block_size=block_size,
        max_seqlen_q=max(news),
        max_seqlen_k=max(seq_lens),
        positions=put(positions),
        slot_mapping=put(slots),
        cu_seqlens_q=put(torch.tensor(cu, dtype=torch.int32)),
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=put(torch.tensor(table_rows, dtype=torch.int32).reshape(b + pad, width)),
        logits_indices=put(torch.tensor(logits_idx, dtype=torch.long)),
        host=host,
    )
    if backend is not None:
        ctx.plan = backend.plan(ctx)
    return ctx
