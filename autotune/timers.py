"""Timers for the profiler: ``timer(run, background, point) -> seconds`` of one `run()` call.

`background` (None for isolated points) is the other stage's work; a co-running measurement
times `run` while `background` runs in a loop beside it. The profiler takes any callable of
this shape, so CPU tests inject a fake one.

- `CudaTimer`: CUDA events on the current stream. The background loop runs in a thread on a
  second stream, at most two iterations ahead of the GPU (so it stops promptly), and starts
  before the timed calls; the timer checks that it was still running when they ended.
  Triton and torch launches release the GIL while the driver queues a kernel, so the two
  launch loops interleave.
- `WallTimer`: wall-clock seconds for CPU smoke runs; it cannot co-run (the interpreter runs
  one program at a time), so co-running points are timed alone.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .points import Point

log = logging.getLogger("autotune")


class Timer(Protocol):
    def __call__(self, run: Callable[[], Any], background: Callable[[], Any] | None,
                 point: Point) -> float:
        """Seconds of one call of `run` (median of repeats)."""


def _warm_key(point: Point) -> tuple:
    return (point.stage, point.work, point.sms)


class WallTimer:
    """Median wall-clock time of `run` after `warmup` calls; repeats until `target_s`."""

    def __init__(self, warmup: int = 1, target_s: float = 0.02, max_reps: int = 20) -> None:
        self.warmup, self.target_s, self.max_reps = warmup, target_s, max_reps

    def __call__(self, run: Callable[[], Any], background: Callable[[], Any] | None,
                 point: Point) -> float:
        for _ in range(self.warmup):
            run()
        samples: list[float] = []
        start = time.perf_counter()
        while not samples or (time.perf_counter() - start < self.target_s
                              and len(samples) < self.max_reps):
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


@dataclass
class CudaApi:
    """The CUDA calls the timer makes (replaceable by wall-clock stand-ins in CPU tests)."""

    event: Callable[[], Any] = field(default=lambda: torch.cuda.Event(enable_timing=True))
    stream: Callable[[torch.device], Any] = field(default=lambda d: torch.cuda.Stream(d))
    use_stream: Callable[[Any], Any] = field(default=lambda s: torch.cuda.stream(s))
    synchronize: Callable[[torch.device], None] = field(
        default=lambda d: torch.cuda.synchronize(d))
    set_device: Callable[[torch.device], None] = field(
        default=lambda d: torch.cuda.set_device(d))


class _Loop(threading.Thread):
    """Runs `fn` on `stream` until stopped, at most `ahead` iterations queued on the GPU."""

    def __init__(self, fn: Callable[[], Any], stream: Any, device: torch.device, api: CudaApi,
                 ahead: int = 2) -> None:
        super().__init__(daemon=True)
        self.fn, self.stream, self.device, self.api, self.ahead = fn, stream, device, api, ahead
        self.stop = threading.Event()
        self.started = threading.Event()
        self.last: Any = None
        self.iterations = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.api.set_device(self.device)
            pending: deque[Any] = deque()
            with self.api.use_stream(self.stream):
                while not self.stop.is_set():
                    while len(pending) >= self.ahead and not pending[0].query():
                        if self.stop.is_set():
                            return
                        time.sleep(1e-4)
                    if len(pending) >= self.ahead:
                        pending.popleft()
                    self.fn()
                    ev = self.api.event()
                    ev.record(self.stream)
                    pending.append(ev)
                    self.last = ev
                    self.iterations += 1
                    self.started.set()
        except BaseException as exc:  # reported by the timing thread
            self.error = exc
        finally:
            self.started.set()


class CudaTimer:
    """CUDA-event timing of a stage, alone or beside a background loop on another stream.

    Each (stage, work, sms) is warmed up once (the first call may compile or capture), then
    timed `reps` times, enough for `target_s` of GPU time (at least `min_reps`, at most
    `max_reps`); the median is returned. Co-running points whose background stopped before
    the timed calls ended are listed in `uncovered` (and logged).
    """

    def __init__(self, device: torch.device | str | None = None, warmup: int = 1,
                 target_s: float = 0.03, min_reps: int = 1, max_reps: int = 10,
                 api: CudaApi | None = None) -> None:
        self.device = torch.device(device or "cuda")
        if self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.warmup, self.target_s = warmup, target_s
        self.min_reps, self.max_reps = min_reps, max_reps
        self.api = api or CudaApi()
        self._estimate: dict[tuple, float] = {}
        self._stream: Any = None
        self.uncovered: list[str] = []
        self.background_iterations = 0

    def _timed(self, run: Callable[[], Any], reps: int) -> list[Any]:
        ev = [self.api.event() for _ in range(reps + 1)]
        ev[0].record()
        for i in range(reps):
            run()
            ev[i + 1].record()
        return ev

    @staticmethod
    def _samples(ev: list[Any]) -> list[float]:
        return [a.elapsed_time(b) * 1e-3 for a, b in zip(ev[:-1], ev[1:], strict=True)]

    def __call__(self, run: Callable[[], Any], background: Callable[[], Any] | None,
                 point: Point) -> float:
        key = _warm_key(point)
        if key not in self._estimate:
            for _ in range(self.warmup):
                run()
            self.api.synchronize(self.device)
            ev = self._timed(run, 1)
            ev[-1].synchronize()
            self._estimate[key] = self._samples(ev)[0]
            if background is None and self.min_reps <= 1 and self._estimate[key] > self.target_s:
                return self._estimate[key]
        est = max(self._estimate[key], 1e-6)
        reps = max(self.min_reps, min(self.max_reps, math.ceil(self.target_s / est)))
        if background is None:
            ev = self._timed(run, reps)
            ev[-1].synchronize()
            return statistics.median(self._samples(ev))
        return self._corun(run, background, reps, point)

    def _corun(self, run: Callable[[], Any], background: Callable[[], Any], reps: int,
               point: Point) -> float:
        if self._stream is None:
            self._stream = self.api.stream(self.device)
        self.api.synchronize(self.device)
        loop = _Loop(background, self._stream, self.device, self.api)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # let the two launch loops alternate finely
        try:
            loop.start()
            loop.started.wait()
            if loop.error is None:
                ev = self._timed(run, reps)
                while not ev[-1].query():  # the background runs on until the timed calls end
                    time.sleep(1e-4)
        finally:
            loop.stop.set()
            loop.join()
            sys.setswitchinterval(switch)
        self.api.synchronize(self.device)
        if loop.error is not None:
            raise RuntimeError(f"background work of {point.key} failed") from loop.error
        self.background_iterations += loop.iterations
        if loop.last is None or ev[0].elapsed_time(loop.last) < ev[0].elapsed_time(ev[-1]):
            self.uncovered.append(point.key)
            log.warning("%s: the background stopped before the timed calls ended", point.key)
        return statistics.median(self._samples(ev))
