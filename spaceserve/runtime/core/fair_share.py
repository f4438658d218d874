"""A fair share of the running batch's sequence slots and KV blocks (`EngineConfig.fair_share`).

Without it the scheduler is first-come first-served: one request with ``n`` = 128 long
sequences holds every slot and block, its preempted sequences go back to the front of the
queue, and a newcomer waits until it ends. With it, while requests wait, every request (and,
behind a fair-share key, every user: `Request.fair_key`) is entitled to a max-min fair share
of the ``max_num_seqs`` slots and of the KV blocks, and sequences over their request's share
are preempted so a request under its share can be admitted:

- **Shares** are water-filled (max-min): first over users (a request without a key is a user
  of its own), then over each user's requests. A request's demand is its unfinished sequences
  (slots) and the blocks its known tokens plus the next one fill (blocks), so a short request
  is entitled to all it needs and the rest goes to the big ones. A lone request's share is
  everything it asks for: it loses nothing.
- **Making room** (`make_room`, at the start of a step): for each waiting request under its
  share with no sequence running (a newcomer, or one whose sequences were all preempted), in
  admission order, the sequences of the request most over its share (largest usage /
  share, then largest usage) are preempted, newest first, until the waiting request's first
  chunk fits; a request at or under its share is never preempted for another, nor is the
  last running sequence of a request (requests of one sequence each keep first-come
  first-served among themselves instead of taking turns by recompute).
- **Growth** (`sort`, `victim`): the sequences of requests at or under their share grow first;
  when one needs a block and none is free, the victim is a not-yet-scheduled sequence of the
  request most over its share, else of the request running the most sequences for its block
  share (the newest of them), not simply the newest sequence, which would be the newcomer.
- **Admission order** (`order`): waiting requests by how much of its share their request
  holds (a newcomer: nothing), queue order among equals; in a step that preempted, only the
  requests room was made for are admitted (no admit-preempt ping-pong); a
  parallel-sampling group reserves slots for at most its share of siblings, the others queue
  as sequences of their own (`forks.detach`).

Preemption is by recompute (the scheduler's `_preempt`): the blocks are freed and the tokens
kept, and the sequence is prefilled again when re-admitted (chunked, up to
``max_num_batched_tokens`` per step; full blocks come back from the prefix cache when it holds
them). Swapping blocks to host memory is not offered: the runners have no host KV pool or copy
path, and a recompute of a few thousand tokens costs a step or two of chunked prefill, which
is why vLLM's V1 engine recomputes too. Sampling draws depend only on (seed, position), so a
recomputed sequence draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.request import Request, Status

__all__ = ["FairShare", "unit_of", "water_fill"]


def water_fill(capacity: float, demands: dict[Any, float]) -> dict[Any, float]:
    """Max-min fair split of `capacity` over `demands`: every claimant gets its demand or an
    equal part of what is left, whichever is smaller (smallest demands settled first)."""
    out: dict[Any, float] = {}
    left = float(capacity)
    items = sorted(demands.items(), key=lambda kv: kv[1])
    for k, (key, demand) in enumerate(items):
        part = left / (len(items) - k)
        got = demand if demand < part else part
        out[key] = got
        left -= got
    return out


def _reserved(req: Request) -> int:
    """Slots `req` holds for unforked siblings (a group's first sequence: `forks.waiting_on`;
    not imported, to keep this module a leaf of the scheduler)."""
    g = req.group
    return sum(c.row >= 0 for c in g.unforked) if g is not None and g.seqs[0] is req else 0


def unit_of(req: Request) -> Hashable:
    """What a share belongs to: the request (all n sequences of a parallel-sampling group)."""
    return req.group if req.group is not None else req


class _Unit:
    """One request's demand, usage and share (slots, blocks)."""

    __slots__ = ("user", "want_slots", "want_blocks", "slots", "nrun", "nblocks", "_ids",
                 "share_slots", "share_blocks")

    def __init__(self, user: Hashable, group: bool = False) -> None:
        self.user = user
        self.want_slots = self.want_blocks = 0
        self.slots = 0  # sequence slots held (running sequences and reserved siblings)
        self.nrun = 0  # running sequences
        self.nblocks = 0  # KV blocks held by its running sequences
        # a parallel-sampling group's block ids (siblings share their prompt's blocks: each
        # counted once); a request of one sequence is counted, not collected (every step
        # with a queue recounts them all)
        self._ids: set[int] | None = set() if group else None
        self.share_slots = self.share_blocks = 0.0

    def hold(self, ids: Sequence[int]) -> None:
        """A running sequence's blocks join the request's usage."""
        if self._ids is None:
            self.nblocks += len(ids)
        else:
            self._ids.update(ids)
            self.nblocks = len(self._ids)

    def release(self, ids: Sequence[int]) -> None:
        """Blocks only a preempted sequence held leave the request's usage."""
        if self._ids is None:
            self.nblocks -= len(ids)
        else:
            self._ids.difference_update(ids)
            self.nblocks = len(self._ids)

    def ratio(self) -> float:
        """Usage over share, the larger of slots and blocks (inf: over a share of 0)."""
        r = 0.0
        for used, share in ((self.slots, self.share_slots), (self.nblocks, self.share_blocks)):
            if used:
                r = max(r, used / share if share > 0 else float("inf"))
        return r

    def block_ratio(self) -> float:
        """Blocks held over the block share (what a growing sequence competes for)."""
        n = self.nblocks
        if self.share_blocks > 0:
            return n / self.share_blocks
        return float("inf") if n else 0.0

    def over(self) -> bool:
        """Over its share with more than one sequence running: its newest may be preempted
        for another request (a request's last sequence never is: no thrashing between
        single-sequence requests, which keep first-come first-served)."""
        return self.nrun > 1 and self.ratio() > 1.0

    def starved(self) -> bool:
        """Under its share with no sequence running: room is made for it at once (one with
        some running waits for free blocks, so shares near balance cause no churn)."""
        return not self.nrun and self.under()

    def under(self) -> bool:
        return self.slots < self.share_slots and self.nblocks < self.share_blocks


class FairShare:
    """The scheduler's fair-share policy over `bm`'s blocks and `max_num_seqs` slots."""

    def __init__(self, bm: BlockManager, max_num_seqs: int, sched: Any = None) -> None:
        self.bm = bm
        self.max_num_seqs = max_num_seqs
        self.sched = sched  # the scheduler whose queues `take` refreshes the shares from
        self.units: dict[Hashable, _Unit] = {}
        self.fresh = False  # the shares were computed in this step
        self.num_preempted = 0  # sequences preempted to make room for a request under share
        self.reserved = 0  # free blocks kept this step for the waiting requests room was made for
        self.chosen: set[int] = set()  # ids of the waiting requests sequences were preempted for

    def begin(self, running: list[Request], waiting: Sequence[Request], free_rows: int,
              budget: int, preempt: Any) -> list[Request]:
        """A step starts: when it may need them, compute the shares, make room for the
        waiting requests under theirs (`make_room`) and `sort` `running`. Returns the
        preempted."""
        self.fresh, self.reserved = False, 0
        self.chosen.clear()
        if not self.pressed(running, waiting, budget):
            return []
        self.refresh(running, waiting)
        out = self.make_room(running, list(waiting), free_rows, budget, preempt)
        self.sort(running)
        return out

    def refresh(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Recompute every active request's demand, usage and share. With no
        parallel-sampling group active there is nothing to share (no request runs more than
        its last sequence, which is never preempted for another): no units, which every
        decision reads as first-come first-served - what it would decide anyway, at no cost
        per step."""
        self.fresh = True
        if not any(r.group is not None for r in running) and \
                not any(r.group is not None for r in waiting):
            self.units = {}
            return
        bm = self.bm
        units: dict[Hashable, _Unit] = {}
        for req in (*running, *waiting):
            key = unit_of(req)
            u = units.get(key)
            if u is None:
                u = units[key] = _Unit(req.fair_key if req.fair_key is not None else key,
                                       req.group is not None)
                if req.group is not None:  # its siblings not forked yet wait with it
                    for child in req.group.unforked:
                        u.want_slots += 1
                        u.want_blocks += bm.blocks_for(len(child.token_ids) + 1)
                        u.slots += child.row >= 0
            u.want_slots += 1
            u.want_blocks += bm.blocks_for(len(req.token_ids) + req.num_placeholders + 1)
            if req.status is Status.RUNNING:
                u.slots += 1
                u.nrun += 1
                u.hold(req.block_ids)
        self.units = units
        for total, want, share in ((self.max_num_seqs, "want_slots", "share_slots"),
                                   (bm.num_blocks, "want_blocks", "share_blocks")):
            users: dict[Hashable, list[_Unit]] = {}
            for u in units.values():
                users.setdefault(u.user, []).append(u)
            per_user = water_fill(total, {k: sum(getattr(u, want) for u in us)
                                          for k, us in users.items()})
            for k, us in users.items():
                if len(us) == 1:  # a user of one request (every request without a key)
                    setattr(us[0], share, per_user[k])
                    continue
                got = water_fill(per_user[k], {id(u): getattr(u, want) for u in us})
                for u in us:
                    setattr(u, share, got[id(u)])

    def pressed(self, running: Sequence[Request], waiting: Sequence[Request],
                budget: int) -> bool:
        """Whether this step may need the fair share: requests wait, or the growth of the
        running ones may not find free blocks (else a lone request costs nothing)."""
        return bool(waiting) or self.bm.num_free < len(running) + self.bm.blocks_for(budget)

    def sort(self, running: list[Request]) -> None:
        """Order `running` (stably) so the sequences of requests over their share come last:
        those at or under it grow first, and blocks are taken from the others."""
        over = [r for r in running if (u := self.unit(r)) is not None and u.over()]
        if over and len(over) < len(running):
            marked = {id(r) for r in over}
            running[:] = [r for r in running if id(r) not in marked] + over

    def grow(self, req: Request, total: int) -> bool:
        """`BlockManager.ensure` of `req`'s blocks for `total` tokens; False (nothing taken)
        too when a request over its share would take the blocks kept for a waiting one."""
        bm = self.bm
        if self.reserved and bm.num_free - (bm.blocks_for(total) - len(req.block_ids)) < \
                self.reserved:
            u = self.unit(req)
            if u is not None and u.over():
                return False
        return bm.ensure(req.block_ids, total)

    def take(self, running: list[Request], start: int) -> Request:
        """Remove from `running` and return the sequence to preempt for a block (`victim`)."""
        if not self.fresh:
            self.refresh(running, self.sched.waiting)
        req = running.pop(self.victim(running, start))
        self.preempted(req)
        return req

    def unit(self, req: Request) -> _Unit | None:
        return self.units.get(unit_of(req))

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        """Waiting requests in admission order: the least of its share its request holds
        first (usage / share; a newcomer holds nothing), queue order among equals."""
        def ratio(r: Request) -> float:
            u = self.unit(r)
            return 0.0 if u is None else u.ratio()

        return sorted(waiting, key=ratio)

    def sibling_allowance(self, req: Request, free_rows: int) -> int:
        """Siblings of `req` (admitted now) that may reserve a slot: its share less what it
        holds, and one row left for itself."""
        u = self.unit(req)
        room = free_rows - 1
        if u is not None:
            room = min(room, int(u.share_slots) - u.slots - 1)
        return max(0, room)

    def admitted(self, req: Request, rows: int) -> None:
        """`req` took `rows` slots (itself and reserved siblings) and its first blocks."""
        u = self.unit(req)
        if u is not None:
            u.slots += rows
            u.nrun += 1
            u.hold(req.block_ids)

    def victim(self, running: Sequence[Request], start: int) -> int:
        """Index in `running` (at `start` or later: not scheduled yet) of the sequence to
        preempt for a block: the newest of the request most over its share, else of the
        request running the most sequences for its block share, else (single-sequence
        requests only: first-come first-served) the newest."""
        best, key = start, None
        for j in range(start, len(running)):
            u = self.unit(running[j])
            k: tuple = (0, 0, 0.0, 0, j)
            if u is not None and u.nrun > 1:
                k = (u.over(), 1, u.block_ratio(), u.nblocks, j)
            if key is None or k >= key:
                best, key = j, k
        return best

    def preempted(self, req: Request) -> None:
        """`req` is about to be preempted: its slot and the blocks only it holds leave its
        request's usage."""
        u = self.unit(req)
        if u is None:
            return
        u.slots -= 1 + _reserved(req)
        u.nrun -= 1
        ref = self.bm.ref_count
        u.release([b for b in req.block_ids if ref(b) == 1])

    def make_room(self, running: list[Request], waiting: Sequence[Request], free_rows: int,
                  budget: int, preempt: Any) -> list[Request]:
        """Preempt (`preempt(seq)`) sequences over their request's share, newest first, so
        each starved waiting request (`_Unit.starved`), in admission order, has a slot and
        the blocks of its first chunk (at most `budget` tokens). Returns the preempted,
        removed from `running`."""
        out: list[Request] = []
        bm = self.bm
        reserved = 0  # blocks of the waiting requests room was made for
        for w in self.order(waiting):
            wu = self.unit(w)
            if wu is None or not wu.starved() or w.num_placeholders:
                continue
            known = len(w.token_ids) + w.num_placeholders
            need = bm.blocks_for(min(known, budget))
            while free_rows < 1 or bm.num_free - reserved < need:
                j = self._over(running, wu)
                if j is None:
                    return out
                victim = running.pop(j)
                freed = 1 + _reserved(victim)
                self.preempted(victim)
                preempt(victim)
                self.num_preempted += 1
                self.chosen.add(id(w))
                free_rows += freed
                out.append(victim)
            free_rows -= 1  # taken by `w`: the next one makes its own room
            reserved += need
            budget -= min(known, budget)
            if budget <= 0:
                break
        self.reserved = reserved
        return out

    def _over(self, running: Sequence[Request], exclude: _Unit) -> int | None:
        """Index of the newest running sequence of the request most over its share (other
        than `exclude`'s), or None when no request is over its share."""
        best, key = None, None
        for j, req in enumerate(running):
            u = self.unit(req)
            if u is None or u is exclude or not u.over():
                continue
            k = (u.ratio(), u.nblocks, j)
            if key is None or k >= key:
                best, key = j, k
        return best
