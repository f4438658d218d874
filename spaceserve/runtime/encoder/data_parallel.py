"""A data-parallel vision encoder: which rank of a tensor-parallel group encodes which image.

The ViT is small next to a 72B decoder, so every rank holds all of it and the images are divided
between the ranks instead of its layers (each rank encodes a share; the owner then broadcasts the
embeddings, so every rank holds the full input for prefill). Both encoder stages balance the
*predicted* work per rank with TWSRFT's cost model (``cost(patches, layers)`` seconds):
- the temporal stage encodes a batch at once: `assign_ranks` places its images longest first,
  each on the rank with the least predicted work so far (LPT), which bounds the batch's makespan
  within 4/3 of the best split;
- the spatial stage encodes online and preemptibly: `RankedTwsrft` keeps one TWSRFT queue per
  rank, sends each new job to the rank whose queue has the least predicted work left, and each
  rank runs its own queue shortest-remaining-first (aging as in `twsrft.py`); idle ranks take
  turns;
- the simulator, whose GPU has one encoder lane, runs those queues in rounds (`RoundTwsrft`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, MutableSequence, Sequence
from typing import Any

from spaceserve.checks import require_int
from spaceserve.runtime.policy.twsrft import Grant, JobView, T, TwsrftScheduler


class EncodingFailed(RuntimeError):
    """An image's encoding failed on the rank that owned it (reported on its request; the
    other requests and ranks carry on)."""


def assign_ranks(costs: Sequence[float], ranks: int, loads: Sequence[float] | None = None
                 ) -> list[int]:
    """The rank of each item: longest predicted cost first, onto the least loaded rank (ties:
    the lower rank); `loads` are the ranks' predicted work already queued (default none)."""
    require_int("ranks", ranks)
    load = list(loads) if loads is not None else [0.0] * ranks
    if len(load) != ranks:
        raise ValueError(f"loads has {len(load)} entries for {ranks} ranks")
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


class RankedTwsrft:
    """One `TwsrftScheduler` per rank (module docstring). Every method names the rank it acts
    on; `submit` without a rank picks the least loaded one. With one rank it is a plain TWSRFT
    queue."""

    def __init__(self, ranks: int, num_layers: int, cost: Callable[[int, int], float],
                 **kwargs: Any) -> None:
        require_int("ranks", ranks)
        self.ranks = ranks
        self.scheds = [TwsrftScheduler(num_layers, cost, **kwargs) for _ in range(ranks)]
        self._rank_of: dict[Hashable, int] = {}
        self.submitted = [0] * ranks  # images queued on each rank so far

    @property
    def num_layers(self) -> int:
        return self.scheds[0].num_layers

    def __len__(self) -> int:
        return sum(len(s) for s in self.scheds)

    def load(self, rank: int) -> float:
        """Predicted seconds of encoder work queued on `rank` (granted layers excluded)."""
        s = self.scheds[rank]
        return sum(s.remaining(j) for j in s.jobs())

    def pick(self) -> int:
        """The rank with the least predicted work left; ties (idle ranks) go to the rank given
        the fewest images so far, then the lower rank."""
        return min(range(self.ranks), key=lambda r: (self.load(r), self.submitted[r], r))

    def submit(self, request_id: Hashable, patches: int, rank: int | None = None, *,
               arrival: float | None = None) -> int:
        """Queue an image that arrived at `arrival` (None: now) on `rank` (None: `pick`);
        returns the rank."""
        r = self.pick() if rank is None else rank
        if not 0 <= r < self.ranks:
            raise ValueError(f"rank={r} is outside 0..{self.ranks - 1}")
        self.scheds[r].submit(request_id, patches, arrival)
        self._rank_of[request_id] = r
        self.submitted[r] += 1
        return r

    def entry(self, waiting: Iterable[tuple[float | None, int]]) -> int:
        """Which backlogged request enters next (`TwsrftScheduler.entry`; every rank orders
        alike)."""
        return self.scheds[0].entry(waiting)

    def take(self, backlog: MutableSequence[T],
             describe: Callable[[T], tuple[float | None, int]]) -> T:
        """Remove and return the backlogged item that enters next (`TwsrftScheduler.take`)."""
        return self.scheds[0].take(backlog, describe)

    def rank_of(self, request_id: Hashable) -> int | None:
        return self._rank_of.get(request_id)

    def ready(self, rank: int) -> bool:
        """Whether `rank` has a job waiting and no grant outstanding."""
        s = self.scheds[rank]
        return len(s) > 0 and not s.busy

    def next_grant(self, rank: int = 0) -> Grant | None:
        return self.scheds[rank].next_grant()

    def report(self, job_id: int, layers: int, rank: int = 0) -> tuple[Hashable, ...]:
        done = self.scheds[rank].report(job_id, layers)
        for rid in done:
            self._rank_of.pop(rid, None)
        return done

    def jobs(self) -> tuple[JobView, ...]:
        """Every unfinished job of every rank (rank by rank, each in arrival order)."""
        return tuple(j for s in self.scheds for j in s.jobs())


class RoundTwsrft:
    """A data-parallel encoder seen as one encoder lane (the simulator's): `RankedTwsrft`'s
    queues granted together. A grant is a *round* - every rank with work takes its own TWSRFT
    grant at once - and its `patches` and `layers` are those of the slowest member, so the
    lane's cost model prices the round at the time it lasts. Reporting the round reports each
    member for as many of its layers as fit in the time the round ran. A rank done early waits
    for the round's end: pessimistic for data parallelism by at most one grant (about a time
    window) per round. The `TwsrftScheduler` interface the simulator uses."""

    def __init__(self, ranks: int, num_layers: int, cost: Callable[[int, int], float],
                 **kwargs: Any) -> None:
        self.ranked = RankedTwsrft(ranks, num_layers, cost, **kwargs)
        self.cost = cost
        self._round: tuple[Grant, list[tuple[int, Grant]]] | None = None
        self._ids = itertools.count()

    @property
    def num_layers(self) -> int:
        return self.ranked.num_layers

    @property
    def busy(self) -> bool:
        return self._round is not None

    def __len__(self) -> int:
        return len(self.ranked)

    def jobs(self) -> tuple[JobView, ...]:
        return self.ranked.jobs()

    def remaining(self, job: JobView) -> float:
        return self.cost(job.patches, self.num_layers - job.depth)

    def submit(self, request_id: Hashable, patches: int, arrival: float | None = None) -> int:
        """Queue an image (arrived at `arrival`, None: now) on the least loaded rank; returns
        the rank."""
        return self.ranked.submit(request_id, patches, arrival=arrival)

    def next_grant(self) -> Grant | None:
        if self._round is not None:
            raise RuntimeError("a round is outstanding; report it first")
        members = [(r, g) for r in range(self.ranked.ranks) if self.ranked.ready(r)
                   and (g := self.ranked.next_grant(r)) is not None]
        if not members:
            return None
        slow = max((g for _, g in members), key=lambda g: self.cost(g.patches, g.layers))
        ids = tuple(rid for _, g in members for rid in g.request_ids)
        grant = Grant(next(self._ids), ids, slow.patches, slow.start_layer, slow.layers)
        self._round = (grant, members)
        return grant

    def report(self, job_id: int, layers_done: int) -> tuple[Hashable, ...]:
        if self._round is None or self._round[0].job_id != job_id:
            raise ValueError(f"job_id {job_id} holds no grant")
        grant, members = self._round
        self._round = None
        ran = self.cost(grant.patches, layers_done)  # the round's seconds
        done: list[Hashable] = []
        for rank, g in members:
            n = g.layers
            if layers_done < grant.layers:
                per = self.cost(g.patches, 1)
                n = min(g.layers, int(ran / per + 1e-9)) if per > 0 else g.layers
            done += self.ranked.report(g.job_id, n, rank)
        return tuple(done)
