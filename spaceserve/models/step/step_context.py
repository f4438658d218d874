"""What one language-model step carries to every layer: `StepContext` and its `HostMeta`.

The layout (flattened batch, padding, logits rows) is described in `context.py`, whose
`ContextPlanner` fills these objects; layers and attention backends only read them. A planner's
contexts are views of its buffers, so two same-shaped steps share memory (`shares_buffers`) and
a CUDA graph captured on one replays the other; `copy_from` moves a foreign step into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_BUFFERS = ("positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables",
            "logits_indices")


@dataclass
class HostMeta:
    """Host copies of the step metadata, as numpy arrays (``positions`` and ``slot_mapping``
    as CPU tensors); the torch backend and the attention plans read these. A planner's copies
    are views of its buffers, valid until its next plan."""

    num_cached_tokens: np.ndarray  # [B] int64
    num_new_tokens: np.ndarray  # [B] int64
    seq_lens: np.ndarray  # [B] int32
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    block_tables: np.ndarray  # [B, width] int32
    logits_indices: np.ndarray  # [R] int64
    logits_seqs: np.ndarray  # [R] int64
    positions: torch.Tensor  # [3, T] int64
    slot_mapping: torch.Tensor  # [T] int64
    input_ids: np.ndarray | None = None  # [T] int64 when the step was given its token ids


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
    block_tables: torch.Tensor  # [B, width] int32
    logits_indices: torch.Tensor  # [R] int64, flattened token index of each logits row
    host: HostMeta
    plan: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
    input_ids: torch.Tensor | None = None  # [T] int64 (padding tokens 0) when planned with ids
    logits_seqs: torch.Tensor | None = None  # [R] int64, sequence of each logits row

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def shares_buffers(self, other: StepContext) -> bool:
        """Whether `other`'s metadata tensors are this context's (same memory and shapes), as
        for two same-shaped steps of one planner: nothing to copy between them."""
        for name in _BUFFERS:
            a, b = getattr(self, name), getattr(other, name)
            if a.data_ptr() != b.data_ptr() or a.shape != b.shape or a.stride() != b.stride():
                return False
        return True

    def copy_from(self, other: StepContext) -> None:
        """Copy `other`'s metadata into this context's tensors in place (same shapes), so a
        CUDA graph captured with this context replays `other`'s step; the plan is kept."""
        for name in _BUFFERS:
            dst, src = getattr(self, name), getattr(other, name)
            if dst.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)
        for name in ("num_seqs", "num_tokens", "num_real_seqs", "num_decode_seqs", "block_size",
                     "max_seqlen_q", "max_seqlen_k", "host"):
            setattr(self, name, getattr(other, name))
