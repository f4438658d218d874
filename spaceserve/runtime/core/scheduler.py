"""Continuous batching with chunked prefill under a per-step token budget.

Every step the scheduler first continues the running requests in admission order (one token for
a decoding request, the next prefill chunk for one still prefilling), then admits waiting
requests while the token budget, the sequence slots and the KV blocks last. A running request
that needs a KV block when none is free preempts the most recently admitted one by recompute:
its blocks are freed and it goes back to the front of the queue with its tokens (and image
embeddings). Draws depend only on (seed, index), so recomputation reproduces the same tokens.

With prefix caching, a request being admitted first takes the longest chain of committed blocks
its tokens name, leaving its last token to compute, once its media from there have embeddings
(`is_ready`). The blocks each step filled are committed, outliving their request until evicted.

Parallel sampling (``n`` > 1, forks.py): a request's first sequence is queued alone, with
slots reserved for its siblings at admission; the step that draws its first token forks them
(`ScheduledBatch.forks`: each draws from the parent's logits row), sharing the prompt's blocks.
A holder of a shared partial last block copies it before writing into it (copy on write,
`ScheduledBatch.block_copies`, applied by the runner before the step's forward pass).

Scheduling runs ahead of the device by one step (the engine pipelines steps): `schedule`
advances every scheduled request's cached count at once and counts the token each sampled
request will draw as a *placeholder* (``Request.num_placeholders``), known for scheduling but
not yet in ``token_ids``; `update` later appends the drawn tokens in their place and finishes
the requests that stop. A decode whose input token is still a placeholder is listed in
``ScheduledBatch.pending``: the runner takes that input from the device. A request is never
re-admitted in the step that preempted it, so a prefill never needs a placeholder.

`pause` preempts a request and keeps it out of admission until `resume`. With ``fair_share``
no request keeps more than its fair share of slots and blocks while others wait (fair_share.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from spaceserve.checks import require_int
from spaceserve.runtime.core.batch import ScheduledBatch
from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.fair_share import FairShare
from spaceserve.runtime.core.forks import adopt, detach, fork_all, own_tail, waiting_on
from spaceserve.runtime.core.prefix_cache import (
    block_hashes,
    commit_upto,
    drop_prefix,
    max_match_blocks,
    take_prefix,
)
from spaceserve.runtime.core.request import Request, Status


class Scheduler:
    """Queues, admission, KV growth and preemption; the engine runs what `schedule` returns."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        is_ready: Callable[[Request, int], bool] | None = None,
        fair_share: bool = False,
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            require_int(name, value)
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos = frozenset(eos_token_ids)
        self.is_ready = is_ready or (lambda req, start: True)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_queried_tokens = 0  # tokens of admitted requests looked up in the cache
        self.prefix_hit_tokens = 0  # of which the cache held (not computed)
        self.prefill_tokens = 0  # tokens computed other than a decoding request's newest one
        self.num_admitted = 0  # admissions so far (a request re-taking a slot counts again)
        self._copies: list[tuple[Request, int, int]] = []  # this schedule's copies on write
        self.paused: set[Request] = set()  # queued but not admitted until resumed
        self.fair = FairShare(block_manager, max_num_seqs, self) if fair_share else None

    def peek_cached(self, req: Request) -> int:
        """Tokens of `req` the prefix cache holds now (nothing taken; 0 with caching off)."""
        bm = self.bm
        if not bm.enable_caching:
            return 0
        bs = bm.block_size
        limit = max_match_blocks(req, bs)
        return bm.peek(block_hashes(req, bs, limit * bs), limit) * bs

    def add(self, req: Request) -> None:
        """Queue a validated request (its prompt fits the context and the cache)."""
        req.status = Status.WAITING
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)
        req.limit_len = min(req.num_prompt_tokens + p.max_tokens, self.max_model_len)
        req.min_len = req.num_prompt_tokens + p.min_tokens
        if req.group is not None:  # siblings not forked yet wait with it, never queued
            for child in req.group.unforked:
                child.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and give them the KV blocks their new tokens need; a
        decode is accounted as it is picked (cached count advanced, its draw a placeholder)."""
        bm, bs = self.bm, self.bm.block_size
        budget = self.max_num_batched_tokens
        running = self.running
        dec: list[Request] = []
        cached: list[int] = []
        pending: list[int] = []
        pre: list[Request] = []
        pre_n: list[int] = []
        preempted: list[Request] = []
        grown: list[Request] = []
        fair = self.fair
        if fair is not None:  # make room for requests under their share
            preempted = fair.begin(running, self._queued(), len(self._free_rows), budget,
                                   self._preempt)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            known = len(req.token_ids) + req.num_placeholders
            if known >= req.limit_len:  # its draw in flight is its last: nothing to run
                i += 1
                continue
            n = known - c
            if n > budget:
                n = budget
            total = c + n
            if len(req.block_ids) * bs < total or req.shared_tail:
                grown.append(req)
                while not (self._own_tail(req) and (bm.ensure(req.block_ids, total) if fair is
                                                    None else fair.grow(req, total))):
                    victim = running.pop() if fair is None else fair.take(running, i)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    break
            elif req.synced_blocks != len(req.block_ids):  # blocks no planned step wrote yet
                grown.append(req)
            if n == 1 and total == known:
                if req.num_placeholders:
                    pending.append(len(dec))
                dec.append(req)
                cached.append(c)
                if c < req.num_prompt_tokens:  # a prompt token: prefill work
                    self.prefill_tokens += 1
                req.num_computed = total
                req.num_placeholders += 1
            else:
                pre.append(req)
                pre_n.append(n)
            budget -= n
            i += 1
        if not preempted or fair is not None:  # the fair share admits those it made room for
            self._admit(budget, dec, cached, pre, pre_n, grown, bool(preempted))
        batch = self._batch(dec, cached, pre, pre_n, preempted)
        batch.pending, batch.grown = pending, grown
        return batch

    def _admit(self, budget: int, dec: list[Request], cached: list[int], pre: list[Request],
               pre_n: list[int], grown: list[Request], chosen_only: bool = False) -> int:
        bm, fair = self.bm, self.fair
        if fair is not None and self.waiting and not fair.fresh:
            fair.refresh(self.running, self._queued())
        taken: dict[int, list[Request]] = {}  # id of each admitted: its detached siblings
        for req in self.waiting if fair is None else fair.order(self.waiting):
            if budget <= 0 or not self._free_rows:
                break
            if req.num_placeholders or req in self.paused or \
                    (chosen_only and id(req) not in fair.chosen):
                continue  # preempted in this step (its draw in flight), paused, or not made
                # room for
            keep = len(waiting_on(req))
            if fair is not None and keep:
                keep = min(keep, fair.sibling_allowance(req, len(self._free_rows)))
            elif keep >= len(self._free_rows):
                break  # its unforked siblings need sequence slots too
            if not adopt(req, bm):  # a sibling's prompt blocks, else the prefix cache's
                take_prefix(bm, req)
            if not self.is_ready(req, req.num_computed):
                drop_prefix(bm, req)
                continue
            known = len(req.token_ids) + req.num_placeholders
            n = min(known - req.num_computed, budget)
            if not (bm.ensure(req.block_ids, req.num_computed + n) and self._own_tail(req)):
                drop_prefix(bm, req)
                break
            taken[id(req)] = detach(req, keep) if waiting_on(req) else []
            self.prefix_queried_tokens += known
            self.prefix_hit_tokens += req.num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed
            req.status = Status.RUNNING
            req.row = self._free_rows.pop()
            req.synced_blocks = 0
            for child in waiting_on(req):
                child.row = self._free_rows.pop()
            if fair is not None:
                fair.admitted(req, 1 + keep)
            self.num_admitted += 1
            req.admit_serial = self.num_admitted
            grown.append(req)
            self.running.append(req)
            if n == 1 and req.num_computed + 1 == known:  # its input is known: not pending
                dec.append(req)
                cached.append(req.num_computed)
                if req.num_computed < req.num_prompt_tokens:
                    self.prefill_tokens += 1
                req.num_computed += 1
                req.num_placeholders += 1
            else:
                pre.append(req)
                pre_n.append(n)
            budget -= n
        if taken:  # admitted requests leave the queue; their detached siblings take their place
            self.waiting = [s for r in self.waiting
                            for s in (taken[id(r)] if id(r) in taken else (r,))]
        return budget

    def _batch(self, dec: list[Request], cached: list[int], pre: list[Request],
               pre_n: list[int], preempted: list[Request]) -> ScheduledBatch:
        """The batch (decodes already accounted); advances the prefills' cached counts and
        counts the draw of each that ends its known tokens as a placeholder."""
        nd = len(dec)
        sample = list(dec)
        need = [True] * nd
        computed = 0  # prefill work: every computed token but a decoding request's newest
        for req, n in zip(pre, pre_n, strict=True):
            cached.append(req.num_computed)
            req.num_computed += n
            known = len(req.token_ids) + req.num_placeholders
            last = req.num_computed == known
            need.append(last)
            computed += n - (last and known > req.num_prompt_tokens)
            if last:
                sample.append(req)
                req.num_placeholders += 1
        self.prefill_tokens += computed
        forks = [(i, c) for i, r in enumerate(sample) if r.group is not None
                 for c in self._fork(r)]
        copies: list[tuple[int, int]] = []
        if self._copies:  # those of requests preempted later in this schedule are void
            copies = [(a, b) for r, a, b in self._copies if r.status is Status.RUNNING]
            self._copies = []
        return ScheduledBatch(
            reqs=dec + pre,
            num_cached=cached,
            num_new=[1] * nd + pre_n,
            need_logits=need,
            sample_reqs=sample,
            num_decodes=nd,
            num_tokens=nd + sum(pre_n),
            preempted=preempted,
            block_copies=copies,
            forks=forks,
            admissions=self.num_admitted,
        )

    def _fork(self, req: Request) -> list[Request]:
        """Fork `req`'s unforked siblings (it draws its first token this step); they run from
        now on, after it."""
        children = fork_all(req, self.bm, self.num_admitted)
        self.num_admitted += len(children)
        self.running += children
        return children

    def _own_tail(self, req: Request) -> bool:
        """Copy on write of the shared block `req`'s next token goes into (planned for this
        step); False, changing nothing, when no block is free."""
        got = own_tail(req, self.bm)
        if got is False:
            return False
        if got is not None:
            self._copies.append((req, *got))
        return True

    def _release_row(self, req: Request) -> None:
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1
        req.synced_blocks = 0
        for child in waiting_on(req):  # the slots reserved for its unforked siblings
            if child.row >= 0:
                self._free_rows.append(child.row)
                child.row = -1

    def _preempt(self, req: Request) -> None:
        """Recompute-preemption: drop the KV blocks (those its launched steps fill stay in the
        prefix cache), keep tokens and embeddings."""
        self._keep(req)
        self.bm.free(req.block_ids)
        self._release_row(req)
        req.num_computed = req.num_hashed = 0
        req.shared_tail = False
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def pause(self, req: Request) -> None:
        """Hold `req` out of scheduling (nobody takes its output): a running request is
        preempted by recompute (KV blocks freed, tokens kept, drawn again identically); it stays
        queued, skipped by admission, until `resume`."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._preempt(req)
        self.paused.add(req)

    def resume(self, req: Request) -> None:
        """Let a paused request be admitted again (from its place at the queue's front)."""
        self.paused.discard(req)

    def _queued(self) -> list[Request]:  # the waiting requests admission may take
        return [r for r in self.waiting if r not in self.paused] if self.paused else self.waiting

    def update(self, batch: ScheduledBatch, sampled: list[int],
               now: float) -> list[Request]:
        """Account a step's drawn tokens (one per `batch.drawn_reqs`, in order): each takes
        its placeholder's place; the requests that stop are finished (a stop token counts only
        past `min_tokens`). Requests finished meanwhile are skipped. Blocks the step filled are
        first offered to the prefix cache. Returns the finished."""
        if self.bm.enable_caching:
            self._commit(batch)
        done: list[Request] = []
        for req, tok in zip(batch.drawn_reqs, sampled, strict=True):
            if not req.num_placeholders:  # finished (or preempted and ended) meanwhile
                continue
            req.num_placeholders -= 1
            toks = req.token_ids
            toks.append(tok)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            n = len(toks)
            if tok in req.stop_ids and n > req.min_len:
                reason = "stop"
                req.stop_reason = tok if tok in req.params.stop_token_ids else None
            elif n >= req.limit_len:
                reason = "length"
            else:
                continue
            # a running request leaves `running` below; one preempted meanwhile is waiting
            self.finish(req, reason, prune=req.status is not Status.RUNNING)
            done.append(req)
        if done:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return done

    def _commit(self, batch: ScheduledBatch) -> None:
        """Offer the blocks each request of a finished step filled to the prefix cache."""
        for req, c, n in zip(batch.reqs, batch.num_cached, batch.num_new, strict=True):
            if req.status is Status.RUNNING:  # else its blocks are gone (or were offered)
                commit_upto(self.bm, req, c + n)

    def _keep(self, req: Request) -> None:
        """Before `req` lets its blocks go: offer every block its launched steps fill (steps
        not read back yet included: any later reader runs after them) to the prefix cache."""
        if self.bm.enable_caching and req.status is Status.RUNNING and req.block_ids:
            commit_upto(self.bm, req, req.num_computed)

    def finish(self, req: Request, reason: str, error: str | None = None, *,
               prune: bool = True) -> None:
        """End `req` (any state): free its blocks and slot, drop it from the queues."""
        if req.status is Status.FINISHED:
            return
        self.paused.discard(req)
        if prune:
            if req.status is Status.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
        if req.block_ids:
            if reason != "error":  # a failed step may not have written its blocks
                self._keep(req)
            self.bm.free(req.block_ids)
        self._release_row(req)
        req.shared_tail = False
        req.num_placeholders = 0  # draws still in flight are dropped
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error

    def check_idle(self) -> None:
        """Raise AssertionError unless no request, slot or block is held."""
        assert not self.waiting and not self.running, "requests still queued"
        assert len(self._free_rows) == self.max_num_seqs, "a sequence slot is still held"
        self.bm.check_all_free()
