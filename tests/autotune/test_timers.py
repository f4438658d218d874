"""The CUDA timer's logic on CPU: a virtual device stands in for CUDA (a clock per stream, work
queued on the current stream starts when that stream and the host are ready, events read the
clock; the host's own time is a virtual clock too), so capture, host timing, the split a
co-running point runs on, the background queued ahead on the other stream and the coverage
check all run without a GPU, and give the same figures on a loaded machine."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from autotune.timers import CudaApi, CudaTimer, WallTimer
from autotune.workload import Point

TOTAL = 132


class Device:
    """Streams with clocks (ms); `host` is where the host stands on the device's clock."""

    def __init__(self) -> None:
        self.clock: dict[str, float] = {}
        self.host = 0.0
        self.wall = 0.0  # the host's clock (s): advanced only by a stage's own host work
        self.current = "default"
        self.captured: list[tuple[str, str]] = []
        self.partitions: list[int] = []
        self.threads: set[str] = set()

    def submit(self, ms: float) -> None:
        self.threads.add(threading.current_thread().name)
        s = self.current
        self.clock[s] = max(self.clock.get(s, 0.0), self.host) + ms

    def now(self, stream: str) -> float:
        return max(self.clock.get(stream, 0.0), self.host)

    def api(self, *, fail_capture: tuple[str, ...] = (), green: bool = True) -> CudaApi:
        dev = self

        class Event:
            def record(self, stream=None) -> None:
                self.t = dev.now(stream or dev.current)

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                dev.host = max([dev.host, *dev.clock.values()])

            def elapsed_time(self, other) -> float:
                return other.t - self.t

        @contextlib.contextmanager
        def use(stream):
            saved, dev.current = dev.current, stream
            try:
                yield
            finally:
                dev.current = saved

        def graph(fn, stream, pool):
            name = getattr(fn, "name", "?")
            if name in fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            dev.captured.append((name, stream))
            return fn.device_work

        class Part:
            def __init__(self, e):
                self.encoder_stream, self.decoder_stream = f"enc{e}", f"dec{e}"

        class PSet:
            def __init__(self, e):
                self.part = Part(e)

            def get(self, e):
                return self.part

            def close(self):
                pass

        def partition(device, e):
            dev.partitions.append(e)
            return PSet(e) if green else None

        def sync(device):
            dev.host = max([dev.host, *dev.clock.values()])

        return CudaApi(event=Event, stream=lambda d: f"side{len(dev.clock)}", use_stream=use,
                       synchronize=sync, set_device=lambda d: None, graph=graph,
                       pool=lambda: None, partition=partition, num_sms=lambda d: TOTAL,
                       host_clock=lambda: dev.wall)

    def work(self, name: str, ms: float, host_s: float = 0.0, log: list | None = None):
        """A stage run: `host_s` of host work when eager, then `ms` on the device."""

        def device_work() -> None:
            self.submit(ms)
            if log is not None:
                log.append("replay")

        def fn() -> None:
            self.wall += host_s
            self.submit(ms)
            if log is not None:
                log.append("eager")

        fn.name, fn.device_work = name, device_work
        return fn


POINT = Point("decode", (8, 256), 64, False)
CORUN = Point("decode", (8, 256), 64, True, 68)
ENC = Point("encoder", (1024,), 40, True, 92)


def test_isolated_is_captured_once_and_timed_from_replays():
    dev, log = Device(), []
    timer = CudaTimer(torch.device("cpu"), warmup=1, target_s=0.02, max_reps=10, api=dev.api())
    t = timer(dev.work("step", 4.0, log=log), None, POINT)
    assert t == pytest.approx(4e-3)
    assert log[:3] == ["eager"] * 3  # warm-up + two host-timed calls, then replays only
    assert set(log[3:]) == {"replay"} and 1 + 3 <= log.count("replay") <= 1 + 1 + 10
    assert dev.captured == [("step", "side0")] and not timer.eager
    assert timer.host_s[POINT.key] == 0 and not timer.host_bound(POINT.key, t)
    n = len(log)
    timer(dev.work("step", 4.0, log=log), None, POINT)
    assert "eager" not in log[n:] and len(dev.captured) == 1  # the same point: no new capture
    timer(dev.work("step", 2.0, log=log), None, Point("decode", (16, 256), 64, False))
    assert len(timer._prepared) == 1  # the previous workload point's graphs were dropped


def test_host_bound_points_and_eager_fallback():
    dev = Device()
    timer = CudaTimer("cpu", target_s=0.01, api=dev.api(fail_capture=("slow",)))
    t = timer(dev.work("slow", 0.5, host_s=0.002), None, POINT)
    assert t == pytest.approx(0.5e-3)
    assert timer.eager == [POINT.key] and dev.captured == []
    assert timer.host_s[POINT.key] == pytest.approx(0.002) and timer.host_bound(POINT.key, t)
    assert timer.host_bound_points() == [POINT.key] and timer.device_s[POINT.key] == t


def test_corun_runs_on_the_split_with_the_background_queued_ahead():
    dev, bg_log = Device(), []
    timer = CudaTimer("cpu", target_s=0.02, api=dev.api())
    bg = dev.work("bg", 3.0, log=bg_log)
    t = timer(dev.work("step", 4.0), bg, CORUN)
    assert t == pytest.approx(4e-3)
    # decode co-runs on the decoder side of split 68 (the encoder's SMs), the background on
    # the encoder side; both captured there; every launch issued by this thread
    assert dev.partitions == [68] and timer.green == [CORUN.key]
    assert ("step", "dec68") in dev.captured and ("bg", "enc68") in dev.captured
    assert dev.threads == {threading.current_thread().name}
    assert not timer.uncovered and timer.background_iterations >= 2
    assert dev.clock["enc68"] >= dev.clock["dec68"]  # the background outlasted the timed calls
    timer(dev.work("enc", 5.0), dev.work("bg2", 1.0), ENC)
    assert dev.partitions == [68, 40] and ("enc", "enc40") in dev.captured


def test_corun_without_a_split_uses_ordinary_streams_and_checks_coverage():
    dev = Device()
    timer = CudaTimer("cpu", target_s=0.02, api=dev.api(green=False), max_background=1)
    timer(dev.work("step", 4.0), dev.work("bg", 1.0), CORUN)
    assert not timer.green and dev.partitions == [68]
    assert timer.uncovered == [CORUN.key]  # one 1 ms background call cannot cover 20 ms
    whole = Point("decode", (8, 256), TOTAL, True, 8)  # 132 + 8 SMs: no split holds both
    timer(dev.work("s2", 1.0), dev.work("b2", 1.0), whole)
    assert dev.partitions == [68]


def test_background_failure_is_reported():
    def broken() -> None:
        raise ValueError("boom")

    dev = Device()
    timer = CudaTimer("cpu", api=dev.api())
    with pytest.raises(RuntimeError, match="background work of decode:8x256@64:corun") as info:
        timer(dev.work("step", 1.0), broken, CORUN)
    assert isinstance(info.value.__cause__, ValueError)


def sleeper(seconds: float, log: list):
    def fn() -> None:
        log.append(threading.current_thread().name)
        time.sleep(seconds)

    return fn


def test_wall_timer():
    calls: list = []
    t = WallTimer(warmup=2, target_s=0.01, max_reps=3)(sleeper(0.002, calls), None, POINT)
    assert t >= 0.002 and len(calls) == 2 + 3
