"""A generic step planner: a `ScheduledBatch` in, flat device metadata of the step out.

`StepPlanner` turns a batch into token ids, positions, slot mapping, block tables, ... in
preallocated buffers with vectorised host work, padding pure-decode batches to a CUDA-graph
bucket (a batch size and a block-table width: the step's need, rounded up to the widths graphs
are captured for, never wider), through the models' `ContextPlanner`; runners may use it or
plan their own way.
`StepLimits` are the capacities its buffers (and the engine's) are sized from.

Planning is two halves: `prepare` reads the batch (the only part that needs `Request`
objects) into `StepInputs`, plain host arrays that also record what it changed in the
per-row state (`RowSync`), and `plan_inputs` lays the step out. A tensor-parallel worker
receives the inputs of rank 0's `prepare`, applies their `RowSync` to its own rows and plans
the same step (`runtime/tp`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.core.batch import ScheduledBatch
from spaceserve.runtime.core.request import Request

__all__ = ["RowSync", "StepInputs", "StepLimits", "StepPlan", "StepPlanner"]


@dataclass(frozen=True)
class StepLimits:
    """Capacities fixed at start-up; the planner's buffers are sized from them."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    # Context lengths (tokens) decode graphs are captured for, one table width each; None: a
    # doubling ladder up to max_model_len (see `spaceserve.models.step.graph_buckets`).
    graph_context_lens: tuple[int, ...] | None = None
    # Bound on the memory of every decode graph (None: unbounded), checked at capture.
    graph_memory_bytes: int | None = None

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def graph_table_widths(self) -> tuple[int, ...]:
        """Block-table widths of the decode graphs, ascending (the widest covers
        `max_model_len` unless `graph_context_lens` stops short of it)."""
        from spaceserve.models.step.graph_buckets import table_widths

        return table_widths(self.max_blocks_per_seq, self.block_size, self.graph_context_lens)

    @property
    def max_tokens(self) -> int:
        return max(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass
class StepPlan:
    """Flat metadata of one step (layout as `spaceserve.models.step.context`): sequence ``i`` owns
    tokens ``query_start_loc[i] .. query_start_loc[i + 1] - 1``; padding sequences (seq_len 0,
    slot -1) follow the real ones when the batch was padded to a graph bucket, and get logits
    rows too (``num_logits`` counts the real ones). Tensors live on the runner's device and are
    views of the planner's fixed buffers, valid until its next plan; `host` holds numpy views of
    the same values and `context` the model-facing `StepContext` of the same step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, the token's index in its sequence (+ rope delta)
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    logits_indices: torch.Tensor  # [R] int64, token index of each logits row
    logits_seqs: torch.Tensor  # [R] int64, sequence of each logits row
    seq_lens: torch.Tensor  # [B] int32, cached + new (0 = padding)
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, width] int32
    num_tokens: int
    num_seqs: int
    num_real_seqs: int
    num_decodes: int
    num_logits: int
    max_seqlen_q: int
    max_seqlen_k: int
    # The step's image-token pieces: token indices (host) and embedding rows (device) per
    # covered image span; gathered only by a runner that asks (`mm_index` / `mm_embeds`).
    mm_parts: tuple[list[np.ndarray], list[torch.Tensor]] = ((), ())
    context: Any = None  # spaceserve.models.StepContext

    @property
    def host(self) -> dict[str, np.ndarray]:
        """Host (numpy) copies of the step's fields, by name (built when asked)."""
        h = self.context.host
        return {"input_ids": h.input_ids, "positions": h.positions.numpy()[0],
                "slot_mapping": h.slot_mapping.numpy(), "logits_indices": h.logits_indices,
                "logits_seqs": h.logits_seqs, "seq_lens": h.seq_lens,
                "query_start_loc": h.cu_seqlens_q, "block_tables": h.block_tables}

    @property
    def mm_index(self) -> torch.Tensor | None:
        """[M] int64 token indices taking image embeddings (a host tensor), or None."""
        idx = self.mm_parts[0]
        return torch.from_numpy(np.concatenate(idx)) if len(idx) else None

    @property
    def mm_embeds(self) -> torch.Tensor | None:
        """[M, hidden] embedding rows for `mm_index`, or None."""
        emb = self.mm_parts[1]
        return torch.cat(emb) if len(emb) else None


@dataclass
class RowSync:
    """What a `prepare` changed in the per-row state: rows a sequence (re)took, with its rope
    delta and prompt M-RoPE positions (``[3, L]`` int32, or None), and block ids written
    (row, first column, ids)."""

    resets: list[tuple[int, int, np.ndarray | None]] = field(default_factory=list)
    writes: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass
class StepInputs:
    """A step as host arrays (`StepPlanner.prepare`): the rows and token counts of its
    sequences (decodes first), which need logits, the flattened token ids, the padding and
    table width of a graph step, and the row-state changes that go with it.

    `pending` lists the decodes whose input token is still on the device (a pipelined step:
    their entries of `input_ids` are stale, and `input_ids` is None when every sequence is such
    a decode); `source` is where they are read from on the device (the sampler's last-token
    table and the decodes' slots in it). `mm_parts` (the image pieces) and `source` hold device
    tensors and stay on the planning process: a tensor-parallel worker receives the pending
    inputs from rank 0 by a broadcast inside the step."""

    rows: np.ndarray
    num_cached: np.ndarray
    num_new: np.ndarray
    need_logits: np.ndarray | None
    input_ids: np.ndarray | None
    num_decodes: int
    pad_to: int | None
    width: int | None
    sync: RowSync
    mm_parts: tuple[list[np.ndarray], list[torch.Tensor]] = ((), ())
    pending: list[int] = field(default_factory=list)
    source: tuple[torch.Tensor, torch.Tensor] | None = None
    block_copies: np.ndarray | None = None  # [C, 2] KV blocks (source, destination) to copy

    @property
    def num_seqs(self) -> int:
        return int(self.rows.size)

    def wire(self) -> StepInputs:
        """A compact copy to send to another process: int32 arrays, no device tensors."""
        i32 = np.int32
        ids = None if self.input_ids is None else self.input_ids.astype(i32)
        return StepInputs(self.rows.astype(i32), self.num_cached.astype(i32),
                          self.num_new.astype(i32), self.need_logits, ids,
                          self.num_decodes, self.pad_to, self.width, self.sync,
                          pending=self.pending, block_copies=self.block_copies)


class StepPlanner:
    """Turns a `ScheduledBatch` into a `StepPlan` through the models' `ContextPlanner`, the
    one planner (numpy into preallocated buffers, two non-blocking copies, the attention plan
    refilled in place).

    Block tables persist per sequence slot (``req.row``) and only newly allocated blocks are
    written, so a decode step costs a few numpy operations over the batch, not a Python loop
    per token or per block; a decode-only step over the same slots goes through
    `models.decode_plan.plan_decode`, which rewrites only what changed. `rope` maps a request
    to (its prompt's ``[3, L]`` M-RoPE positions or None, its rope delta) and is asked when the
    request takes its slot; without it positions are token indices. `backend` (an attention
    backend) gets its plan refilled for every step not padded for a graph. A stage running
    steps beside another one's (on another stream) takes a planner of its own with
    ``share_rows_with=`` the other's, so both see every request's slot state.
    """

    def __init__(self, limits: StepLimits, device: torch.device | str,
                 graph_batch_sizes: Sequence[int] = (), *, backend: Any = None,
                 rope: Callable[[Request], tuple[Any, int]] | None = None,
                 share_rows_with: StepPlanner | None = None) -> None:
        from spaceserve.models.step.context import ContextPlanner

        self.limits = limits
        self.device = torch.device(device)
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes))
        self.graph_widths = limits.graph_table_widths
        self.rope = rope
        self.core = ContextPlanner(limits.max_num_seqs, limits.max_tokens,
                                   limits.max_blocks_per_seq, limits.block_size,
                                   device=self.device, backend=backend,
                                   rows=share_rows_with.core if share_rows_with else None)
        self.table = self.core.table  # persistent block table per slot
        # bumped whenever a table row changes (shared by planners sharing rows)
        self._version = share_rows_with._version if share_rows_with else [0]
        self._dec_array = np.zeros(0, dtype=np.int64)  # the last decode-only step's slots
        self._dec_key = b""  # and their bytes (a cheap comparison)
        self._row_list: list[int] = []  # the slots of the last prepared batch, and as an array
        self._row_array = np.zeros(0, dtype=np.int64)
        self._ones = np.ones(limits.max_num_seqs, dtype=np.int64)
        self._ones.flags.writeable = False
        self._dec_serial = 0  # bumped when those slots or a slot's rope state change
        self._seen_version = 0  # the table version after this planner's last sync
        self._changed: list[int] = []  # slots whose tables the last sync changed

    def decode_need(self, batch: ScheduledBatch) -> int:
        """Block-table width (blocks) the decode sequences of `batch` need."""
        nd = batch.num_decodes
        return -(-(max(batch.num_cached[:nd], default=0) + 1) // self.limits.block_size)

    def bucket(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(batch size, table width) of the graph bucket a decode-only `batch` replays in:
        the smallest of `graph_batch_sizes` x `graph_widths` that holds it; None for a batch
        with prefills or that no bucket holds."""
        from spaceserve.models.step.graph_buckets import pick_bucket

        nb = batch.num_seqs
        if not nb or batch.num_decodes != nb or not self.graph_batch_sizes:
            return None
        return pick_bucket(self.graph_batch_sizes, self.graph_widths, nb,
                           self.decode_need(batch))

    def plan(self, batch: ScheduledBatch, *, pad_to: int | None = None,
             width: int | None = None) -> StepPlan:
        """The plan of `batch`. A decode-only batch is padded to `pad_to` sequences with block
        tables `width` wide (None: the narrowest of `graph_widths` that covers the batch), or
        else to its `bucket`, and gets no attention plan (a graph replays its own)."""
        return self.plan_inputs(self.prepare(batch, pad_to=pad_to, width=width))

    def prepare(self, batch: ScheduledBatch, *, pad_to: int | None = None,
                width: int | None = None) -> StepInputs:
        """`batch` as `StepInputs` (padding and width as `plan` says), writing the rows' new
        blocks and rope state into the shared row state and recording them in
        ``inputs.sync``. Only the requests the scheduler says were given blocks
        (``batch.grown``) are looked at."""
        reqs, nd, nb = batch.reqs, batch.num_decodes, len(batch.reqs)
        core, table, rope = self.core, self.table, self.rope
        sync = RowSync()
        for r in reqs if batch.grown is None else batch.grown:
            k, s = len(r.block_ids), r.synced_blocks
            if k != s:
                if s == 0:  # the request (re)took its slot
                    mpos, delta = rope(r) if rope is not None else (None, 0)
                    core.set_row(r.row, rope_delta=delta, mrope_positions=mpos)
                    pos = core.prompt_positions[r.row]
                    sync.resets.append((r.row, int(delta), None if pos is None
                                        else pos.astype(np.int32)))
                ids_new = r.block_ids[s:]
                table[r.row, s:k] = ids_new
                sync.writes.append((r.row, s, ids_new))
                r.synced_blocks = k
        self._note(sync)
        pending = batch.pending
        if pending and batch.input_source is None:
            raise ValueError("the batch's decode inputs are still on the device and it names "
                             "no input source (schedule and account steps through the engine)")
        if pad_to is None:
            bucket = self.bucket(batch)
            if bucket is not None:
                pad_to, width = bucket
        elif width is None:
            need = self.decode_need(batch)
            width = next((w for w in self.graph_widths if w >= need), need)
        if pad_to is None:
            width = None
        row_list = [r.row for r in reqs]
        if row_list != self._row_list:  # the same slots as last time: the same (shared) array
            self._row_list, self._row_array = row_list, np.array(row_list, dtype=np.int64)
        rows = self._row_array
        cached = np.array(batch.num_cached, dtype=np.int64)
        copies = np.array(batch.block_copies, dtype=np.int64) if batch.block_copies else None
        if nd == nb:  # decode-only: one token each, logits for all
            ids = None if len(pending) == nd else \
                np.array([r.token_ids[-1] for r in reqs], dtype=np.int64)
            return StepInputs(rows, cached, self._ones[:nb], None, ids, nd, pad_to,
                              width, sync, pending=list(pending), source=batch.input_source,
                              block_copies=copies)
        ids_l = [r.token_ids[-1] for r in reqs[:nd]]
        t = nd
        idx_parts: list[np.ndarray] = []
        emb_parts: list[torch.Tensor] = []
        for i in range(nd, nb):
            r, s, n = reqs[i], batch.num_cached[i], batch.num_new[i]
            ids_l += r.token_ids[s:s + n]
            mm = r.mm
            if mm is not None and mm.num_tokens:
                lo, hi = np.searchsorted(mm.positions, [s, s + n])
                if hi > lo:
                    idx_parts.append(mm.positions[lo:hi] - s + t)
                    emb_parts.append(mm.rows(int(lo), int(hi)))
            t += n
        return StepInputs(rows, cached, np.array(batch.num_new, dtype=np.int64),
                          np.array(batch.need_logits, dtype=bool),
                          np.array(ids_l, dtype=np.int64), nd, pad_to, width, sync,
                          (idx_parts, emb_parts), list(pending), batch.input_source, copies)

    def apply(self, sync: RowSync) -> None:
        """Apply another planner's row-state changes (a tensor-parallel worker's rows follow
        rank 0's)."""
        for row, delta, pos in sync.resets:
            self.core.set_row(row, rope_delta=delta, mrope_positions=pos)
        for row, start, ids in sync.writes:
            self.table[row, start:start + len(ids)] = ids
        self._note(sync)

    def _note(self, sync: RowSync) -> None:
        """Record what a sync changed for the decode fast path: the rows whose tables changed,
        and a new key for the rows' rope state when a row was (re)taken or another planner
        sharing the rows wrote them since this one last looked."""
        if self._version[0] != self._seen_version or sync.resets:
            self._dec_serial += 1
        if sync.writes:
            self._changed = [row for row, _, _ in sync.writes]
            self._version[0] += 1
        elif self._changed:
            self._changed = []
        self._seen_version = self._version[0]

    def plan_inputs(self, inputs: StepInputs) -> StepPlan:
        """Lay out a prepared step (its row state already applied) in the planner's buffers;
        decode inputs still on the device are copied in there from `inputs.source` (when it
        is None, as on a tensor-parallel worker, the caller fills them)."""
        graph = inputs.pad_to is not None
        nd, nb = inputs.num_decodes, inputs.num_seqs
        if nd == nb:
            ctx = self._plan_decode(inputs)
        else:
            ctx = self.core.plan(inputs.rows, inputs.num_cached, inputs.num_new,
                                 need_logits=inputs.need_logits, input_ids=inputs.input_ids,
                                 pad_seqs_to=inputs.pad_to, width=inputs.width,
                                 plan_attention=not graph)
        if inputs.pending and inputs.source is not None:
            self._take_inputs(inputs, ctx.input_ids)
        return StepPlan(ctx.input_ids, ctx.positions[0], ctx.slot_mapping, ctx.logits_indices,
                        ctx.logits_seqs, ctx.seq_lens, ctx.cu_seqlens_q, ctx.block_tables,
                        num_tokens=ctx.num_tokens, num_seqs=ctx.num_seqs, num_real_seqs=nb,
                        num_decodes=nd, num_logits=ctx.logits_indices.shape[0] - ctx.num_seqs + nb,
                        max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                        mm_parts=inputs.mm_parts, context=ctx)

    def _plan_decode(self, inputs: StepInputs) -> Any:
        """A decode-only step through `plan_decode`: only positions, slots and lengths are
        rewritten while the batch keeps its slots and no block was added."""
        from spaceserve.models.step.decode_plan import plan_decode

        rows = inputs.rows
        if rows is not self._dec_array:  # else `prepare` found the same slots
            key = rows.tobytes()
            if key != self._dec_key:
                self._dec_serial += 1
            self._dec_array, self._dec_key = rows, key
        return plan_decode(self.core, self._dec_array, inputs.num_cached,
                           input_ids=inputs.input_ids, pad_seqs_to=inputs.pad_to,
                           width=inputs.width, plan_attention=inputs.pad_to is None,
                           rows_key=self._dec_serial, changed=self._changed)

    @staticmethod
    def _take_inputs(inputs: StepInputs, input_ids: torch.Tensor) -> None:
        """Decode inputs still on the device (``inputs.pending``) from the sampler's last-token
        table, by slot, straight into the step's device input ids (after their upload)."""
        assert inputs.source is not None
        table, slots = inputs.source
        nd, pending = inputs.num_decodes, inputs.pending
        if len(pending) == nd:
            torch.index_select(table, 0, slots, out=input_ids[:nd])
        else:
            idx = torch.tensor(pending, dtype=torch.int64)
            if input_ids.is_cuda:  # pinned and asynchronous: no wait for the device
                idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
            input_ids.index_copy_(0, idx, table.index_select(0, slots.index_select(0, idx)))
