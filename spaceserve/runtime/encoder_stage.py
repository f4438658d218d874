"""The encoder stage: turns a request's images into embeddings before its first prefill.

The engine talks to the stage through four calls (`submit`, `step`, `ready`, `release`), so the
temporal stage here can be replaced by a spatial one (encoder kernels on their own SM partition
and stream, ordered by TWSRFT) without touching the scheduler loop.

`TemporalEncoderStage` is the baseline of time multiplexing: at the start of an engine step it
runs the vision encoder on the whole GPU for the oldest pending requests, and the step's decode
work waits until it is done. Embeddings stay with the request until it finishes or is aborted,
because a request preempted by recompute needs them again.

With a data-parallel encoder (a tensor-parallel runner whose ``encoder_ranks`` > 1) each step's
batch is divided between the ranks by predicted cost (`encoder_dp.assign_ranks`, longest
first), every rank encodes its share at once and the runner shares the embeddings; the step's
token bound then applies per rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from .encoder_dp import assign_ranks
from .request import Request, Status
from .runner import ModelRunner


def release_encoding(runner: ModelRunner, req: Request) -> None:
    """Tell a runner that keeps per-request encoder state elsewhere (a tensor-parallel group's
    workers) that `req` ended; runners without ``release_encoding`` keep nothing."""
    release = getattr(runner, "release_encoding", None)
    if release is not None:
        release(req.mm)


class EncoderStage(Protocol):
    """What the engine needs from an encoder stage."""

    def submit(self, req: Request) -> None:
        """Queue the images of a newly arrived request."""
        ...

    def step(self) -> list[tuple[Request, str]]:
        """Make encoder progress; returns the requests whose images failed, with a message."""
        ...

    def ready(self, req: Request) -> bool:
        """Whether `req` can be prefilled (no images, or its embeddings exist)."""
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


class TemporalEncoderStage:
    """Encode synchronously on the whole device, oldest requests first.

    Per step at most `max_tokens_per_step` image tokens are encoded per encoding rank (always
    at least one request), and no new request is encoded while `max_held` requests hold
    embeddings, which bounds embedding memory when image requests queue up. `cost(patches)`
    predicts a request's encoder seconds (TWSRFT's cost model), which a data-parallel encoder
    balances over its ranks (default: proportional to the patches).
    """

    def __init__(self, runner: ModelRunner, *, max_tokens_per_step: int = 16384,
                 max_held: int = 64, cost: Callable[[int], float] | None = None) -> None:
        for name, value in (("max_tokens_per_step", max_tokens_per_step),
                            ("max_held", max_held)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.runner = runner
        self.max_tokens_per_step = max_tokens_per_step
        self.max_held = max_held
        self.ranks = int(getattr(runner, "encoder_ranks", 1))
        self.cost = cost if cost is not None else float
        self._pending: deque[Request] = deque()
        self._held: set[str] = set()

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        return sum(1 for r in self._pending if r.status is not Status.FINISHED)

    def submit(self, req: Request) -> None:
        if req.mm is not None and req.mm.embeds is None:
            self._pending.append(req)

    def ready(self, req: Request) -> bool:
        return req.mm is None or req.mm.embeds is not None

    def step(self) -> list[tuple[Request, str]]:
        batch: list[Request] = []
        tokens = 0
        while self._pending and len(self._held) + len(batch) < self.max_held:
            req = self._pending[0]
            if req.status is Status.FINISHED:  # aborted while queued
                self._pending.popleft()
                continue
            if batch and tokens + req.mm.num_tokens > self.max_tokens_per_step * self.ranks:
                break
            batch.append(self._pending.popleft())
            tokens += req.mm.num_tokens
        if not batch:
            return []
        if self.ranks > 1:  # failures come back in their request's place
            costs = [self.cost(int(r.mm.pixel_values.shape[0])) for r in batch]
            ranks = assign_ranks(costs, self.ranks)
            return self._store(batch, self.runner.encode([r.mm for r in batch], ranks=ranks))
        try:
            return self._store(batch, self.runner.encode([r.mm for r in batch]))
        except Exception:  # isolate the failing request(s): retry one by one
            pass
        failed: list[tuple[Request, str]] = []
        for req in batch:
            try:
                failed += self._store([req], self.runner.encode([req.mm]))
            except Exception as exc:  # reported on the request, the others go on
                failed.append((req, f"image encoding failed: {type(exc).__name__}: {exc}"))
        return failed

    def _store(self, batch: list[Request], embeds: list) -> list[tuple[Request, str]]:
        if len(embeds) != len(batch):
            raise RuntimeError(f"encoder returned {len(embeds)} results for {len(batch)}")
        failed = []
        for req, emb in zip(batch, embeds, strict=True):
            if isinstance(emb, Exception):
                failed.append((req, f"image encoding failed: {type(emb).__name__}: {emb}"))
                continue
            if emb.dim() != 2 or emb.shape[0] != req.mm.num_tokens:
                failed.append((req, f"encoder returned shape {tuple(emb.shape)} for "
                                    f"{req.mm.num_tokens} image tokens"))
                continue
            req.mm.embeds = emb
            self._held.add(req.request_id)
        return failed

    def release(self, req: Request) -> None:
        if req.mm is not None:
            req.mm.embeds = None
            release_encoding(self.runner, req)
        self._held.discard(req.request_id)
