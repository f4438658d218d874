"""The one persistent-loop idiom every SpaceServe kernel uses.

Launcher side: `launch_persistent` sizes the grid as ``min(num_sms * programs_per_sm, num_tiles)``
(at least one program), records the launch and runs the kernel. The budget reaches the kernel as
the grid, never as a constexpr, so changing it does not recompile.

Kernel side, the loop every kernel writes at its top::

    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        ...

Tile order is fixed by the problem (the launcher's work list), and each tile's reduction order is
fixed inside the tile, so results are bitwise identical for every budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from spaceserve.kernels.budget import LaunchRecord, _recorders, current_programs_per_sm, record


def persistent_grid(num_tiles: int, num_sms: int, programs_per_sm: int = 1) -> tuple[int]:
    """Grid of a persistent launch: never more programs than the budget allows."""
    return (max(1, min(num_tiles, num_sms * programs_per_sm)),)


def launch_persistent(
    kernel: Any,
    name: str,
    num_tiles: int,
    num_sms: int,
    args: Sequence[Any],
    *,
    programs_per_sm: int | None = None,
    config: dict[str, Any] | None = None,
    **meta: Any,
) -> tuple[int]:
    """Launch `kernel` persistently over `num_tiles` tiles under a budget of `num_sms` SMs.

    `programs_per_sm > 1` is only for green-context partitions whose SM count was read back from
    the driver (docs/design.md); elsewhere it must stay 1. None (the default) takes the value of
    the enclosing `budget.programs_per_sm_scope`, which is 1 outside a partition. `config` (block
    sizes, warps, stages) is passed to the kernel as keyword meta-parameters and kept in the launch
    record. Returns the grid.
    """
    if programs_per_sm is None:
        programs_per_sm = current_programs_per_sm()
    if programs_per_sm < 1:
        raise ValueError(f"programs_per_sm={programs_per_sm} must be >= 1")
    grid = persistent_grid(num_tiles, num_sms, programs_per_sm)
    cfg = dict(config or {})
    kernel[grid](*args, **cfg, **meta)
    if _recorders:
        record(LaunchRecord(name, grid, num_sms, programs_per_sm, num_tiles, cfg))
    return grid


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a linear tile index to (pid_m, pid_n) in grouped (swizzled) order for L2 reuse."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@dataclass(frozen=True)
class CompileSpec:
    """One kernel configuration for the ahead-of-time sm_90 compile check.

    `signature` maps every non-constexpr argument name to its Triton type string ("*fp16",
    "i32", ...); `constexprs` gives the constexpr values. `expect_wgmma` says whether the PTX must
    contain `wgmma` (tensor-core kernels with a large enough tile).
    """

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    expect_wgmma: bool = False
