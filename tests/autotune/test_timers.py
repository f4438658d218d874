"""The CUDA timer's logic on CPU: its CUDA calls replaced by wall-clock events (a CPU call
"completes" when it returns), so warm-up, repeats, the background thread and its checks run."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from autotune.timers import CudaApi, CudaTimer, WallTimer
from autotune.workload import Point


class WallEvent:
    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: WallEvent) -> float:
        return (other.t - self.t) * 1e3


API = CudaApi(event=WallEvent, stream=lambda d: "side",
              use_stream=lambda s: contextlib.nullcontext(), synchronize=lambda d: None,
              set_device=lambda d: None)
POINT = Point("decode", (8, 256), 64, False)
CORUN = Point("decode", (8, 256), 64, True, 68)


def sleeper(seconds: float, log: list):
    def fn() -> None:
        log.append(threading.current_thread().name)
        time.sleep(seconds)

    return fn


def test_isolated_warms_up_once_and_repeats_to_the_target():
    calls: list = []
    timer = CudaTimer(torch.device("cpu"), warmup=1, target_s=0.02, max_reps=10, api=API)
    t = timer(sleeper(0.004, calls), None, POINT)
    assert 0.004 <= t < 0.03
    assert 1 + 1 + 3 <= len(calls) <= 1 + 1 + 10  # warm-up, estimate, repeats
    n = len(calls)
    timer(sleeper(0.004, calls), None, POINT)
    assert len(calls) - n < n - 1  # no second warm-up or estimate for the same point
    slow: list = []
    assert CudaTimer("cpu", target_s=0.001, api=API)(sleeper(0.003, slow), None, POINT) >= 0.003
    assert len(slow) == 2  # warm-up + one sample when a single call exceeds the target


def test_corun_runs_the_background_in_a_thread_until_the_timed_calls_end():
    calls: list = []
    bg: list = []
    timer = CudaTimer("cpu", target_s=0.02, api=API)
    timer(sleeper(0.004, calls), None, POINT)
    t = timer(sleeper(0.004, calls), sleeper(0.001, bg), CORUN)
    assert 0.004 <= t < 0.05
    assert timer.background_iterations == len(bg) >= 2 and not timer.uncovered
    assert threading.current_thread().name not in bg  # the background ran beside, not inline


def test_background_failure_is_reported():
    def broken() -> None:
        raise ValueError("boom")

    timer = CudaTimer("cpu", api=API)
    with pytest.raises(RuntimeError, match="background work of decode:8x256@64:corun") as info:
        timer(lambda: None, broken, CORUN)
    assert isinstance(info.value.__cause__, ValueError)


def test_wall_timer():
    calls: list = []
    t = WallTimer(warmup=2, target_s=0.01, max_reps=3)(sleeper(0.002, calls), None, POINT)
    assert t >= 0.002 and len(calls) == 2 + 3
