"""A co-located step's batch cut in two: its decodes (the decoder partition's launch) and its
prefill chunks (launched on the compute partition beside the encoder). A leaf of the spatial
room, so the simulator's copy of the co-located step cuts batches exactly as the engine does;
`turn_budget` likewise bounds a whole-GPU window's step (decodes alone until the partition
switches to it)."""

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
def turn_budget(sched: Any, sis: Any, taking_turns: bool, shared: bool = False) -> Iterator[None]:
    """While SIS takes turns on the whole GPU, a step's prefill budget is at most its plan's
    (``sis.last_turn_tokens``: the window's step keeps the decode SLO's margin).

    `shared`: SIS took turns but the partition in effect is still shared (the switch waits for
    the compute side's work in flight). Such a step carries its decodes only: a prefill chunk
    there would run on the decoder's partition, which neither SIS's plan nor the SLO priced (a
    1260-token chunk beside 128 decodes on 36 SMs is an 88 ms step), and on the compute side
    it would hold the switch back. The prompts wait the step out in their queues."""
    if taking_turns and shared:
        with _decodes_only(sched):
            yield
        return
    cap = sched.max_num_batched_tokens
    if taking_turns and sis is not None and sis.last_turn_tokens:
        sched.max_num_batched_tokens = min(cap, sis.last_turn_tokens)
    try:
        yield
    finally:
        sched.max_num_batched_tokens = cap


@contextmanager
def _decodes_only(sched: Any) -> Iterator[None]:
    """Hide from `sched` the waiting requests and the running ones with prompt left, so the
    step it schedules is decodes alone; put them back after, in their order (those it
    preempted meanwhile first in the queue, as the scheduler queues them)."""
    running, waiting = sched.running, sched.waiting
    hidden = {id(r) for r in running
              if len(r.token_ids) + r.num_placeholders - r.num_computed > 1}
    sched.running = [r for r in running if id(r) not in hidden]
    sched.waiting = []
    try:
        yield
    finally:
        kept = {id(r) for r in sched.running}
        sched.running = [r for r in running if id(r) in hidden or id(r) in kept]
        sched.waiting = sched.waiting + waiting
