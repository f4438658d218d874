"""Parallel sampling (``n`` > 1): one prompt processed once, n sequences drawn from it.

A request with ``n`` > 1 is a `SequenceGroup`: its first sequence is the `Request` the engine
queues; the other n - 1 wait on it (``unforked``), with sequence slots reserved when it is
admitted. In the step that draws its first token (its last prompt token computed), the
scheduler forks each of them (`fork`): the child takes a reference on every prompt block
(`BlockManager.fork`) and draws its own first token from the parent's logits row
(``ScheduledBatch.forks``) with its own seed (seed + index), so the prompt is prefilled and its
media encoded once. From then on every sequence is an ordinary running request. A partial last
prompt block stays shared until a holder writes into it: that holder gets a copy first (copy on
write, ``Request.shared_tail``; the copy is in the step's ``block_copies``, which the runner
applies before the forward pass). A child has its own media slots, empty: preempted and
re-admitted, it finds its embeddings in the encoder cache, needs none (the prefix cache holds
its media tokens) or has them encoded again.

Under the fair share (fair_share.py) a group admitted while others wait reserves slots for at
most its share of siblings; the rest are *detached* (`detach`): they leave `unforked` and queue
as sequences of their own, each prefilling the prompt itself (its full blocks from the prefix
cache when the first sequence committed them) and drawing its first token from its own logits,
with the same seed (seed + index): the same tokens as a forked one. When a sibling runs with
the prompt computed, a detached one admitted later *adopts* its prompt blocks instead
(`adopt`: a reference each, the last block copied on write) and computes only the last prompt
token for its logits. A preempted sequence of a
group, forked or detached, is recomputed alone the same way; its siblings run on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.request import Request, Status

__all__ = ["SequenceGroup", "adopt", "detach", "fork", "fork_all", "make_group", "own_tail",
           "waiting_on"]


@dataclass(eq=False)
class SequenceGroup:
    """The n sequences of one request, in index order; `unforked` those not started yet."""

    seqs: list[Request]
    unforked: list[Request] = field(default_factory=list)

    def all_finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)

    def started(self) -> list[Request]:
        """The sequences that run on their own (the first, and those forked)."""
        return [s for s in self.seqs if s not in self.unforked]


def waiting_on(req: Request) -> list[Request]:
    """The unforked siblings that wait on `req` (its group's first sequence: it reserves their
    slots, forks them, and ends them if it ends first); none for any other sequence."""
    group = req.group
    return group.unforked if group is not None and group.seqs[0] is req else []


def make_group(req: Request, n: int, seq_no: Callable[[], int]) -> SequenceGroup:
    """Give `req` (sequence 0) its n - 1 siblings: same prompt, parameters, sink and media
    (own embedding slots), seed + index; `seq_no()` numbers them."""
    children = []
    for i in range(1, n):
        mm = req.mm if req.mm is None else replace(req.mm, items=None)
        child = Request(req.request_id, seq_no(), req.prompt_ids, req.params, req.seed + i, mm,
                        arrival_time=req.arrival_time)
        child.index = i
        child.sink, child.stream, child.fair_key = req.sink, req.stream, req.fair_key
        children.append(child)
    group = SequenceGroup([req, *children], list(children))
    for s in group.seqs:
        s.group = group
    return group


def fork(parent: Request, child: Request, block_ids: list[int], serial: int) -> None:
    """Start `child` on `parent`'s computed prompt (`block_ids`: its own references to the
    prompt blocks) with its first draw in flight, as admission number `serial`."""
    n = parent.num_prompt_tokens
    child.block_ids = block_ids
    child.num_computed = n
    child.num_placeholders = 1
    child.block_hashes = list(parent.block_hashes[:len(block_ids)])
    child.num_hashed = min(parent.num_hashed, len(child.block_hashes))
    child.model_state = parent.model_state
    child.num_cached_tokens = parent.num_cached_tokens
    child.stop_ids, child.limit_len, child.min_len = parent.stop_ids, parent.limit_len, \
        parent.min_len
    child.synced_blocks = 0
    child.admit_serial = serial
    child.status = Status.RUNNING


def detach(req: Request, keep: int) -> list[Request]:
    """Leave `req`'s first `keep` unforked siblings to be forked; the others become waiting
    sequences of their own (returned, in index order), with its stop rules and model state."""
    group = req.group
    group.unforked, out = group.unforked[:keep], group.unforked[keep:]
    for child in out:
        child.stop_ids, child.limit_len, child.min_len = req.stop_ids, req.limit_len, \
            req.min_len
        child.model_state = req.model_state
        child.status = Status.WAITING
    return out


def adopt(req: Request, bm: BlockManager) -> bool:
    """A waiting sequence of a group with nothing computed or drawn takes a reference on a
    running sibling's prompt blocks and counts all but its last prompt token as computed; the
    block that token's K/V go into is copied before the write (``shared_tail``). False,
    changing nothing, when no sibling has the prompt computed."""
    group, n = req.group, req.num_prompt_tokens
    if group is None or req.num_computed or req.num_placeholders or n < 2 or \
            len(req.token_ids) != n:
        return False
    for s in group.seqs:
        if s is not req and s.status is Status.RUNNING and s.num_computed >= n:
            req.block_ids = bm.fork(s.block_ids[:bm.blocks_for(n)])
            req.num_computed, req.num_hashed, req.shared_tail = n - 1, 0, True
            return True
    return False


def fork_all(req: Request, bm: BlockManager, serial: int) -> list[Request]:
    """Fork `req`'s unforked siblings on its prompt blocks (admission numbers after
    `serial`); marks the holders of a shared partial last block. Returns them."""
    group = req.group
    if group.seqs[0] is not req:  # a detached sibling: the first sequence forks the rest
        return []
    children, group.unforked = group.unforked, []
    prompt = bm.blocks_for(req.num_prompt_tokens)
    for k, child in enumerate(children, 1):
        fork(req, child, bm.fork(req.block_ids[:prompt]), serial + k)
    if children and req.num_prompt_tokens % bm.block_size:
        for s in (req, *children):
            s.shared_tail = True
    return children


def own_tail(req: Request, bm: BlockManager) -> tuple[int, int] | None | bool:
    """Copy on write before `req` writes its next token: (source, destination) to copy when
    the block it goes into was shared (the planner rewrites that table entry), None when
    there is nothing to copy, False (nothing changed) when no block is free."""
    if not req.shared_tail:
        return None
    idx = req.num_computed // bm.block_size
    got = bm.make_writable(req.block_ids, idx)
    if got is False:
        return False
    if got is not None:
        req.synced_blocks = min(req.synced_blocks, idx)
    req.shared_tail = False
    return got
