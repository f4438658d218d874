"""Where a planned step's metadata lives: one device buffer, pinned staging, per-shape views.

All metadata of a step sits in a single int64 device buffer: token ids, the three M-RoPE
position rows, the slot mapping, the logits indices and their sequences (int64), then
``cu_seqlens_q`` and ``seq_lens`` (int32) and, at a fixed offset, the block tables (int32).
Every view is cut at offsets that depend only on the step's shape (tokens, logits rows,
sequences, table width), so a CUDA graph captured on one step's views replays every later step
of that shape. The host fills numpy views of a staging buffer and `upload` moves the step with
two non-blocking copies: the leading metadata and the block-table region.

With staging (default on a GPU) the host side alternates between ``staging`` pinned buffers,
each rewritten only after the copy that last read it has completed, and a plan on a new stream
waits for the last planning stream's kernels, which read the device buffer. Without staging
(CPU) the host views are the device buffer itself and nothing is copied.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class StepViews(NamedTuple):
    """Views of one step shape: host numpy views (ids, positions [3, T], slots, logits indices,
    logits sequences, cu_seqlens_q, seq_lens, block tables [B, width]), host positions and slot
    tensors, the device views of the same fields, and the word counts `upload` copies."""

    turn: int
    host: tuple[Any, ...]
    host_positions: torch.Tensor
    host_slots: torch.Tensor
    device: tuple[torch.Tensor, ...]
    words: int
    table_words: int


class StepBuffers:
    """The device buffer and staging of a planner with capacities `max_num_seqs` sequences,
    `max_num_tokens` tokens and block tables `max_blocks_per_seq` wide (see the module
    docstring). `staged` None stages on CUDA only."""

    MAX_CACHED_SHAPES = 512

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 device: torch.device, *, staging: int = 2, staged: bool | None = None) -> None:
        s, t, w = max_num_seqs, max_num_tokens, max_blocks_per_seq
        self._base_bt = 5 * t + 3 * s + 1  # int64 words before the block-table region
        words = self._base_bt + (s * w + 1) // 2
        cuda = device.type == "cuda"
        self.staged = cuda if staged is None else bool(staged)
        self.dev = torch.zeros(words, dtype=torch.int64, device=device)
        self.device = self.dev.device
        self._host = [self.dev]
        self._events: list[Any] = []
        if self.staged:
            self._host = [torch.zeros(words, dtype=torch.int64, pin_memory=cuda)
                          for _ in range(staging)]
            self._events = [torch.cuda.Event() for _ in range(staging)] if cuda else []
        self._turn = 0
        self._stream: Any = None
        self._views: dict[tuple[int, ...], StepViews] = {}

    def begin(self, t: int, r: int, b: int, width: int) -> StepViews:
        """The views for a step of `t` tokens, `r` logits rows, `b` sequences and block tables
        `width` wide, on the next staging buffer once it is free to rewrite."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._host)
        if self._events:
            self._events[turn].synchronize()  # the copy that last read this staging buffer
            stream = torch.cuda.current_stream(self.device)
            if self._stream is not None and stream != self._stream:
                stream.wait_stream(self._stream)  # the last step's kernels read the buffer
            self._stream = stream
        return self._layout(turn, t, r, b, width)

    def upload(self, views: StepViews) -> None:
        """Copy a filled step to the device (staged only; two non-blocking copies)."""
        if not self.staged:
            return
        host, base = self._host[views.turn], self._base_bt
        self.dev[:views.words].copy_(host[:views.words], non_blocking=True)
        self.dev[base:base + views.table_words].copy_(host[base:base + views.table_words],
                                                      non_blocking=True)
        if self._events:
            self._events[views.turn].record()

    def _layout(self, turn: int, t: int, r: int, b: int, width: int) -> StepViews:
        key = (turn, t, r, b, width)
        views = self._views.get(key)
        if views is not None:
            return views
        if len(self._views) > self.MAX_CACHED_SHAPES:
            self._views.clear()
        o32 = 2 * (5 * t + 2 * r)
        bt0 = 2 * self._base_bt

        def cut(buf: Any, as32: Any) -> tuple[Any, ...]:
            return (buf[:t], buf[t:4 * t].reshape(3, t), buf[4 * t:5 * t],
                    buf[5 * t:5 * t + r], buf[5 * t + r:5 * t + 2 * r],
                    as32[o32:o32 + b + 1], as32[o32 + b + 1:o32 + 2 * b + 1],
                    as32[bt0:bt0 + b * width].reshape(b, width))

        hnp = self._host[turn].numpy()
        hv = cut(hnp, hnp.view(np.int32))
        dv = cut(self.dev, self.dev.view(torch.int32))
        hpos, hslot = (dv[1], dv[2]) if not self.staged else (torch.from_numpy(hv[1]),
                                                             torch.from_numpy(hv[2]))
        views = StepViews(turn, hv, hpos, hslot, dv, 5 * t + 2 * r + b + 1, (b * width + 1) // 2)
        self._views[key] = views
        return views
