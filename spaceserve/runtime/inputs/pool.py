"""Worker threads for input preprocessing that a flood of heavy requests cannot starve.

Two lanes, each with its own threads and a bounded queue: "light" (text-only prompts, image
header reads: bounded, cheap work) and "heavy" (image decoding and preprocessing), so a small
request never waits behind giant ones. Within a lane the next job is the one with the least
cost, discounted by how long it has waited (`aging_s`: a job's cost counts half after it has
waited that long, a third after twice that...), so small jobs pass big ones without starving
them. A full queue refuses at once (`QueueFull`, with a retry hint); every job has a deadline:
one still queued at its deadline is dropped, and the awaiting side stops waiting then
(`DeadlineExceeded`); a running job is asked to stop (its caller gave up, or its deadline
passed) and does at its next `cancel_point`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from spaceserve.checks import require_int

LANES = ("light", "heavy")
SERVICE_ALPHA = 0.1  # weight of the newest job in a lane's moving average of job time


class QueueFull(RuntimeError):
    """A lane's queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(TimeoutError):
    """A job did not finish before its deadline."""


class JobFuture(Future):
    """A job's Future whose ``cancel()`` also asks a running job to stop (`stop`, read by
    `cancel_point`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    def cancel(self) -> bool:
        self.stop.set()
        return super().cancel()


@dataclass
class _Job:
    fn: Callable[[], Any]
    cost: float
    deadline: float
    seq: int
    queued_at: float = field(default_factory=time.monotonic)
    future: JobFuture = field(default_factory=JobFuture)


_current = threading.local()  # the job a worker thread runs


def cancel_point() -> None:
    """Raise DeadlineExceeded when the pool job running on this thread was given up (its
    deadline passed, or its caller cancelled it): long preprocessing steps call this between
    pieces of work so a worker stops soon after its request ended. A no-op off the pool."""
    job = getattr(_current, "job", None)
    if job is not None and (job.future.stop.is_set() or time.monotonic() > job.deadline):
        raise DeadlineExceeded("preprocessing was given up (deadline passed or request ended)")


class _Lane:
    def __init__(self, name: str, workers: int, max_queue: int, aging_s: float) -> None:
        self.name, self.max_queue, self.aging_s = name, max_queue, aging_s
        self.queue: list[_Job] = []
        self.running = 0
        self.service_s = 0.0  # recent seconds a job ran (a moving average)
        self.cond = threading.Condition()
        self.closed = False
        self.threads = [threading.Thread(target=self._work, name=f"spaceserve-prep-{name}-{i}",
                                         daemon=True) for i in range(workers)]
        for t in self.threads:
            t.start()

    def put(self, job: _Job) -> None:
        with self.cond:
            if self.closed:
                raise QueueFull(f"the {self.name} preprocessing lane is closed")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests wait for {self.name} "
                                "preprocessing (the queue is full)")
            self.queue.append(job)
            self.cond.notify()

    def _take(self) -> _Job:
        now = time.monotonic()
        best = min(self.queue, key=lambda j: (j.cost / (1.0 + (now - j.queued_at) / self.aging_s),
                                              j.seq))
        self.queue.remove(best)
        return best

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed and not self.queue:
                    return
                job = self._take()
                self.running += 1
            try:
                if not job.future.set_running_or_notify_cancel():
                    continue  # the caller gave up while it was queued
                if time.monotonic() > job.deadline:
                    job.future.set_exception(DeadlineExceeded("preprocessing deadline passed "
                                                              "while queued"))
                    continue
                _current.job = job
                began = time.monotonic()
                try:
                    job.future.set_result(job.fn())
                except BaseException as exc:  # handed to the caller, who raises it
                    job.future.set_exception(exc)
                finally:
                    _current.job = None
                    self.service_s += SERVICE_ALPHA * (time.monotonic() - began - self.service_s)
            finally:
                with self.cond:
                    self.running -= 1

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for job in self.queue:
                job.future.cancel()
            self.queue.clear()
            self.cond.notify_all()


class PreprocessPool:
    """See the module docstring."""

    def __init__(self, *, light_workers: int = 2, heavy_workers: int = 2, max_queue: int = 256,
                 aging_s: float = 1.0) -> None:
        for name, v in (("light_workers", light_workers), ("heavy_workers", heavy_workers),
                        ("max_queue", max_queue)):
            require_int(name, v)
        self.lanes = {"light": _Lane("light", light_workers, max_queue, aging_s),
                      "heavy": _Lane("heavy", heavy_workers, max_queue, aging_s)}
        self._seq = itertools.count()

    def submit(self, fn: Callable[[], Any], *, lane: str = "light", cost: float = 0.0,
               deadline: float | None = None, on_done: Callable[[], Any] | None = None
               ) -> Future:
        """Queue `fn` on `lane`; its Future. QueueFull when the lane's queue is full.
        `deadline` is on `time.monotonic()`'s clock (None: none). `on_done()` runs once the
        job is over however it ends (run, failed, dropped, refused), e.g. to free a budget
        its inputs hold."""
        if lane not in self.lanes:
            raise ValueError(f"lane={lane!r} is not one of {', '.join(LANES)}")
        job = _Job(fn, float(cost), float("inf") if deadline is None else deadline,
                   next(self._seq))
        if on_done is not None:
            job.future.add_done_callback(lambda _: on_done())
        try:
            self.lanes[lane].put(job)
        except QueueFull:
            job.future.cancel()
            raise
        return job.future

    async def run(self, fn: Callable[[], Any], *, lane: str = "light", cost: float = 0.0,
                  deadline: float | None = None, on_done: Callable[[], Any] | None = None
                  ) -> Any:
        """`fn()`'s result from a worker of `lane`; DeadlineExceeded once `deadline` passes
        (a queued job is then dropped; a running one is asked to stop: `cancel_point`).
        Cancelling the await cancels the job the same way."""
        fut = self.submit(fn, lane=lane, cost=cost, deadline=deadline, on_done=on_done)
        waiter = asyncio.wrap_future(fut)
        if deadline is None:
            return await waiter
        try:
            return await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            fut.cancel()
            raise DeadlineExceeded("preprocessing did not finish before its deadline") from None

    def depth(self) -> dict[str, int]:
        """Queued and running jobs per lane (``light_queued``, ``heavy_running``...)."""
        out = {}
        for name, lane in self.lanes.items():
            out[f"{name}_queued"] = len(lane.queue)
            out[f"{name}_running"] = lane.running
        return out

    def drain_s(self, lane: str = "light") -> float:
        """Seconds until a job queued on `lane` now would start: the jobs queued and running
        there, at the lane's recent time per job, over its workers (SLO-aware admission
        counts it toward a request's TTFT)."""
        ln = self.lanes[lane]
        return (len(ln.queue) + ln.running) * ln.service_s / len(ln.threads)

    def shutdown(self) -> None:
        """Cancel queued jobs and let the workers end (running jobs finish)."""
        for lane in self.lanes.values():
            lane.close()
