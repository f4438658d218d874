"""The SM-budget contract: device SM count, budget validation and the launch recorder.

Every kernel in `spaceserve.kernels` takes `num_sms: int | None`. `None` means the whole
device. On CPU (the Triton interpreter) the device counts as an H200's 132 SMs, overridable with
the environment variable ``SPACESERVE_NUM_SMS``. A budget outside ``1..device SMs`` raises
`ValueError` before anything is launched.

Every launch is observable through `record_launches()`; when nobody records, recording costs one
truthiness check of an empty list. Collectives are launches too (NCCL's channels are thread
blocks, one SM each): a tensor-parallel communicator records each one it issues as a
``kind="collective"`` `LaunchRecord` whose grid is its bound on thread blocks (NCCL_MAX_CTAS) and
whose budget is the SMs of the stage it runs in (passed as `num_sms=`, as a kernel's is), so a
step's record shows every SM it may occupy.

Launches run one program per budgeted SM, except inside `programs_per_sm_scope(n)`: a green-context
partition whose SM count was read back from the driver sets it around its stage's launches, so
`launch_persistent` may size the grid up to ``num_sms * n`` (recorded in `LaunchRecord`). The
scope is a context variable: it holds for the thread (or task) that entered it and nowhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from spaceserve.checks import require_int

CPU_NUM_SMS = 132
NUM_SMS_ENV = "SPACESERVE_NUM_SMS"


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_num_sms(device: torch.device | str | int | None = None) -> int:
    """SM count of `device` (default: the current CUDA device, else the CPU stand-in).

    Inside a green context the driver still reports the whole GPU, which is why the budget is
    always passed explicitly rather than read from here.
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        device = torch.device(device)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    env = os.environ.get(NUM_SMS_ENV)
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{NUM_SMS_ENV}={env!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"{NUM_SMS_ENV}={value} must be >= 1")
        return value
    return CPU_NUM_SMS


def resolve_num_sms(num_sms: int | None, device: torch.device | str | int | None = None) -> int:
    """Validate a budget and turn `None` into the whole device; raises `ValueError`."""
    total = device_num_sms(device)
    if num_sms is None:
        return total
    if isinstance(num_sms, bool) or not isinstance(num_sms, int):
        raise ValueError(f"num_sms must be an int or None, got {type(num_sms).__name__}")
    if not 1 <= num_sms <= total:
        raise ValueError(f"num_sms={num_sms} is outside 1..{total} (SMs of this device)")
    return num_sms


@dataclass(frozen=True)
class LaunchRecord:
    """One launch: what ran, with how many programs, under which budget. `kind` is "kernel"
    (a Triton kernel: grid = its programs) or "collective" (a communicator's collective: grid
    = the most thread blocks it may run, `num_sms` = its stage's budget, `config` = group,
    backend, bytes and whether it can overlap the stage's kernels)."""

    name: str
    grid: tuple[int, ...]
    num_sms: int
    programs_per_sm: int = 1
    num_tiles: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    kind: str = "kernel"

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def within_budget(self) -> bool:
        return self.programs <= self.num_sms * self.programs_per_sm


_recorders: list[list[LaunchRecord]] = []
_lock = threading.Lock()


def is_recording() -> bool:
    return bool(_recorders)


def record(rec: LaunchRecord) -> None:
    """Append `rec` to every active recorder (called by `launch_persistent`)."""
    for sink in _recorders:
        sink.append(rec)


@contextlib.contextmanager
def record_launches() -> Iterator[list[LaunchRecord]]:
    """Collect one `LaunchRecord` per kernel launch made (from any thread) inside the block."""
    sink: list[LaunchRecord] = []
    with _lock:
        _recorders.append(sink)
    try:
        yield sink
    finally:
        with _lock:
            for i, s in enumerate(_recorders):
                if s is sink:
                    del _recorders[i]
                    break


def record_collective(name: str, ctas: int, num_sms: int, **config: Any) -> None:
    """Record a collective of at most `ctas` thread blocks issued inside a stage budget of
    `num_sms` SMs (a no-op when nobody records)."""
    if _recorders:
        record(LaunchRecord(name, (ctas,), num_sms, config=config, kind="collective"))


_PROGRAMS_PER_SM: contextvars.ContextVar[int] = contextvars.ContextVar(
    "spaceserve_programs_per_sm", default=1)


def current_programs_per_sm() -> int:
    """Programs per budgeted SM that a launch made here may use (1 outside a partition scope)."""
    return _PROGRAMS_PER_SM.get()


@contextlib.contextmanager
def programs_per_sm_scope(programs_per_sm: int) -> Iterator[None]:
    """Let launches inside the block run `programs_per_sm` programs per budgeted SM.

    Only a green-context partition (whose budget is the SM count the driver granted) enters a
    scope above 1; results do not change, since no kernel's work split depends on its grid.
    """
    require_int("programs_per_sm", programs_per_sm)
    token = _PROGRAMS_PER_SM.set(programs_per_sm)
    try:
        yield
    finally:
        _PROGRAMS_PER_SM.reset(token)
