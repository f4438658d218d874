"""A co-located step's batch cut in two: its decodes (the decoder partition's launch) and its
prefill chunks (launched on the compute partition beside the encoder). A leaf of the spatial
room, so the simulator's copy of the co-located step cuts batches exactly as the engine does;
`turn_budget` likewise bounds a whole-GPU window's step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spaceserve.runtime.core.batch import ScheduledBatch

__all__ = ["split_batch", "turn_budget"]


def split_batch(batch: ScheduledBatch) -> tuple[ScheduledBatch | None, ScheduledBatch | None]:
    """(decode part, prefill part) of a batch; either is None when empty."""
    nd, n = batch.num_decodes, batch.num_seqs
    dec = pre = None
    copies = batch.block_copies  # copy on write happens only to decoding requests' blocks
    if nd:
        dec = ScheduledBatch(batch.reqs[:nd], batch.num_cached[:nd], batch.num_new[:nd],
                             batch.need_logits[:nd], batch.sample_reqs[:nd], nd, nd,
                             batch.preempted, block_copies=copies, pending=batch.pending,
                             grown=batch.grown, admissions=batch.admissions,
                             forks=[f for f in batch.forks if f[0] < nd],
                             partition=batch.partition)
    if n > nd:
        pre = ScheduledBatch(batch.reqs[nd:], batch.num_cached[nd:], batch.num_new[nd:],
                             batch.need_logits[nd:], batch.sample_reqs[nd:], 0,
                             batch.num_tokens - nd, [] if dec else batch.preempted,
                             block_copies=[] if dec else copies, grown=batch.grown,
                             admissions=batch.admissions,
                             forks=[(i - nd, c) for i, c in batch.forks if i >= nd],
                             partition=batch.partition)
    return dec, pre


@contextmanager
def turn_budget(sched: Any, sis: Any, taking_turns: bool) -> Iterator[None]:
    """While SIS takes turns on the whole GPU, a step's prefill budget is at most its plan's
    (``sis.last_turn_tokens``: the window's step keeps the decode SLO's margin)."""
    cap = sched.max_num_batched_tokens
    if taking_turns and sis is not None and sis.last_turn_tokens:
        sched.max_num_batched_tokens = min(cap, sis.last_turn_tokens)
    try:
        yield
    finally:
        sched.max_num_batched_tokens = cap
