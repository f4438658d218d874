"""The GPU harness's dry runs as background processes (tests/test_harness_dry_run.py reads them).

Each run takes a minute of mostly one core, or only waits (a section made to hang until its
limit), so tests/conftest.py starts them when the session starts, where the suite selects
their tests and runs in one process: they then run beside the rest of the suite instead of
after it, and their test reads the result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STALL_BUDGET_S = 20  # facts hangs after its 2nd row; plenty for 2 rows on a loaded machine


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that is a run of its own: without the Triton
    interpreter switch and without pytest-xdist's worker variables (a child pytest seeing them
    believes it is an xdist worker and, with pytest-benchmark, disables its benchmarks)."""
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_XDIST_")}
    return env | extra


class Background:
    """`bash bench/gpu/run.sh ARGS` started now; `result()` waits for it (killing its process
    group `timeout` s after its start) and `wall` is its own run time, however late it is
    read."""

    def __init__(self, *args: str, timeout: float) -> None:
        self.timeout = timeout
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(["bash", str(ROOT / "bench/gpu/run.sh"), *args], cwd=ROOT,
                                     env=subprocess_env(PYTHON=sys.executable),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.out = self.err = ""
        self.wall = float("nan")
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.out, self.err = self.proc.communicate()
        self.wall = time.perf_counter() - self.t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._waiter.join(10)

    def result(self) -> subprocess.CompletedProcess:
        self._waiter.join(max(0.0, self.timeout - (time.perf_counter() - self.t0)))
        if self._waiter.is_alive():
            self.kill()
            pytest.fail(f"run.sh did not end within {self.timeout} s:\n{self.out[-3000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.out,
                                           self.err)


def whole_run(out: Path) -> Background:
    """`run.sh --dry-run OUT`: every section."""
    return Background("--dry-run", str(out), timeout=120)


def stalled_run(out: Path) -> Background:
    """facts alone, made to hang after its 2nd row and killed at its limit."""
    return Background("--dry-run", str(out), "--only", "facts", "--budget",
                      f"facts={STALL_BUDGET_S}", "--stall", "facts:2", timeout=90)
