"""Timers for the profiler: ``timer(run, background, point) -> seconds`` of one `run()` call.

`background` (None for isolated points) is the other stage's work; a co-running measurement
times `run` while `background` runs beside it. The profiler takes any callable of this shape,
so CPU tests inject a fake one.

- `CudaTimer`: times what the device does, as the runtime runs it. Each point's `run` is
  captured in a CUDA graph (eager where capture fails: the point is listed in `eager`) and
  timed by CUDA events around replays; the host time of one eager call (launch work, no sync)
  is measured too and kept in `host_s`, so a point whose host time is at least its device time
  is known to be host-bound (`host_bound`). A co-running point runs on a split of the device:
  where green contexts exist, the stage on its partition's green stream and the background,
  captured in a graph too, on the other partition's, both issued from this thread (the
  background's replays queued first, enough to outlast the timed ones: no second Python thread
  competing for the GIL); the timer checks that the background was still running when the
  timed replays ended.
- `WallTimer`: wall-clock seconds for CPU smoke runs; it cannot co-run (the interpreter runs
  one program at a time), so co-running points are timed alone.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
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


def _capture(fn: Callable[[], Any], stream: Any, pool: Any) -> Callable[[], Any]:
    """`fn` captured in a CUDA graph on `stream` (its launches then replay in that stream's
    green context, if any) from memory pool `pool`: the graph's replay. Raises what the
    capture raised."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    return graph.replay


def _green_split(device: torch.device, encoder_sms: int) -> Any:
    """A `PartitionSet` holding the green split `encoder_sms`, or None where green contexts
    are unavailable or refuse the split (the point then runs on ordinary streams)."""
    from spaceserve.runtime.spatial.partition import PartitionSet

    pset = PartitionSet(device, [encoder_sms])
    if not pset.get(encoder_sms).green:
        pset.close()
        return None
    return pset


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
    graph: Callable[[Callable[[], Any], Any, Any], Callable[[], Any]] = field(default=_capture)
    pool: Callable[[], Any] = field(default=lambda: torch.cuda.graph_pool_handle())
    partition: Callable[[torch.device, int], Any] = field(default=_green_split)
    num_sms: Callable[[torch.device], int] = field(default=lambda d: _device_sms(d))
    host_clock: Callable[[], float] = field(default=time.perf_counter)  # seconds, host side


def _device_sms(device: torch.device) -> int:
    from spaceserve.kernels.budget import device_num_sms

    return device_num_sms(device)


@dataclass
class _Prepared:
    """A callable as the timer runs it: its replay (or itself), where, and what it costs."""

    fn: Callable[[], Any]  # kept alive while cached (its id is part of the key)
    call: Callable[[], Any]
    stream: Any
    graph: bool
    host_s: float
    estimate_s: float = 0.0


class CudaTimer:
    """CUDA-event timing of a stage, alone or beside the other stage (module docstring).

    Each (stage, work, sms, stream) is warmed up and captured once, then timed `reps` times,
    enough for `target_s` of device time (at least `min_reps`, at most `max_reps`); the median
    is returned. `graphs=False` times eager calls (events around them, as before graphs).
    Co-running points whose background ended before the timed calls did are listed in
    `uncovered` (and logged); `green` lists the co-running points that ran on green
    partitions, `eager` those that could not be captured, `host_s` the host seconds of one
    eager call per point. Graphs share one memory pool (graphs replaying at the same time are
    on different streams, whose blocks the allocator never mixes); a stage's graphs are
    dropped when the profiler moves to the next workload point, the backgrounds' kept.
    """

    def __init__(self, device: torch.device | str | None = None, warmup: int = 1,
                 target_s: float = 0.03, min_reps: int = 1, max_reps: int = 10,
                 api: CudaApi | None = None, *, graphs: bool = True, host_reps: int = 2,
                 max_background: int = 512) -> None:
        self.device = torch.device(device or "cuda")
        if self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.warmup, self.target_s = warmup, target_s
        self.min_reps, self.max_reps = min_reps, max_reps
        self.api = api or CudaApi()
        self.graphs, self.host_reps, self.max_background = graphs, host_reps, max_background
        self._prepared: dict[tuple, _Prepared] = {}
        self._background: dict[tuple, _Prepared] = {}
        self._group: tuple = ()
        self._splits: dict[int, Any] = {}
        self._pool: Any = None
        self._stream: Any = None
        self._bg_stream: Any = None
        self.uncovered: list[str] = []
        self.eager: list[str] = []
        self.green: list[str] = []
        self.host_s: dict[str, float] = {}
        self.device_s: dict[str, float] = {}
        self.background_iterations = 0

    def host_bound(self, key: str, device_s: float | None = None) -> bool:
        """Whether the point `key` issues its work (eagerly) more slowly than the device runs
        it: host seconds of one call >= `device_s` (default: what the timer measured)."""
        host = self.host_s.get(key)
        dev = self.device_s.get(key) if device_s is None else device_s
        return host is not None and dev is not None and host >= dev

    def host_bound_points(self) -> list[str]:
        """Keys of every timed point that is host-bound (`host_bound`)."""
        return [k for k in self.device_s if self.host_bound(k)]

    # -- streams ---------------------------------------------------------------------------
    def _ordinary(self) -> Any:
        if self._stream is None:
            self._stream = self.api.stream(self.device)
        return self._stream

    def _split(self, point: Point) -> Any:
        """The green partition a co-running point runs on, or None (ordinary streams)."""
        total = self.api.num_sms(self.device)
        if point.sms + point.other_sms > total:
            return None  # no split holds both budgets: they overlap, as kernel budgets alone
        e = point.sms if point.stage == "encoder" else point.other_sms
        if e not in self._splits:
            try:
                self._splits[e] = self.api.partition(self.device, e)
            except Exception as exc:  # no partition: the point runs on ordinary streams
                log.warning("split %d: no green partition (%s)", e, exc)
                self._splits[e] = None
        pset = self._splits[e]
        return None if pset is None else pset.get(e)

    def _streams(self, point: Point) -> tuple[Any, Any, bool]:
        """(stage stream, background stream or None, green) of a point: the encoder on the
        split's encoder side, decode and prefill on its decoder side."""
        if not point.corun:
            return self._ordinary(), None, False
        part = self._split(point)
        if part is None:
            if self._bg_stream is None:
                self._bg_stream = self.api.stream(self.device)
            return self._ordinary(), self._bg_stream, False
        if point.stage == "encoder":
            return part.encoder_stream, part.decoder_stream, True
        return part.decoder_stream, part.encoder_stream, True

    def close(self) -> None:
        """Drop every graph and the green partitions."""
        self._prepared.clear()
        self._background.clear()
        for pset in self._splits.values():
            if pset is not None:
                pset.close()
        self._splits.clear()

    # -- preparing a callable ----------------------------------------------------------------
    def _prepare(self, cache: dict[tuple, _Prepared], key: tuple, fn: Callable[[], Any],
                 stream: Any, name: str) -> _Prepared:
        """Warm `fn` up on `stream`, measure the host time of eager calls, capture it."""
        if key in cache:
            return cache[key]
        api = self.api
        api.synchronize(self.device)  # its inputs were made on another stream
        with api.use_stream(stream):
            for _ in range(self.warmup):
                fn()
            api.synchronize(self.device)
            host = []
            for _ in range(max(1, self.host_reps)):
                t0 = api.host_clock()
                fn()
                host.append(api.host_clock() - t0)
                api.synchronize(self.device)
        call, graph = fn, False
        if self.graphs:
            try:
                if self._pool is None:
                    self._pool = api.pool()
                call, graph = api.graph(fn, stream, self._pool), True
                with api.use_stream(stream):
                    call()
            except Exception as exc:  # runs eagerly; the point says so
                log.warning("%s: not captured in a CUDA graph (%s); timed eagerly", name, exc)
                call, graph = fn, False
                self.eager.append(name)
            api.synchronize(self.device)
        prep = _Prepared(fn, call, stream, graph, statistics.median(host))
        ev = self._timed(prep, 1)
        ev[-1].synchronize()
        prep.estimate_s = self._samples(ev)[0]
        cache[key] = prep
        return prep

    def _timed(self, prep: _Prepared, reps: int) -> list[Any]:
        ev = [self.api.event() for _ in range(reps + 1)]
        with self.api.use_stream(prep.stream):
            ev[0].record(prep.stream)
            for i in range(reps):
                prep.call()
                ev[i + 1].record(prep.stream)
        return ev

    @staticmethod
    def _samples(ev: list[Any]) -> list[float]:
        return [a.elapsed_time(b) * 1e-3 for a, b in zip(ev[:-1], ev[1:], strict=True)]

    # -- timing ------------------------------------------------------------------------------
    def __call__(self, run: Callable[[], Any], background: Callable[[], Any] | None,
                 point: Point) -> float:
        seconds = self._time(run, background, point)
        self.device_s[point.key] = seconds
        return seconds

    def _time(self, run: Callable[[], Any], background: Callable[[], Any] | None,
              point: Point) -> float:
        group = (point.stage, point.work)
        if group != self._group:  # a new workload point: the last one's graphs go
            self._prepared.clear()
            self._group = group
        stream, bg_stream, green = self._streams(point)
        prep = self._prepare(self._prepared, (_warm_key(point), id(stream)), run, stream,
                             point.key)
        self.host_s[point.key] = prep.host_s
        est = max(prep.estimate_s, 1e-6)
        if background is None and self.min_reps <= 1 and est > self.target_s:
            return prep.estimate_s
        reps = max(self.min_reps, min(self.max_reps, math.ceil(self.target_s / est)))
        if background is None:
            ev = self._timed(prep, reps)
            ev[-1].synchronize()
            return statistics.median(self._samples(ev))
        if green:
            self.green.append(point.key)
        try:
            bg = self._prepare(self._background, (id(background), id(bg_stream)), background,
                               bg_stream, f"background of {point.key}")
        except Exception as exc:
            raise RuntimeError(f"background work of {point.key} failed") from exc
        return self._corun(prep, bg, reps, est, point)

    def _corun(self, prep: _Prepared, bg: _Prepared, reps: int, est: float,
               point: Point) -> float:
        api = self.api
        api.synchronize(self.device)
        n_bg = min(self.max_background,
                   2 + math.ceil((1.5 * reps * est + 2e-3) / max(bg.estimate_s, 1e-6)))
        first, last = api.event(), api.event()
        try:
            with api.use_stream(bg.stream):  # queued first: running before the timed calls
                first.record(bg.stream)
                for _ in range(n_bg):
                    bg.call()
                last.record(bg.stream)
        except Exception as exc:
            raise RuntimeError(f"background work of {point.key} failed") from exc
        ev = self._timed(prep, reps)
        api.synchronize(self.device)
        self.background_iterations += n_bg
        try:  # times between events of two streams (two green contexts on a GPU)
            covered = first.elapsed_time(ev[0]) >= 0 and \
                ev[0].elapsed_time(last) >= ev[0].elapsed_time(ev[-1])
        except RuntimeError as exc:  # the driver may refuse: coverage unknown, said so
            covered = False
            log.warning("%s: coverage not measurable across streams (%s)", point.key, exc)
        if not covered:
            self.uncovered.append(point.key)
            log.warning("%s: the background did not cover the timed calls", point.key)
        return statistics.median(self._samples(ev))
