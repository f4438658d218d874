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

Planning
--------
`ContextPlanner` is the one planner: it owns preallocated buffers and per-row sequence state
(block table row, rope delta, prompt M-RoPE positions), builds a step with a few vectorised
numpy operations into a pinned staging buffer, and moves it to the device in two non-blocking
copies. Where a buffer lies depends only on the step's shape, so a CUDA graph captured on one
of its contexts replays every later context of that shape with no copy at all; the attention
backend's plan is refilled in place rather than rebuilt. `plan_step` is the functional form
(lists in, a context with buffers of its own out) over the same code. The pieces: the context
itself (`step_context.py`), the per-row sequence state (`step_rows.py`) and the device buffer
with its staging and per-shape views (`step_buffers.py`).

Layers receive the context explicitly (not through a global), so the encoder and decoder stages
can run in different threads at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from spaceserve.checks import require_int
from spaceserve.models.step.buffers import StepBuffers
from spaceserve.models.step.rows import SequenceRows, as_list, int_array
from spaceserve.models.step.step_context import HostMeta, StepContext

__all__ = ["ContextPlanner", "HostMeta", "StepContext", "plan_step"]
Tensor = torch.Tensor


class ContextPlanner:
    """Plans LM steps into preallocated buffers (see the module docstring's Planning).

    Capacities: `max_num_seqs` sequences (padding included), `max_num_tokens` tokens, block
    tables `max_blocks_per_seq` wide. A step names, per sequence, a *row* of the planner's
    `SequenceRows` state: ``table[row]`` (block ids, written by the caller as blocks are
    allocated; ids past a sequence's length may be stale but must be valid, so the torch
    backend can gather them), and the rope delta and prompt M-RoPE positions `set_row` records.
    `backend` (an attention backend) gets its plan refilled per step unless
    ``plan_attention=False``.

    A context's tensors are views of the planner's `StepBuffers`, valid until the next `plan`,
    whose copy is ordered after the work of the stream that planned last. When `staged`
    (default: on a GPU) the host side alternates between `staging` (pinned) buffers, each
    rewritten only after the copy that last read it has completed. Stages that run steps at
    the same time on different streams need a planner each; ``rows=`` another planner shares
    its row state (tables, rope state) so either can plan any sequence.
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, *, device: torch.device | str | None = None,
                 backend: Any = None, staging: int = 2, staged: bool | None = None,
                 rows: ContextPlanner | None = None) -> None:
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_tokens", max_num_tokens),
                        ("max_blocks_per_seq", max_blocks_per_seq), ("block_size", block_size),
                        ("staging", staging)):
            require_int(name, v)
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device if device is not None else "cpu")
        self.backend = backend
        s, t, w = max_num_seqs, self.max_num_tokens, max_blocks_per_seq
        if rows is not None:
            if (rows.max_num_seqs, rows.max_blocks_per_seq) != (s, w):
                raise ValueError("rows: a planner with other max_num_seqs / max_blocks_per_seq")
            self.row_state = rows.row_state
        else:
            self.row_state = SequenceRows(s, w)
        st = self.row_state
        self.table, self.rope_delta = st.table, st.rope_delta
        self.prompt_len, self.prompt_positions = st.prompt_len, st.prompt_positions
        self._arange = np.arange(t + 2, dtype=np.int64)
        self.buffers = StepBuffers(s, t, w, self.device, staging=staging, staged=staged)
        self._serial = 0
        self.attention_plan: Any = None
        self._decode_memo: dict[Any, Any] = {}  # what `decode_plan.plan_decode` left in place

    def set_row(self, row: int, block_ids: Sequence[int] | None = None, *, rope_delta: int = 0,
                mrope_positions: Tensor | np.ndarray | None = None) -> None:
        """Give `row` to a sequence: its first block ids (when given), its rope delta, and its
        prompt's ``[3, L]`` M-RoPE positions (None: positions are index + delta)."""
        self.row_state.set_row(row, block_ids, rope_delta=rope_delta,
                               mrope_positions=mrope_positions)

    def plan(self, rows: Sequence[int] | np.ndarray, num_cached_tokens: Sequence[int] | np.ndarray,
             num_new_tokens: Sequence[int] | np.ndarray, *,
             need_logits: Sequence[bool] | None = None,
             input_ids: Sequence[int] | np.ndarray | None = None,
             pad_seqs_to: int | None = None, width: int | None = None,
             copy_width: int | None = None, plan_attention: bool = True) -> StepContext:
        """The context of one step over the sequences in `rows` (layout: module docstring).

        `input_ids` (the step's flattened token ids) go into ``ctx.input_ids``. `width` is the
        block tables' width (default: what the longest sequence needs; a CUDA graph's fixed
        width otherwise); `copy_width` how many leading columns of each row are refreshed from
        ``table`` (default: the needed ones). Raises ValueError on inconsistent inputs.
        """
        rows = int_array("rows", rows)
        b = rows.size
        cached = int_array("num_cached_tokens", num_cached_tokens, b)
        new = int_array("num_new_tokens", num_new_tokens, b)
        pad = 0 if pad_seqs_to is None else int(pad_seqs_to) - b
        if pad < 0:
            raise ValueError(f"pad_seqs_to={pad_seqs_to} is smaller than the batch ({b})")
        nseq = b + pad
        if nseq == 0:
            raise ValueError("num_cached_tokens: a step needs at least one sequence")
        if nseq > self.max_num_seqs:
            raise ValueError(f"rows: {nseq} sequences exceed max_num_seqs={self.max_num_seqs}")
        if b:
            if rows.min() < 0 or rows.max() >= self.max_num_seqs:
                raise ValueError(f"rows must lie in 0..{self.max_num_seqs - 1}")
            if cached.min() < 0:
                i = int(np.argmax(cached < 0))
                raise ValueError(f"num_cached_tokens[{i}]={cached[i]} is negative")
            if new.min() < 1:
                i = int(np.argmax(new < 1))
                raise ValueError(f"num_new_tokens[{i}]={new[i]} must be >= 1")
        lens = cached + new
        t_real = int(new.sum())
        ntok = t_real + pad
        if pad and t_real != b:
            raise ValueError("pad_seqs_to pads decode-only steps; num_new_tokens must all be 1")
        if ntok > self.max_num_tokens:
            raise ValueError(f"num_new_tokens: {ntok} tokens exceed max_num_tokens="
                             f"{self.max_num_tokens}")
        bs = self.block_size
        max_len = int(lens.max()) if b else 0
        need_w = -(-max_len // bs)
        width = max(need_w, 1) if width is None else int(width)
        if not need_w <= width <= self.max_blocks_per_seq:
            raise ValueError(f"width={width} must cover the {need_w} blocks needed and be <= "
                             f"max_blocks_per_seq={self.max_blocks_per_seq}")
        if need_logits is None:
            sel, nlog = None, b
        else:
            want = np.array(need_logits, dtype=bool, ndmin=1)
            if want.size != b:
                raise ValueError(f"need_logits has {want.size} entries for {b} sequences")
            sel = np.flatnonzero(want)
            nlog = sel.size
        if input_ids is not None and len(input_ids) != t_real:
            raise ValueError(f"input_ids has {len(input_ids)} tokens, the step {t_real}")

        self._decode_memo.clear()  # this step rewrites what decode steps could keep
        views = self.buffers.begin(ntok, nlog + pad, nseq, width)
        ids, pos, slot, lidx, lseq, cu, seq_lens, bt = views.host
        hpos, hslot, dv = views.host_positions, views.host_slots, views.device
        ar = self._arange
        cu64 = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(new, out=cu64[1:])
        cu[:b + 1] = cu64
        cu[b + 1:] = ar[t_real + 1:ntok + 1]
        if t_real == b:  # one token per sequence
            p, trow = cached, rows
        else:
            p = ar[:t_real] + np.repeat(cached - cu64[:b], new)
            trow = np.repeat(rows, new)
        if input_ids is not None:
            ids[:t_real] = input_ids
        ids[t_real:] = 0
        pos[:, :t_real] = p + self.rope_delta[trow]
        pos[:, t_real:] = 0
        plen = self.prompt_len[rows]
        for i in np.flatnonzero(cached < plen).tolist():  # chunks inside an M-RoPE prompt
            c, st = int(cached[i]), int(cu64[i])
            k = min(int(new[i]), int(plen[i]) - c)
            pos[:, st:st + k] = self.prompt_positions[int(rows[i])][:, c:c + k]
        slot[:t_real] = self.table[trow, p // bs].astype(np.int64) * bs + p % bs
        slot[t_real:] = -1
        seq_lens[:b] = lens
        seq_lens[b:] = 0
        if sel is None:
            lidx[:b] = cu64[1:] - 1
            lseq[:b] = ar[:b]
        else:
            lidx[:nlog] = cu64[1:][sel] - 1
            lseq[:nlog] = sel
        lidx[nlog:] = ar[t_real:ntok]
        lseq[nlog:] = ar[b:nseq]
        cw = need_w if copy_width is None else min(int(copy_width), width)
        if cw:
            bt[:b, :cw] = self.table[rows, :cw]
            bt[b:, :cw] = 0
        self.buffers.upload(views)
        meta = HostMeta(
            num_cached_tokens=np.concatenate([cached, np.zeros(pad, np.int64)]) if pad else cached,
            num_new_tokens=np.concatenate([new, np.ones(pad, np.int64)]) if pad else new,
            seq_lens=seq_lens, cu_seqlens_q=cu, block_tables=bt, logits_indices=lidx,
            logits_seqs=lseq, positions=hpos, slot_mapping=hslot,
            input_ids=ids if input_ids is not None or not t_real else None)
        ctx = StepContext(
            num_seqs=nseq, num_tokens=ntok, num_real_seqs=b,
            num_decode_seqs=nseq if t_real == b else int(np.argmax(new != 1)),
            block_size=bs, max_seqlen_q=1 if t_real == b else int(new.max()),
            max_seqlen_k=max_len,
            positions=dv[1], slot_mapping=dv[2], cu_seqlens_q=dv[5], seq_lens=dv[6],
            block_tables=dv[7], logits_indices=dv[3], host=meta,
            input_ids=dv[0] if meta.input_ids is not None else None, logits_seqs=dv[4])
        self._serial += 1
        ctx.extras["planned"] = (self, self._serial)
        if self.backend is not None and plan_attention:
            self.attention_plan = ctx.plan = self.backend.replan(self.attention_plan, ctx)
        return ctx

    def is_current(self, ctx: StepContext) -> bool:
        """Whether `ctx` is this planner's latest step (its buffers still hold that step)."""
        return ctx.extras.get("planned") == (self, self._serial)

    def load_rows(self, num_cached_tokens: Sequence[int], num_new_tokens: Sequence[int],
                  block_tables: Sequence[Sequence[int]], *, width: int,
                  rope_deltas: Sequence[int] | None = None,
                  mrope_positions: Sequence[Any] | None = None) -> None:
        """Put explicit per-sequence tables (and rope state) into rows ``0..B-1``, checking
        that each covers its cached + new tokens with non-negative block ids."""
        self.row_state.load(num_cached_tokens, num_new_tokens, block_tables, width=width,
                            block_size=self.block_size, rope_deltas=rope_deltas,
                            mrope_positions=mrope_positions)


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
    input_ids: Sequence[int] | None = None,
) -> StepContext:
    """Build the `StepContext` of one step (see the module docstring for layout), in buffers of
    its own (a `ContextPlanner` sized for this step alone).

    Per sequence: `num_cached_tokens` already in the cache, `num_new_tokens` in this step,
    `block_tables` (KV block ids covering cached + new tokens). Positions: a prompt token at
    cache index ``p`` takes column ``p`` of `mrope_positions[i]` (the prompt's ``[3, L]``
    M-RoPE positions from `mrope_positions()`) when given and ``p < L``; any other token takes
    ``p + rope_deltas[i]`` on all three rows. `need_logits` defaults to all true. When
    `backend` is given its host-side plan is stored in ``ctx.plan``; `input_ids` fill
    ``ctx.input_ids``. No sequences with `pad_seqs_to` gives an all-padding step (to warm up
    and capture CUDA graphs). Raises ValueError on inconsistent inputs.
    """
    b = len(num_cached_tokens)
    if b == 0 and not pad_seqs_to:
        raise ValueError("num_cached_tokens: a step needs at least one sequence")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    cached = int_array("num_cached_tokens", num_cached_tokens)
    new = int_array("num_new_tokens", num_new_tokens, b)
    tables = as_list("block_tables", block_tables, b, [])
    nseq = b if pad_seqs_to is None else int(pad_seqs_to)
    width = max([len(t) for t in tables], default=1) or 1
    if max_blocks_per_seq is not None:
        needed = int((-(-(cached + new) // block_size)).max()) if b else 0
        if max_blocks_per_seq < needed:
            raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} is too small")
        width = max_blocks_per_seq
    ntok = int(new.sum()) + max(nseq - b, 0)
    planner = ContextPlanner(max(nseq, b, 1), max(ntok, 1), width, block_size, device=device,
                             backend=backend, staging=1)
    planner.load_rows(cached, new, tables, width=width, rope_deltas=rope_deltas,
                      mrope_positions=mrope_positions)
    return planner.plan(planner._arange[:b], cached, new, need_logits=need_logits,
                        input_ids=input_ids, pad_seqs_to=pad_seqs_to, width=width,
                        copy_width=width)
