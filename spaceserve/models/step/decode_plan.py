"""The decode-only step of a `ContextPlanner`, planned from what changed since the last one.

Most steps of a serving engine are pure decode over a batch that keeps its sequences from one
step to the next: every sequence adds one token, so only the positions, slots and lengths move.
`plan_decode` writes a decode step into the same buffers and layout as `ContextPlanner.plan`
(the contexts are interchangeable; a CUDA graph captured on either replays both) but skips what
each staging buffer already holds: the shape-only fields (``cu_seqlens_q``, logits rows) when
the shape repeats, and of the block tables all but the rows that changed since that buffer was
last written (the caller names them). The caller vouches for its inputs (valid rows, one new
token each): it is the runtime's planner, which built them; `ContextPlanner.plan` stays the
checked general path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spaceserve.models.step.step_context import HostMeta, StepContext

if TYPE_CHECKING:
    from spaceserve.models.step.context import ContextPlanner


def plan_decode(planner: ContextPlanner, rows: np.ndarray, cached: np.ndarray, *,
                input_ids: Any = None, pad_seqs_to: int | None = None,
                width: int | None = None, plan_attention: bool = True,
                rows_key: Any = None, changed: Sequence[int] | None = None) -> StepContext:
    """The context of a decode-only step: sequence ``i`` (planner row ``rows[i]``, int64
    arrays) has ``cached[i]`` tokens cached and computes one more. `input_ids` (None: leave
    the host ids as they are, the device ids being filled by the caller) and the padding,
    width and attention arguments are those of `ContextPlanner.plan`. `rows_key` (hashable)
    names the rows and their rope state, and `changed` the rows (planner row numbers) whose
    block tables changed since the previous call: while the key repeats, only those rows' tables
    are copied (into each staging buffer as it comes round) and the rope deltas are reused.
    Without them every table row is copied. Nothing is checked (module docstring)."""
    b = rows.size
    nseq = b if pad_seqs_to is None else int(pad_seqs_to)
    bs = planner.block_size
    lens = cached + 1
    max_len = int(lens.max())
    need_w = -(-max_len // bs)
    width = need_w if width is None else int(width)
    if not need_w <= width <= planner.max_blocks_per_seq:
        raise ValueError(f"width={width} must cover the {need_w} blocks needed and be <= "
                         f"max_blocks_per_seq={planner.max_blocks_per_seq}")
    buffers = planner.buffers
    views = buffers.begin(nseq, nseq, nseq, width)
    ids, pos, slot, lidx, lseq, cu, seq_lens, bt = views.host
    memo = planner._decode_memo
    ar = planner._arange
    if memo.get(("shape", views.turn)) != (b, nseq, width):
        cu[:nseq + 1] = ar[:nseq + 1]
        lidx[:nseq] = ar[:nseq]
        lseq[:nseq] = ar[:nseq]
        ids[b:] = 0
        pos[:, b:] = 0
        slot[b:] = -1
        seq_lens[b:] = 0
        bt[b:] = 0
        memo[("shape", views.turn)] = (b, nseq, width)
        memo[("tables", views.turn)] = None
    if input_ids is not None:
        ids[:b] = input_ids
    turns = len(buffers._host)
    if rows_key is None or memo.get("key") != rows_key:
        plen = planner.prompt_len[rows]
        inv = np.full(planner.max_num_seqs, -1, dtype=np.int64)
        inv[rows] = np.arange(b)
        memo.update(key=rows_key, rows=(planner.rope_delta[rows], plen if plen.any() else None),
                    inv=inv, dirty=deque(maxlen=turns))
        for t in range(turns):
            memo[("tables", t)] = None
    dirty = memo["dirty"]
    dirty.append(changed)
    delta, plen = memo["rows"]
    pos[:, :b] = cached + delta
    if plen is not None:
        for i in np.flatnonzero(cached < plen).tolist():  # a one-token prompt's M-RoPE slot
            c = int(cached[i])
            pos[:, i] = planner.prompt_positions[int(rows[i])][:, c]
    blk, off = np.divmod(cached, bs)
    slot[:b] = planner.table[rows, blk].astype(np.int64) * bs + off
    seq_lens[:b] = lens
    if rows_key is None or None in dirty or memo[("tables", views.turn)] != need_w:
        bt[:b, :need_w] = planner.table[rows, :need_w]
        memo[("tables", views.turn)] = need_w
    else:  # only the rows changed since this buffer was written
        slots = [r for d in dirty for r in d]
        if slots:
            idx = memo["inv"][slots]
            bt[idx, :need_w] = planner.table[rows[idx], :need_w]
    buffers.upload(views)
    ones = memo.get("ones")
    if ones is None or ones.size < nseq:
        ones = memo["ones"] = np.ones(planner.max_num_seqs, dtype=np.int64)
    pad = nseq - b
    meta = HostMeta(
        num_cached_tokens=np.concatenate([cached, np.zeros(pad, np.int64)]) if pad else cached,
        num_new_tokens=ones[:nseq], seq_lens=seq_lens, cu_seqlens_q=cu, block_tables=bt,
        logits_indices=lidx, logits_seqs=lseq, positions=views.host_positions,
        slot_mapping=views.host_slots, input_ids=ids)
    dv = views.device
    ctx = StepContext(
        num_seqs=nseq, num_tokens=nseq, num_real_seqs=b, num_decode_seqs=nseq, block_size=bs,
        max_seqlen_q=1, max_seqlen_k=max_len, positions=dv[1], slot_mapping=dv[2],
        cu_seqlens_q=dv[5], seq_lens=dv[6], block_tables=dv[7], logits_indices=dv[3],
        host=meta, input_ids=dv[0], logits_seqs=dv[4])
    planner._serial += 1
    ctx.extras["planned"] = (planner, planner._serial)
    if planner.backend is not None and plan_attention:
        planner.attention_plan = ctx.plan = planner.backend.replan(planner.attention_plan, ctx)
    return ctx
