"""How the suite times one call, and what it records about it.

On a GPU each round is: flush L2 (zero a 256 MB buffer) and give the host a head start
(`torch.cuda._sleep`), both outside the timed region, then time one call between two CUDA
events on the current stream (`cuda_event_timer`, given to pytest-benchmark as its timer). The
call is a CUDA-graph replay of the kernel launch(es) where capture works (no host launch
overhead inside the events), else the eager call. Budgets below the whole device run inside a
green-context partition of that many SMs where the driver offers them (the granted count
becomes the budget), which also bounds backends that take no budget. On CPU a round is one
wall-clock call: a smoke test of the plumbing, not a measurement.

`extra_info` of every benchmark carries the budget, the grid of each launch (from
`spaceserve.kernels.record_launches`), bytes and FLOPs, and the derived GB/s, TFLOP/s and
fraction of the device's peak (the H200/H100/A100 presets of `policy.analytic.model`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from .cases import DTYPES, Case, Work
from .shapes import DTYPES as PROFILE_DTYPES
from .shapes import Budget, budgets

FLUSH_BYTES = 256 << 20  # well above the H200's 50 MB L2
HEAD_START_CYCLES = 400_000  # about 0.2 ms of a GPU clock: the host enqueues the call meanwhile
GPU_ROUNDS, CPU_ROUNDS = 30, 2


class _Stamp:
    """A CUDA event recorded on the current stream; `later - earlier` is device seconds."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, earlier: _Stamp) -> float:
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1e3


def cuda_event_timer() -> _Stamp:
    """pytest-benchmark timer for GPU rounds: the difference of two calls is the device time
    between them (waits for the second event)."""
    return _Stamp()


class RoundSetup:
    """pytest-benchmark `setup` of a GPU round: flush L2, then a short device-side spin so the
    host has queued the timed call before the device reaches it."""

    def __init__(self, device: torch.device) -> None:
        self.buffer = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def __call__(self) -> None:
        self.buffer.zero_()
        if self.sleep is not None:
            self.sleep(HEAD_START_CYCLES)


def device_peaks(device: torch.device, dtype: str) -> tuple[float | None, float | None, str]:
    """(GB/s, TFLOP/s, source) of the device's peak; TFLOP/s only for bf16/fp16 (tensor cores)."""
    if device.type != "cuda":
        return None, None, "none (not a GPU)"
    from spaceserve.runtime.policy.analytic.model import PRESETS

    name = torch.cuda.get_device_name(device)
    for key, preset in PRESETS.items():
        if key.lower() in name.lower():
            flops = preset.flops / 1e12 if dtype in ("bf16", "fp16") else None
            return preset.hbm_bw / 1e9, flops, (
                f"{key} preset of runtime.policy.analytic (measured copy bandwidth, bf16 "
                "matmul throughput)")
    return None, None, f"none (no preset for {name})"


def derived(median_s: float | None, nbytes: int, flops: int, peaks: tuple) -> dict[str, Any]:
    """GB/s, TFLOP/s and fractions of peak from a median time (None where not defined).
    `fraction_of_peak` is the larger of the two: the resource the kernel is bound by."""
    peak_gbs, peak_tflops, source = peaks
    out: dict[str, Any] = {"median_s": median_s, "gbs": None, "tflops": None,
                           "peak_gbs": peak_gbs, "peak_tflops": peak_tflops,
                           "peak_source": source, "frac_peak_bw": None, "frac_peak_flops": None,
                           "fraction_of_peak": None}
    if not median_s or median_s <= 0:
        return out
    out["gbs"] = nbytes / median_s / 1e9
    out["tflops"] = flops / median_s / 1e12
    if peak_gbs:
        out["frac_peak_bw"] = out["gbs"] / peak_gbs
    if peak_tflops:
        out["frac_peak_flops"] = out["tflops"] / peak_tflops
    fracs = [f for f in (out["frac_peak_bw"], out["frac_peak_flops"]) if f is not None]
    out["fraction_of_peak"] = max(fracs) if fracs else None
    return out


def capture_graph(fn: Callable[[], Any], stream: Any = None) -> Any:
    """A CUDA graph of `fn` (warmed up on a side stream first), captured on `stream` when given
    (a green-context stream: the graph stays bound to its partition)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, **({"stream": stream} if stream is not None else {})):
        fn()
    return graph


@dataclass
class SuiteEnv:
    """The session's settings (from the command line) and shared device state."""

    profile: str
    device: torch.device
    total_sms: int
    dtypes: tuple[str, ...]
    rounds: int
    timing: str
    green_mode: str
    deadline_s: float | None
    start: float = field(default_factory=time.perf_counter)
    green_reason: str | None = "not requested"
    budgets: list[Budget] = field(default_factory=list)
    _partitions: Any = None
    _setup: RoundSetup | None = None
    _cases: dict[str, Any] = field(default_factory=dict)
    _built: tuple[Any, Work] | None = None

    @classmethod
    def from_config(cls, config: pytest.Config) -> SuiteEnv:
        opt = config.getoption
        cuda = torch.cuda.is_available()
        if opt("gpu_profile", False) and opt("cpu_profile", False):
            raise pytest.UsageError("--gpu-profile and --cpu-profile exclude each other")
        if opt("gpu_profile", False) and not cuda:
            raise pytest.UsageError("--gpu-profile needs a CUDA device (none is visible); "
                                    "without one the suite runs its CPU profile")
        profile = "gpu" if cuda and not opt("cpu_profile", False) else "cpu"
        device = torch.device("cuda" if cuda else "cpu")
        dtypes = PROFILE_DTYPES[profile]
        if opt("kernel_dtypes", None):
            dtypes = tuple(d.strip() for d in opt("kernel_dtypes").split(",") if d.strip())
            bad = [d for d in dtypes if d not in DTYPES]
            if bad:
                raise pytest.UsageError(f"--kernel-dtypes: unknown {bad}; choose from "
                                        f"{sorted(DTYPES)}")
        rounds = opt("kernel_rounds", None) or (GPU_ROUNDS if cuda else CPU_ROUNDS)
        if rounds < 1:
            raise pytest.UsageError(f"--kernel-rounds={rounds} must be >= 1")
        from spaceserve.kernels import device_num_sms

        env = cls(profile, device, device_num_sms(device), dtypes, rounds,
                  opt("kernel_timing", "graph") if cuda else "wall", opt("kernel_green", "auto"),
                  opt("kernel_deadline", None))
        env._choose_green()
        env.budgets = budgets(env.total_sms, 8 if env.green else 1)
        return env

    # -- green contexts ------------------------------------------------------------------------
    def _choose_green(self) -> None:
        if self.green_mode == "off":
            self.green_reason = "--kernel-green off"
            return
        if self.device.type != "cuda":
            self.green_reason = "no CUDA device"
        else:
            from spaceserve.runtime.spatial.partition import green_context_support

            self.green_reason = green_context_support(self.device)
        if self.green_reason is not None and self.green_mode == "on":
            raise pytest.UsageError(f"--kernel-green on: green contexts are unavailable "
                                    f"({self.green_reason})")

    @property
    def green(self) -> bool:
        return self.green_reason is None

    def _partition_set(self) -> Any:
        if self._partitions is None:
            from spaceserve.runtime.spatial.partition import PartitionSet

            splits = [b.sms for b in self.budgets if b.sms < self.total_sms]
            self._partitions = PartitionSet(self.device, splits, green=True)
            if not self._partitions.green:  # creation failed: fall back to grid budgets alone
                self.green_reason = self._partitions.reason or "green context creation failed"
        return self._partitions

    @contextlib.contextmanager
    def scope(self, budget: Budget) -> Iterator[tuple[int, str]]:
        """(SMs to pass as the budget, what bounds the SMs used) for the launches inside."""
        if budget.sms >= self.total_sms or not self.green:
            yield min(budget.sms, self.total_sms), "grid"
            return
        part = self._partition_set().get(budget.sms)
        if not part.green:
            yield budget.sms, "grid"
            return
        with part.encoder_scope():
            yield part.encoder_sms, "green-context"

    def close(self) -> None:
        if self._partitions is not None:
            self._partitions.close()
            self._partitions = None

    # -- cases ---------------------------------------------------------------------------------
    def cases(self, key: str, make: Callable[[], dict[str, list[Case]]]) -> dict[str, list[Case]]:
        if key not in self._cases:
            self._cases[key] = make()
        return self._cases[key]

    def build(self, key: Any, case: Case, dtype: str) -> Work:
        """The case's inputs, built once and kept while consecutive tests reuse them."""
        if self._built is not None and self._built[0] == key:
            return self._built[1]
        self._built = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        work = case.build(DTYPES[dtype], self.device)
        self._built = (key, work)
        return work

    def check_deadline(self) -> None:
        if self.deadline_s is not None and time.perf_counter() - self.start > self.deadline_s:
            pytest.skip(f"kernel suite deadline ({self.deadline_s:.0f} s) passed")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def round_setup(self) -> Callable[[], None] | None:
        if self.device.type != "cuda":
            return None
        if self._setup is None:
            self._setup = RoundSetup(self.device)
        return self._setup

    def timed(self, call: Callable[[], Any], bound: str) -> tuple[Callable[[], Any], str, Any]:
        """(what to time, how it is timed, graph to release)."""
        if self.device.type != "cuda":
            how = "wall-clock, Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" \
                else "wall-clock"
            return call, how, None
        if self.timing == "graph":
            stream = torch.cuda.current_stream() if bound == "green-context" else None
            try:
                graph = capture_graph(call, stream)
                return graph.replay, "cuda-graph replay between cuda events", graph
            except Exception as exc:  # a call that cannot be captured is timed eagerly
                self.sync()
                return call, (f"eager between cuda events (graph capture failed: "
                              f"{type(exc).__name__})"), None
        return call, "eager between cuda events", None


def case_budgeted(backend: str) -> bool:
    """Whether calls of `backend` take the SM budget (SpaceServe's Triton kernels do)."""
    return backend == "triton"


def launches(recs: list[Any]) -> list[dict[str, Any]]:
    return [{"kernel": r.name, "grid": list(r.grid), "programs": r.programs,
             "num_sms": r.num_sms, "programs_per_sm": r.programs_per_sm,
             "num_tiles": r.num_tiles} for r in recs]


def measure(benchmark: Any, env: SuiteEnv, key: Any, case: Case, dtype: str, budget: Budget,
            *, kernel: str, backend: str) -> None:
    """Time `case` at `budget` with `benchmark` and fill its `extra_info`."""
    from spaceserve.kernels import record_launches

    env.check_deadline()
    if not env.green and budget.sms < env.total_sms and not case_budgeted(backend):
        pytest.skip(f"{backend} takes no SM budget and green contexts are unavailable "
                    f"({env.green_reason}): only its whole-device point is measured")
    work = env.build(key, case, dtype)
    benchmark.group = f"{kernel} {case.name} {dtype}"
    with env.scope(budget) as (num_sms, bound):
        if not work.budgeted and bound != "green-context" and budget.sms < env.total_sms:
            pytest.skip(f"{work.api} takes no SM budget and no green context bounds it "
                        f"({env.green_reason}): only its whole-device point is measured")
        with record_launches() as recs:
            work.call(num_sms)
            env.sync()
        target, how, graph = env.timed(lambda: work.call(num_sms), bound)
        benchmark.pedantic(target, setup=env.round_setup(), rounds=env.rounds,
                           warmup_rounds=1 if env.device.type == "cuda" else 0, iterations=1)
        env.sync()
        if graph is not None:
            graph.reset()
    if work.budgeted:
        assert recs, f"{work.api} launched nothing the launch recorder saw"
        over = [r for r in recs if r.num_sms > num_sms or not r.within_budget]
        assert not over, f"launches over the budget of {num_sms} SMs: {launches(over)}"
    else:
        bound = "green-context" if bound == "green-context" else "none (whole device)"
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats else None
    benchmark.extra_info.update({
        "kernel": kernel, "backend": backend, "case": case.name, "model": case.model,
        "dtype": dtype, "api": work.api, "dims": work.dims, "profile": env.profile,
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "device_sms": env.total_sms, "budget": num_sms, "budget_requested": budget.sms,
        "budget_fraction": budget.fraction, "sm_bound": bound,
        "grid": launches(recs), "programs": max((r.programs for r in recs), default=None),
        "bytes": work.bytes, "flops": work.flops, "timing": how,
        "l2_flush": env.device.type == "cuda", "rounds": env.rounds,
        **derived(median, work.bytes, work.flops, device_peaks(env.device, dtype)),
    })
