"""TWSRFT: time-windowed shortest-remaining-first ordering of vision-encoder work.

The encoder stage runs one job at a time. A job is a batch of images at one layer depth (images
at different depths cannot share a launch); new images start as one-image jobs at depth 0 and are
batched, up to a token budget, with other waiting jobs at the same depth when one of them is
picked. Each scheduling round the engine asks for a grant: a job and a number of layers to run
that lasts about one time window. At the end of a grant (a layer boundary) the choice is
retaken, so a long job yields when a shorter one waits, and resumes later at the depth it
reached.

Which job, without a deadline (``deadline_s`` None): any job that has waited ``max_wait_s`` or
more since it last ran (or arrived) goes first, longest-waiting first (aging: a job waits at most
``max_wait_s`` plus the grant in flight when it gets there, plus the grants of jobs that began
starving before it); otherwise the least remaining work (``cost(patches, layers_left)``,
seconds) - or, under the ``fifo`` policy, the oldest. Ties go to the earlier arrival.

With a deadline (``deadline_s``: the encoder's share of the TTFT SLO), under overload: a job
that can still finish by ``arrival + deadline_s`` (now + its remaining work) is *live*, one that
cannot is *late*. Live jobs go first, least remaining work first (SRPT: the most requests meet
their deadline). Late jobs are demoted: they run when no live job waits, and one aged grant every
``max_wait_s`` (a shared clock, reset at each aged grant) goes to the late job that arrived
first (among those that arrived ``max_wait_s`` ago or more), so a late job finishes in bounded
time without live jobs paying more than one window per ``max_wait_s``. Waits are measured from
arrival (never reset by a grant), so an old job stays old. A bounded tail (opt-in): a job
overdue - past its deadline by more than ``overdue_s`` (None, the default: no such rule) - goes
first, the oldest first, whenever running it to the end first still lets every live job meet its
deadline (the tail is cut from the encoder's slack, never by making a queued live job late); a
request already past its TTFT bound then waits for the first slack instead of trickling through
one aged grant per ``max_wait_s``. It is off by default because the slack it takes is the next
arrivals' (simulated: it cuts the p99 TTFT but costs goodput near saturation). All times come
from the injected ``clock``, so a fake clock makes every decision reproducible.

Entry (`entry`): an encoder stage queues jobs here only while fewer than its held-embedding cap
hold or compute embeddings, the rest waiting in its backlog. Under a deadline the backlog is
entered by it too: the oldest request whose whole encode still fits its deadline goes before
older ones that cannot meet theirs (they follow once none can), so past saturation the cap's
slots do not all go to requests already late, which would leave the deadline nothing live to
order (without admission every request after that would be late).

Batching: a waiting job at the chosen job's depth joins its launch only where that cannot delay
the chosen job - the merged launch costs no more than the chosen job alone (within
``BATCH_TOLERANCE``) - and within ``token_budget``. Under the curves' cost model (and the
engine's one-launch-per-image encoder) a merge never qualifies; a cost model with a flat,
under-occupied region merges small images for free.

Engine loop::

    sched.submit(request_id, patches)          # an image's ViT token count
    grant = sched.next_grant()                 # None when idle
    ...run grant.layers layers from grant.start_layer over grant.request_ids...
    done = sched.report(grant.job_id, grant.layers)   # request ids whose pass completed
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, MutableSequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from spaceserve.checks import require_choice, require_int, require_number
from spaceserve.runtime.modes import ENCODER_POLICIES

T = TypeVar("T")
Cost = Callable[[int, int], float]
POLICIES = ENCODER_POLICIES
BATCH_TOLERANCE = 1e-9  # a merge may cost this fraction more than the chosen job alone


@dataclass(frozen=True)
class Grant:
    """Run `layers` vision layers from `start_layer` over the images of one job."""

    job_id: int
    request_ids: tuple[Hashable, ...]
    patches: int
    start_layer: int
    layers: int


@dataclass(frozen=True)
class JobView:
    """A read-only view of one job, for SIS and metrics."""

    job_id: int
    request_ids: tuple[Hashable, ...]
    patches: int
    depth: int
    layers_left: int
    running: bool
    arrival: float = 0.0


@dataclass
class _Job:
    job_id: int
    images: list[tuple[Hashable, int]]
    depth: int
    seq: int
    wait_since: float  # last grant's end (or arrival): the aging clock without a deadline
    arrival: float  # its oldest image's arrival, never reset: deadlines count from it
    running: bool = False

    @property
    def patches(self) -> int:
        return sum(p for _, p in self.images)


class EncoderCurve(Protocol):
    """What TWSRFT's cost model reads of a `CurveSet` (typed by shape, so the scheduler does
    not import the curves)."""

    def encoder(self, patches: float, layers: float, sms: float,
                corun: bool | float = False) -> float: ...


def curve_cost(curves: EncoderCurve, sms: int | Callable[[], int], corun: bool = True) -> Cost:
    """A cost model from resource-utility curves (a `CurveSet`) at a fixed (or current)
    encoder SM count."""

    def cost(patches: int, layers: int) -> float:
        n = sms() if callable(sms) else sms
        return curves.encoder(patches, layers, n, corun)

    return cost


class TwsrftScheduler:
    """Orders encoder jobs: aging first, then shortest remaining work (or FIFO)."""

    def __init__(self, num_layers: int, cost: Cost, *, policy: str = "twsrft",
                 window_s: float = 0.02, max_wait_s: float = 0.5, token_budget: int = 16384,
                 deadline_s: float | None = None, overdue_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        require_int("num_layers", num_layers)
        require_choice("policy", policy, POLICIES)
        if not window_s > 0:
            raise ValueError(f"window_s must be positive (math.inf = whole jobs), got {window_s}")
        require_number("max_wait_s", max_wait_s)
        require_int("token_budget", token_budget)
        require_number("deadline_s", deadline_s, optional=True)
        if overdue_s is not None and not overdue_s >= 0:
            raise ValueError(f"overdue_s must be >= 0 (math.inf: never), got {overdue_s}")
        self.deadline_s = deadline_s
        self.overdue_s = overdue_s
        self._aged_at = -math.inf  # when the last aged grant (deadline mode) was given
        self.num_layers, self.cost, self.policy = num_layers, cost, policy
        self.window_s, self.max_wait_s, self.token_budget = window_s, max_wait_s, token_budget
        self.clock = clock
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._granted: Grant | None = None

    # -- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        """Whether a grant is outstanding (reported back not yet)."""
        return self._granted is not None

    def jobs(self) -> tuple[JobView, ...]:
        """Every unfinished job, running or waiting, in arrival order."""
        return tuple(JobView(j.job_id, tuple(r for r, _ in j.images), j.patches, j.depth,
                             self.num_layers - j.depth, j.running, j.arrival)
                     for j in sorted(self._jobs.values(), key=lambda j: j.seq))

    def remaining(self, job: _Job | JobView) -> float:
        """Predicted seconds of encoder work left in `job`."""
        depth = job.depth
        return self.cost(job.patches, self.num_layers - depth)

    # -- engine calls ------------------------------------------------------------------------
    def submit(self, request_id: Hashable, patches: int, arrival: float | None = None) -> int:
        """Queue one image of `patches` ViT tokens that arrived at `arrival` (default: now, on
        the scheduler's clock); returns its job id."""
        require_int("patches", patches)
        now = self.clock()
        arrived = now if arrival is None else min(float(arrival), now)
        job = _Job(next(self._ids), [(request_id, patches)], 0, next(self._seq), now, arrived)
        self._jobs[job.job_id] = job
        return job.job_id

    def next_grant(self) -> Grant | None:
        """Pick the job to run next and how many layers; None when nothing waits."""
        if self._granted is not None:
            raise RuntimeError(f"job {self._granted.job_id} still holds a grant; report it first")
        waiting = [j for j in self._jobs.values() if not j.running]
        if not waiting:
            return None
        now = self.clock()
        chosen = self._pick(waiting, now)
        chosen = self._batch(chosen, waiting)
        layers_left = self.num_layers - chosen.depth
        layers = layers_left
        if math.isfinite(self.window_s):
            per_layer = self.cost(chosen.patches, 1)
            if per_layer > 0:
                layers = max(1, min(layers_left, int(self.window_s / per_layer)))
        chosen.running = True
        self._granted = Grant(chosen.job_id, tuple(r for r, _ in chosen.images),
                              chosen.patches, chosen.depth, layers)
        return self._granted

    def report(self, job_id: int, layers_done: int) -> tuple[Hashable, ...]:
        """The granted job ran `layers_done` layers; returns its request ids if it finished."""
        g = self._granted
        if g is None or g.job_id != job_id:
            raise ValueError(f"job_id {job_id} holds no grant")
        if not isinstance(layers_done, int) or not 0 <= layers_done <= g.layers:
            raise ValueError(f"layers_done must be an int in 0..{g.layers}, got {layers_done!r}")
        job = self._jobs[job_id]
        job.depth += layers_done
        job.running = False
        job.wait_since = self.clock()
        self._granted = None
        if job.depth >= self.num_layers:
            del self._jobs[job_id]
            return tuple(r for r, _ in job.images)
        return ()

    def cancel(self, request_id: Hashable) -> bool:
        """Drop `request_id`'s images from the jobs that are not running (admission ended the
        request); a job left without images goes. False when nothing waiting was its."""
        found = False
        for job_id, job in list(self._jobs.items()):
            if job.running or all(r != request_id for r, _ in job.images):
                continue
            found = True
            job.images = [(r, p) for r, p in job.images if r != request_id]
            if not job.images:
                del self._jobs[job_id]
        return found

    def entry(self, waiting: Iterable[tuple[float | None, int]]) -> int:
        """Which of `waiting` - backlogged requests as (arrival, patches), oldest first -
        enters the queue next (module docstring): the first whose whole encode, started now,
        still ends by its arrival + ``deadline_s``; 0 when none can, and always 0 without a
        deadline or under ``fifo`` (arrival order)."""
        if self.deadline_s is None or self.policy == "fifo":
            return 0
        now = self.clock()
        for i, (arrival, patches) in enumerate(waiting):
            arrived = now if arrival is None else min(float(arrival), now)
            if now + self.cost(max(1, patches), self.num_layers) <= arrived + self.deadline_s:
                return i
        return 0

    def take(self, backlog: MutableSequence[T],
             describe: Callable[[T], tuple[float | None, int]]) -> T:
        """Remove and return the item of `backlog` (oldest first) that enters next (`entry`);
        `describe` gives an item's (arrival, patches)."""
        i = self.entry(map(describe, backlog))
        item = backlog[i]
        del backlog[i]
        return item

    # -- policy ------------------------------------------------------------------------------
    def _key(self, job: _Job) -> tuple:
        if self.policy == "fifo":
            return (job.seq,)
        return (self.remaining(job), job.seq)

    def late(self, job: _Job | JobView, now: float) -> bool:
        """Whether `job` can no longer finish by its deadline (never, without one)."""
        if self.deadline_s is None:
            return False
        return now + self.remaining(job) > job.arrival + self.deadline_s

    def _pick(self, waiting: list[_Job], now: float) -> _Job:
        if self.deadline_s is None:
            starving = [j for j in waiting if now - j.wait_since >= self.max_wait_s]
            if starving:
                return min(starving, key=lambda j: (j.wait_since, j.seq))
            return min(waiting, key=self._key)
        late = [j for j in waiting if self.late(j, now)]
        live = sorted((j for j in waiting if not self.late(j, now)), key=self._key)
        due = -math.inf if self.overdue_s is None else now - self.deadline_s - self.overdue_s
        overdue = [j for j in late if j.arrival < due]  # arrived before `due`: overdue
        if overdue:
            oldest = min(overdue, key=lambda j: (j.arrival, j.seq))
            if self._fits(oldest, live, now):
                return oldest
        if not live:
            return min(late, key=self._key)
        starving = [j for j in late if now - j.arrival >= self.max_wait_s]
        if starving and now - self._aged_at >= self.max_wait_s:
            self._aged_at = now  # an aged grant: the next one waits max_wait_s again
            return min(starving, key=lambda j: (j.arrival, j.seq))
        return min(live, key=self._key)

    def _fits(self, job: _Job, live: list[_Job], now: float) -> bool:
        """Whether running `job` to the end first leaves every live job (in SRPT order) still
        able to meet its deadline."""
        t = now + self.remaining(job)
        for j in live:
            t += self.remaining(j)
            if t > j.arrival + self.deadline_s:
                return False
        return True

    def _batch(self, chosen: _Job, waiting: list[_Job]) -> _Job:
        """Merge waiting jobs at the chosen job's depth into it where that cannot delay it (the
        merged launch costs no more than the chosen job alone), up to the token budget."""
        total = chosen.patches
        layers = self.num_layers - chosen.depth
        alone = self.cost(total, layers) * (1.0 + BATCH_TOLERANCE)
        mates = sorted((j for j in waiting if j is not chosen and j.depth == chosen.depth),
                       key=self._key)
        for j in mates:
            if total + j.patches > self.token_budget or \
                    self.cost(total + j.patches, layers) > alone:
                continue
            total += j.patches
            chosen.images.extend(j.images)
            chosen.seq = min(chosen.seq, j.seq)
            chosen.wait_since = min(chosen.wait_since, j.wait_since)
            chosen.arrival = min(chosen.arrival, j.arrival)
            del self._jobs[j.job_id]
        return chosen
