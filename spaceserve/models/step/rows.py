"""Per-sequence state a planner keeps between steps, one *row* per running sequence.

A row holds the sequence's block table (``table[row]``: block ids, written as blocks are
allocated; ids past the sequence's length may be stale but must be valid, so the torch backend
can gather them), its rope delta, and its prompt's ``[3, L]`` M-RoPE positions. Steps then name
rows instead of passing tables and positions again. Two planners that run steps on different
streams share one `SequenceRows`, so either can plan any sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def int_array(name: str, values: Any, n: int | None = None) -> np.ndarray:
    """A fresh 1-D int64 array of host values; ValueError naming `name` on a wrong length."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    out = np.array(values, dtype=np.int64, ndmin=1)
    if out.ndim != 1 or (n is not None and out.size != n):
        raise ValueError(f"{name} has {out.size} entries for {n} sequences")
    return out


def as_list(name: str, values: Sequence[Any] | None, n: int, default: Any) -> list[Any]:
    """`values` as a list of `n` entries (`default` each when None); ValueError otherwise."""
    if values is None:
        return [default] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return values


class SequenceRows:
    """Block tables ``[max_num_seqs, max_blocks_per_seq]`` and rope state per row."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        s, w = max_num_seqs, max_blocks_per_seq
        self.max_num_seqs, self.max_blocks_per_seq = s, w
        self.table = np.zeros((s, w), dtype=np.int32)
        self.rope_delta = np.zeros(s, dtype=np.int64)
        self.prompt_len = np.zeros(s, dtype=np.int64)
        self.prompt_positions: list[np.ndarray | None] = [None] * s

    def set_row(self, row: int, block_ids: Sequence[int] | None = None, *, rope_delta: int = 0,
                mrope_positions: torch.Tensor | np.ndarray | None = None) -> None:
        """Give `row` to a sequence: its first block ids (when given), its rope delta, and its
        prompt's ``[3, L]`` M-RoPE positions (None: positions are index + delta)."""
        if not 0 <= row < self.max_num_seqs:
            raise ValueError(f"row={row} is outside 0..{self.max_num_seqs - 1}")
        if block_ids is not None:
            n = len(block_ids)
            if n > self.max_blocks_per_seq:
                raise ValueError(f"block_ids has {n} blocks > max_blocks_per_seq="
                                 f"{self.max_blocks_per_seq}")
            self.table[row, :n] = block_ids
        self.rope_delta[row] = rope_delta
        if mrope_positions is None:
            self.prompt_positions[row], self.prompt_len[row] = None, 0
            return
        p = mrope_positions
        arr = p.detach().cpu().numpy() if isinstance(p, torch.Tensor) else np.asarray(p)
        if arr.ndim != 2 or arr.shape[0] != 3:
            raise ValueError(f"mrope_positions must be [3, L], got {tuple(arr.shape)}")
        self.prompt_positions[row] = arr.astype(np.int64, copy=False)
        self.prompt_len[row] = arr.shape[1]

    def load(self, num_cached_tokens: Sequence[int], num_new_tokens: Sequence[int],
             block_tables: Sequence[Sequence[int]], *, width: int, block_size: int,
             rope_deltas: Sequence[int] | None = None,
             mrope_positions: Sequence[Any] | None = None) -> None:
        """Put explicit per-sequence tables (and rope state) into rows ``0..B-1``, checking
        that each covers its cached + new tokens (`block_size` per block) with non-negative
        block ids."""
        b = len(num_cached_tokens)
        tables = as_list("block_tables", block_tables, b, [])
        deltas = int_array("rope_deltas", rope_deltas if rope_deltas is not None else [0] * b, b)
        mpos = as_list("mrope_positions", mrope_positions, b, None)
        if b > self.max_num_seqs:
            raise ValueError(f"{b} sequences exceed max_num_seqs={self.max_num_seqs}")
        cached = np.maximum(int_array("num_cached_tokens", num_cached_tokens), 0)
        new = np.maximum(int_array("num_new_tokens", num_new_tokens, b), 0)
        pages = -(-(cached + new) // block_size)
        for i, t in enumerate(tables):
            n = len(t)
            if n < pages[i]:
                raise ValueError(f"block_tables[{i}] has {n} blocks, {pages[i]} needed for "
                                 f"{cached[i] + new[i]} tokens of block size {block_size}")
            if n:
                self.table[i, :min(n, width)] = t[:width]
        used = self.table[:b, :width] < 0
        used &= np.arange(width)[None, :] < pages[:, None]
        if used.any():
            raise ValueError(f"block_tables[{int(np.argmax(used.any(1)))}] holds a negative "
                             "block id")
        for i in range(b):
            try:
                self.set_row(i, rope_delta=int(deltas[i]), mrope_positions=mpos[i])
            except ValueError as err:
                raise ValueError(f"mrope_positions[{i}]: {err}") from None
