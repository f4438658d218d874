"""Subprocess runs that tests only read the results of, run in the background.

tests/conftest.py starts them when the session starts (where the selected tests use them and
pytest runs in one process), one at a time through `GATE` and niced, and sorts their readers to
the end of the session: the runs then use the core the suite's single process leaves idle,
instead of being waited for. A run is killed at its own timeout; `result()` waits for it and
fails the reading test if it was killed. Each run's `wall` is its own run time, however late it
is read.

- `whole_run`, `stalled_run`: the GPU harness's dry run, whole and with facts made to hang
  (tests/bench/test_harness_dry_run.py);
- `sm90_run`: the ahead-of-time sm_90 compile of every kernel module, every GPU tuning
  candidate and the harness's facts kernels, once per python (the `sm90_check` fixture);
- `kernels_cli_run`: `spaceserve bench kernels` on a slice of the kernel suite
  (tests/bench/test_kernel_suite.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STALL_BUDGET_S = 20  # facts hangs after its 2nd row; plenty for 2 rows on a loaded machine
GATE = threading.Semaphore(1)  # CPU-heavy runs one at a time, beside the suite's process
NICE = 10  # ... and yielding to it
SM90_EXTRA = ("autotune.aot_candidates", "bench/gpu/facts.py")
KERNELS_OPTIONAL = ("flash_attn", "flashinfer")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that is a run of its own: without the Triton
    interpreter switch and without pytest-xdist's worker variables (a child pytest seeing them
    believes it is an xdist worker and, with pytest-benchmark, disables its benchmarks), the
    repository first on PYTHONPATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_XDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env | extra


class Background:
    """`argv` run from the repository root on a thread of its own (after taking `gate`, if
    given, and then at a lower CPU priority: the suite's own process keeps its core), killed
    with its process group `timeout` s after it started."""

    def __init__(self, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
                 gate: threading.Semaphore | None = GATE) -> None:
        if gate is not None and shutil.which("nice"):
            argv = ["nice", "-n", str(NICE), *argv]
        self.argv, self.timeout, self.gate = argv, timeout, gate
        self.env = env if env is not None else subprocess_env()
        self.proc: subprocess.Popen | None = None
        self.out = self.err = ""
        self.wall = float("nan")
        self.timed_out = self._cancelled = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.gate is not None:
            self.gate.acquire()
        try:
            with self._lock:
                if self._cancelled:
                    return
                t0 = time.perf_counter()
                self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             start_new_session=True)
            try:
                self.out, self.err = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.timed_out = True
                self._kill_group()
                self.out, self.err = self.proc.communicate()
            self.wall = time.perf_counter() - t0
        finally:
            if self.gate is not None:
                self.gate.release()

    def _kill_group(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """End the run now (or keep it from starting)."""
        with self._lock:
            self._cancelled = True
            self._kill_group()
        self._thread.join(10)

    def result(self) -> subprocess.CompletedProcess:
        self._thread.join()
        if self.timed_out:
            pytest.fail(f"{' '.join(self.argv[:4])} ... did not end within {self.timeout} s:\n"
                        f"{self.out[-3000:]}{self.err[-2000:]}")
        assert self.proc is not None, "the run was cancelled"
        return subprocess.CompletedProcess(self.argv, self.proc.returncode, self.out, self.err)


def _run_sh(*args: str, timeout: float, gate: threading.Semaphore | None = GATE) -> Background:
    return Background(["bash", str(ROOT / "bench/gpu/run.sh"), *args], timeout=timeout,
                      env=subprocess_env(PYTHON=sys.executable), gate=gate)


def whole_run(out: Path) -> Background:
    """`run.sh --dry-run OUT`: every section."""
    return _run_sh("--dry-run", str(out), timeout=120)


def stalled_run(out: Path) -> Background:
    """facts alone, made to hang after its 2nd row and killed at its limit (it mostly waits:
    not gated)."""
    return _run_sh("--dry-run", str(out), "--only", "facts", "--budget",
                   f"facts={STALL_BUDGET_S}", "--stall", "facts:2", timeout=90, gate=None)


def sm90_targets() -> list[str]:
    from spaceserve.kernels.aot import kernel_module_names

    return [*kernel_module_names(), *SM90_EXTRA]


def sm90_run(python: str, out: Path) -> Background:
    """`python -m spaceserve.kernels.aot --no-spills --json OUT` over `sm90_targets()`."""
    modules = [a for t in sm90_targets() for a in ("--module", t)]
    return Background([python, "-m", "spaceserve.kernels.aot", "--jobs", "2", "--no-spills",
                       "--json", str(out), *modules], timeout=900)


def sm90_results(run: Background, out: Path) -> dict[str, list[dict]]:
    """{module: result rows} of a finished `sm90_run`."""
    proc = run.result()
    assert out.exists(), f"the checker wrote no results:\n{proc.stdout}{proc.stderr}"
    by: dict[str, list[dict]] = {t: [] for t in sm90_targets()}
    for row in json.loads(out.read_text())["results"]:
        by.setdefault(row["module"], []).append(row)
    return by


def kernels_cli_run(out: Path) -> Background:
    """`spaceserve bench kernels` on the paged decode kernel in fp32 and the optional
    backends."""
    interpret = {k: v for k, v in os.environ.items() if k == "TRITON_INTERPRET"}
    return Background(
        [sys.executable, "-m", "spaceserve.cli", "bench", "kernels", "--cpu-profile", "--json",
         str(out), "-k", "(paged_decode_attention and fp32 and budget) or " +
         " or ".join(KERNELS_OPTIONAL), "--", "--kernel-green", "off"], timeout=600,
        env=subprocess_env(**interpret))
