"""The encoder stage: turns a request's images into embeddings before its first prefill.

The engine talks to the stage through four calls (`submit`, `step`, `ready`, `release`), so the
temporal stage here can be replaced by a spatial one (encoder kernels on their own SM partition
and stream, ordered by TWSRFT) without touching the scheduler loop. Both look media items up
in the encoder cache first (`encoder_cache.MediaTracker`): a request whose items are all cached,
or whose media tokens all lie in the prefix cache, never becomes an encoder job.

`TemporalEncoderStage` is the baseline of time multiplexing: at the start of an engine step it
runs the vision encoder on the whole GPU for the oldest pending requests, and the step's decode
work waits until it is done. Embeddings stay with the request until it finishes or is aborted,
because a request preempted by recompute needs them again (unless the prefix cache holds its
tokens by then).

With a data-parallel encoder (a tensor-parallel runner whose ``encoder_ranks`` > 1) each step's
batch of jobs - each over a request's items that neither cache holds - is divided between the
ranks by predicted cost (`encoder_dp.assign_ranks`, longest first), every rank encodes its share
at once and the runner shares the embeddings, which the encoder cache then splits into one entry
per item; the step's token bound then applies per rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from spaceserve.checks import require_int
from spaceserve.runtime.core.request import MultiModalData, Request
from spaceserve.runtime.encoder.cache import EncoderCache, MediaTracker
from spaceserve.runtime.encoder.data_parallel import assign_ranks
from spaceserve.runtime.worker.protocol import ModelRunner


def release_encoding(runner: ModelRunner, mm: MultiModalData | None) -> None:
    """Tell a runner that keeps per-job encoder state elsewhere (a tensor-parallel group's
    workers) that the job of `mm` is over; runners without ``release_encoding`` keep nothing."""
    release = getattr(runner, "release_encoding", None)
    if release is not None and mm is not None:
        release(mm)


class EncoderStage(Protocol):
    """What the engine needs from an encoder stage."""

    media: MediaTracker

    def submit(self, req: Request, covered: int = 0) -> None:
        """Queue the media of a newly arrived request; items whose tokens all lie below
        `covered` (the prefix cache holds them) need no encoding."""
        ...

    def step(self) -> list[tuple[Request, str]]:
        """Make encoder progress; returns the requests whose media failed, with a message."""
        ...

    def ready(self, req: Request, start: int = 0) -> bool:
        """Whether `req` can be prefilled from token `start`: every media item with a token
        there or later has embeddings. When one has none and no job is computing it, a job is
        queued for it (the prefix cache held less than expected, or the request was preempted)."""
        ...

    def release(self, req: Request) -> None:
        """Drop `req`'s embeddings and pending work (finish or abort)."""
        ...

    @property
    def num_held(self) -> int:
        ...

    @property
    def num_pending(self) -> int:
        ...


@dataclass
class _Job:
    """A request's pending encoder job: the items it computes and their media."""

    req: Request
    items: list[int]
    mm: MultiModalData


class TemporalEncoderStage:
    """Encode synchronously on the whole device, oldest requests first.

    Per step at most `max_tokens_per_step` media tokens are encoded per encoding rank (always
    at least one request), and no new request is encoded while `max_held` requests hold
    embeddings they computed, which bounds embedding memory when image requests queue up. Items
    the encoder cache (`cache`) or the prefix cache already has are never encoded.
    `cost(patches)` predicts a job's encoder seconds (TWSRFT's cost model), which a
    data-parallel encoder balances over its ranks (default: proportional to the patches).
    """

    def __init__(self, runner: ModelRunner, *, max_tokens_per_step: int = 16384,
                 max_held: int = 64, cache: EncoderCache | None = None,
                 cost: Callable[[int], float] | None = None) -> None:
        for name, value in (("max_tokens_per_step", max_tokens_per_step),
                            ("max_held", max_held)):
            require_int(name, value)
        self.runner = runner
        self.max_tokens_per_step = max_tokens_per_step
        self.max_held = max_held
        self.ranks = int(getattr(runner, "encoder_ranks", 1))
        self.cost = cost if cost is not None else float
        self.media = MediaTracker(cache if cache is not None else EncoderCache(0), runner)
        self._pending: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # request seq_no -> its queued job
        self._held: set[int] = set()

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def submit(self, req: Request, covered: int = 0) -> None:
        missing = self.media.open(req, covered)
        if missing:
            self._queue(req, missing)

    def _queue(self, req: Request, items: list[int]) -> None:
        job = _Job(req, items, self.media.job(req, items))
        self._jobs[req.seq_no] = job
        self._pending.append(job)

    def ready(self, req: Request, start: int = 0) -> bool:
        if self.media.ready(req, start):
            return True
        if req.seq_no in self._jobs:
            return False
        missing = self.media.missing(req, start)
        if missing:
            self._queue(req, missing)
        return self.media.ready(req, start)

    def step(self) -> list[tuple[Request, str]]:
        batch: list[_Job] = []
        tokens = 0
        while self._pending and len(self._held) + len(batch) < self.max_held:
            job = self._pending[0]
            if self._jobs.get(job.req.seq_no) is not job:  # released while queued
                self._pending.popleft()
                continue
            if batch and tokens + job.mm.num_tokens > self.max_tokens_per_step * self.ranks:
                break
            batch.append(self._pending.popleft())
            tokens += job.mm.num_tokens
        if not batch:
            return []
        if self.ranks > 1:  # failures come back in their job's place
            costs = [self.cost(int(j.mm.pixel_values.shape[0])) for j in batch]
            ranks = assign_ranks(costs, self.ranks)
            return self._store(batch, self.runner.encode([j.mm for j in batch], ranks=ranks))
        try:
            return self._store(batch, self.runner.encode([j.mm for j in batch]))
        except Exception:  # isolate the failing request(s): retry one by one
            pass
        failed: list[tuple[Request, str]] = []
        for job in batch:
            try:
                failed += self._store([job], self.runner.encode([job.mm]))
            except Exception as exc:  # reported on the request, the others go on
                self._jobs.pop(job.req.seq_no, None)
                self.media.done(job.mm)
                release_encoding(self.runner, job.mm)
                failed.append((job.req, f"image encoding failed: {type(exc).__name__}: {exc}"))
        return failed

    def _store(self, batch: list[_Job], embeds: list) -> list[tuple[Request, str]]:
        if len(embeds) != len(batch):
            raise RuntimeError(f"encoder returned {len(embeds)} results for {len(batch)}")
        failed = []
        for job, emb in zip(batch, embeds, strict=True):
            req = job.req
            self._jobs.pop(req.seq_no, None)
            if isinstance(emb, Exception):  # a data-parallel owner's failure, in its place
                self.media.done(job.mm)
                release_encoding(self.runner, job.mm)
                failed.append((req, f"image encoding failed: {type(emb).__name__}: {emb}"))
                continue
            msg = self.media.store(req, job.items, job.mm, emb)
            if msg is not None:
                release_encoding(self.runner, job.mm)
                failed.append((req, msg))
                continue
            self._held.add(req.seq_no)
        return failed

    def release(self, req: Request) -> None:
        job = self._jobs.pop(req.seq_no, None)
        if job is not None:
            self.media.done(job.mm)
            release_encoding(self.runner, job.mm)
        self.media.drop(req)
        self._held.discard(req.seq_no)
