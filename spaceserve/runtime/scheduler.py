"""Continuous batching with chunked prefill under a per-step token budget.

Every step the scheduler first continues the running requests in admission order (one token for
a decoding request, the next prefill chunk for one still prefilling), then admits waiting
requests first-come first-served while the token budget, the sequence slots and the KV blocks
last. When a running request needs a KV block and none is free, the most recently admitted
running request is preempted by recompute: its blocks are freed, its cached-token count reset,
and it goes back to the front of the waiting queue with its prompt and generated tokens (and its
image embeddings), to be prefilled again later. Sampling draws depend only on (seed, index), so
recomputation reproduces the same tokens.

With prefix caching (the block manager's), a request being admitted first takes the longest
chain of committed blocks its tokens name (`prefix_cache.block_hashes`), always leaving at least
its last token to compute, and prefills only the rest; M-RoPE positions come from the whole
prompt's table, so a chunk starting past the prefix gets the same positions it would have had.
It is admitted only when its media from that point on have embeddings (`is_ready(req, start)`;
items wholly inside the prefix need none). After every step the blocks it filled are committed
to the cache, so they outlive it: a preempted, finished or aborted request's computed blocks
stay for the next request with the same prefix until evicted.

Parallel sampling (``n`` > 1): only the first sequence is queued; the others wait on it
(``req.forks``, their sequence slots reserved at its admission). In the step that computes its
last prompt token each of them draws its own first token from the same logits row
(`ScheduledBatch.forks`) and takes a reference on every prompt block (`BlockManager.fork`), so
the prompt is prefilled once. A partial last prompt block stays shared until a holder writes
into it: that holder gets a copy first (copy on write, `ScheduledBatch.block_copies`, which the
runner applies before the step's forward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .prefix_cache import block_hashes, max_match_blocks
from .request import Request, Status


@dataclass
class ScheduledBatch:
    """One step's work, in batch order: single-token (decode) sequences first, then prefill
    chunks. Sequence ``i`` computes tokens ``num_cached[i] .. num_cached[i] + num_new[i] - 1``
    of ``reqs[i].token_ids``; `sample_reqs` (batch order) are those whose last new token ends
    their known tokens, so a next token is drawn for each."""

    reqs: list[Request] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    need_logits: list[bool] = field(default_factory=list)
    sample_reqs: list[Request] = field(default_factory=list)
    num_decodes: int = 0
    num_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # sequences forked in this step: (row of `sample_reqs` whose logits they sample, sequence)
    forks: list[tuple[int, Request]] = field(default_factory=list)
    # KV blocks to copy (source, destination) before the step runs (copy on write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)


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
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
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
        self._copies: list[tuple[Request, int, int]] = []  # this step's copy-on-write blocks

    def peek_cached(self, req: Request) -> int:
        """Tokens of `req` the prefix cache holds now (nothing taken; 0 with caching off)."""
        bm = self.bm
        if not bm.enable_caching:
            return 0
        bs = bm.block_size
        limit = max_match_blocks(req, bs)
        return bm.peek(block_hashes(req, bs, limit * bs), limit) * bs

    def _match(self, req: Request) -> None:
        """Give a waiting request (nothing computed) its cached prefix blocks."""
        bm = self.bm
        if not bm.enable_caching or req.num_computed:
            return
        bs = bm.block_size
        limit = max_match_blocks(req, bs)
        got = bm.match(block_hashes(req, bs, limit * bs), limit)
        if got:
            req.block_ids = got
            req.num_hashed = len(got)
            req.num_computed = len(got) * bs

    def _unmatch(self, req: Request) -> None:
        if req.block_ids:
            self.bm.free(req.block_ids)
        req.num_computed = req.num_hashed = 0

    def add(self, req: Request) -> None:
        """Queue a validated request (its prompt fits the context and the cache)."""
        req.status = Status.WAITING
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)
        req.limit_len = min(req.num_prompt_tokens + p.max_tokens, self.max_model_len)
        for child in req.forks:
            child.status, child.stop_ids, child.limit_len = Status.WAITING, req.stop_ids, \
                req.limit_len
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and give them the KV blocks their new tokens need."""
        bm, bs = self.bm, self.bm.block_size
        budget = self.max_num_batched_tokens
        running = self.running
        dec: list[Request] = []
        pre: list[Request] = []
        pre_n: list[int] = []
        preempted: list[Request] = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            known = len(req.token_ids)
            n = known - req.num_computed
            if n > budget:
                n = budget
            total = req.num_computed + n
            if len(req.block_ids) * bs < total or req.shared_tail:
                while not (self._own_tail(req) and bm.ensure(req.block_ids, total)):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    break
            if n == 1 and total == known:
                dec.append(req)
            else:
                pre.append(req)
                pre_n.append(n)
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, dec, pre, pre_n)
        return self._batch(dec, pre, pre_n, preempted)

    def _admit(self, budget: int, dec: list[Request], pre: list[Request],
               pre_n: list[int]) -> int:
        waiting, bm = self.waiting, self.bm
        j = 0
        while j < len(waiting) and budget > 0 and self._free_rows:
            req = waiting[j]
            if len(req.forks) >= len(self._free_rows):
                break  # its forks need sequence slots too
            self._match(req)
            if not self.is_ready(req, req.num_computed):
                self._unmatch(req)
                j += 1
                continue
            known = len(req.token_ids)
            n = min(known - req.num_computed, budget)
            if not bm.ensure(req.block_ids, req.num_computed + n):
                self._unmatch(req)
                break
            self.prefix_queried_tokens += known
            self.prefix_hit_tokens += req.num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed
            del waiting[j]
            req.status = Status.RUNNING
            req.row = self._free_rows.pop()
            req.synced_blocks = 0
            for child in req.forks:
                child.row = self._free_rows.pop()
            self.running.append(req)
            if n == 1 and req.num_computed + 1 == known:
                dec.append(req)
            else:
                pre.append(req)
                pre_n.append(n)
            budget -= n
        return budget

    def _own_tail(self, req: Request) -> bool:
        """Copy on write: give `req` its own copy of the shared block its next token goes
        into; False when no block is free."""
        if not req.shared_tail:
            return True
        idx = req.num_computed // self.bm.block_size
        got = self.bm.make_writable(req.block_ids, idx)
        if got is False:
            return False
        if got is not None:
            self._copies.append((req, got[0], got[1]))
            req.synced_blocks = min(req.synced_blocks, idx)
        req.shared_tail = False
        return True

    def _batch(self, dec: list[Request], pre: list[Request], pre_n: list[int],
               preempted: list[Request]) -> ScheduledBatch:
        nd = len(dec)
        reqs = dec + pre
        sample = list(dec)
        need = [True] * nd
        computed = 0
        for req in dec:  # a lone token: prefill work only when it is not the newest output
            if len(req.token_ids) <= req.num_prompt_tokens:
                computed += 1
        for req, n in zip(pre, pre_n, strict=True):
            known = len(req.token_ids)
            last = req.num_computed + n == known
            need.append(last)
            computed += n - (last and known > req.num_prompt_tokens)
            if last:
                sample.append(req)
        self.prefill_tokens += computed
        forks = [(i, child) for i, r in enumerate(sample) if r.forks for child in r.forks]
        copies: list[tuple[int, int]] = []
        if self._copies:  # only those of requests still running (not preempted meanwhile)
            copies = [(a, b) for r, a, b in self._copies if r.status is Status.RUNNING]
            self._copies = []
        return ScheduledBatch(
            reqs=reqs,
            num_cached=[r.num_computed for r in reqs],
            num_new=[1] * nd + pre_n,
            need_logits=need,
            sample_reqs=sample,
            num_decodes=nd,
            num_tokens=nd + sum(pre_n),
            preempted=preempted,
            forks=forks,
            block_copies=copies,
        )

    def _release_row(self, req: Request) -> None:
        if req.row >= 0:
            self._free_rows.append(req.row)
            req.row = -1
        req.synced_blocks = 0
        for child in req.forks:  # the slots reserved for its forks
            if child.row >= 0:
                self._free_rows.append(child.row)
                child.row = -1

    def _preempt(self, req: Request) -> None:
        """Recompute-preemption: drop the KV blocks, keep tokens and embeddings."""
        self.bm.free(req.block_ids)
        self._release_row(req)
        req.num_computed = req.num_hashed = 0
        req.shared_tail = False
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def update(self, batch: ScheduledBatch, sampled: list[int],
               now: float) -> list[Request]:
        """Account a finished step: advance cached counts, append the sampled tokens (one per
        `batch.sample_reqs`), finish the requests that stop. Returns the finished requests."""
        if self.bm.enable_caching:
            self._commit(batch)
        nd = batch.num_decodes
        for req, n, last in zip(batch.reqs[nd:], batch.num_new[nd:], batch.need_logits[nd:],
                                strict=True):
            if not last:  # a prefill chunk short of the end; sampled requests follow below
                req.num_computed += n
        done: list[Request] = []
        pairs = zip(batch.sample_reqs, sampled[:len(batch.sample_reqs)], strict=True)
        if batch.forks:
            children = [self._fork(batch.sample_reqs[i], c) for i, c in batch.forks]
            pairs = list(pairs) + list(zip(children, sampled[len(batch.sample_reqs):],
                                           strict=True))
        for req, tok in pairs:
            toks = req.token_ids
            req.num_computed = len(toks)  # a sampled request has computed all it knew
            toks.append(tok)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            if tok in req.stop_ids:
                reason = "stop"
            elif len(toks) >= req.limit_len:
                reason = "length"
            else:
                continue
            self.finish(req, reason, prune=False)
            done.append(req)
        if done:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return done

    def _fork(self, req: Request, child: Request) -> Request:
        """Start `child` (one of `req`'s n sequences) on `req`'s prompt blocks, all computed."""
        if child in req.forks:
            req.forks.remove(child)
        bs = self.bm.block_size
        n = req.num_prompt_tokens
        child.block_ids = self.bm.fork(req.block_ids[:self.bm.blocks_for(n)])
        child.num_computed = n
        child.block_hashes = list(req.block_hashes[:n // bs])
        child.num_hashed = min(req.num_hashed, n // bs)
        child.model_state = req.model_state
        child.num_cached_tokens = req.num_cached_tokens
        child.synced_blocks = 0
        child.status = Status.RUNNING
        if n % bs:
            req.shared_tail = child.shared_tail = True
        self.running.append(child)
        return child

    def _commit(self, batch: ScheduledBatch) -> None:
        """Offer the blocks each request of a finished step filled to the prefix cache."""
        bm = self.bm
        bs = bm.block_size
        for req, c, n in zip(batch.reqs, batch.num_cached, batch.num_new, strict=True):
            full = (c + n) // bs
            if full <= req.num_hashed or req.status is not Status.RUNNING:
                continue  # nothing new, or its blocks are gone (preempted or ended meanwhile)
            full = min(full, len(req.block_ids))
            bm.commit(req.block_ids, block_hashes(req, bs, full * bs), req.num_hashed, full)
            req.num_hashed = full

    def finish(self, req: Request, reason: str, error: str | None = None, *,
               prune: bool = True) -> None:
        """End `req` (any state): free its blocks and slot, drop it from the queues."""
        if req.status is Status.FINISHED:
            return
        if prune:
            if req.status is Status.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
        if req.block_ids:
            self.bm.free(req.block_ids)
        self._release_row(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error

    def check_idle(self) -> None:
        """Raise AssertionError unless no request, slot or block is held."""
        assert not self.waiting and not self.running, "requests still queued"
        assert len(self._free_rows) == self.max_num_seqs, "a sequence slot is still held"
        self.bm.check_all_free()
