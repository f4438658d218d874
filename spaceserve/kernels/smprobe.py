"""SM probe: which SM each program of a persistent launch ran on (GPU only).

The probe kernel walks its tiles with the same persistent loop as every SpaceServe kernel and
writes the ``%smid`` register (read through inline PTX) of the program that ran each tile, after
a short busy loop that keeps the SM occupied so programs spread over the SMs they may use.
Launched on each stage's stream with the stage's budget, two concurrent probes show directly
whether the encoder's and the decoder's programs ever shared an SM: under green contexts they
must not; with kernel budgets alone they may (a budget bounds how many SMs, not which).

The time probe (`probe_times`) is the same loop with the ``%globaltimer`` register (ns, one
clock for the whole GPU) read when each program starts and ends: launched on two streams at
once, `overlap_fraction` of the two launches says how much of the time they actually ran
together (concurrency measured, not assumed).

The Triton interpreter (every CPU run) has no inline assembly, so `probe_sms` and `probe_times`
raise `SmProbeUnavailable` there with the reason; `probe_report` and `overlap_fraction` turn
results into summaries (plain host code, tested on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from spaceserve.kernels.budget import current_programs_per_sm, resolve_num_sms
from spaceserve.kernels.persistent import CompileSpec, launch_persistent, persistent_grid

NAME = "smprobe"
UNAVAILABLE = ("the SM probe reads %smid through inline PTX, which needs a CUDA device; the "
               "Triton interpreter (TRITON_INTERPRET=1, every CPU run) has no inline assembly")


class SmProbeUnavailable(RuntimeError):
    """The probe cannot run here (no CUDA device, or the Triton interpreter is active)."""


@triton.jit
def _smprobe_kernel(out_ptr, sink_ptr, num_tiles, SPIN: tl.constexpr):
    """out[tile] = the SM that ran `tile`; each tile spins SPIN dependent steps first."""
    pid = tl.program_id(0)
    seed = tl.zeros([1], dtype=tl.int32) + pid
    for tile in tl.range(pid, num_tiles, tl.num_programs(0)):
        acc = seed + tile
        for _ in range(SPIN):
            acc = acc * 1103515245 + 12345
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [acc], dtype=tl.int32,
                                         is_pure=False, pack=1)
        tl.store(out_ptr + tile + tl.arange(0, 1), smid)
        tl.store(sink_ptr + pid + tl.arange(0, 1), acc)


@triton.jit
def _globaltimer(dep):
    """The GPU's global nanosecond timer, read after `dep` is computed (a data dependency keeps
    the read in program order)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _timeprobe_kernel(out_ptr, sink_ptr, num_tiles, SPIN: tl.constexpr):
    """out[pid] = (start ns, end ns, SM) of each program; its tiles spin SPIN steps each."""
    pid = tl.program_id(0)
    seed = tl.zeros([1], dtype=tl.int32) + pid
    start = _globaltimer(seed)
    acc = seed + (start & 1).to(tl.int32)
    for tile in tl.range(pid, num_tiles, tl.num_programs(0)):
        acc = acc + tile
        for _ in range(SPIN):
            acc = acc * 1103515245 + 12345
    end = _globaltimer(acc)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [acc], dtype=tl.int32,
                                     is_pure=False, pack=1)
    one = tl.arange(0, 1)
    tl.store(out_ptr + pid * 3 + one, start)
    tl.store(out_ptr + pid * 3 + 1 + one, end)
    tl.store(out_ptr + pid * 3 + 2 + one, smid.to(tl.int64))
    tl.store(sink_ptr + pid + one, acc)


def probe_available(device: torch.device | str | None = None) -> str | None:
    """Why the probe cannot run on `device` (None when it can)."""
    import os

    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return UNAVAILABLE
    if dev.type != "cuda" or not torch.cuda.is_available():
        return UNAVAILABLE
    return None


def launch_smprobe(out: torch.Tensor, *, num_sms: int | None = None, spin: int = 2048
                   ) -> torch.Tensor:
    """Launch the probe on the current stream: ``out[tile]`` (int32, one entry per tile) gets
    the SM of the program that ran it. No host sync; read `out` after the stream is done."""
    if out.dtype != torch.int32 or out.dim() != 1 or out.numel() < 1:
        raise ValueError("out must be a non-empty 1-D int32 tensor")
    why = probe_available(out.device)
    if why is not None:
        raise SmProbeUnavailable(why)
    budget = resolve_num_sms(num_sms, out.device)
    sink = torch.empty(out.numel(), dtype=torch.int32, device=out.device)
    launch_persistent(_smprobe_kernel, NAME, out.numel(), budget, (out, sink, out.numel()),
                      SPIN=spin)
    return out


def probe_sms(num_sms: int | None = None, *, tiles_per_sm: int = 8, spin: int = 2048,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Allocate a buffer and launch the probe on the current stream (`launch_smprobe`)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    why = probe_available(dev)
    if why is not None:
        raise SmProbeUnavailable(why)
    budget = resolve_num_sms(num_sms, dev)
    out = torch.full((budget * tiles_per_sm,), -1, dtype=torch.int32, device=dev)
    return launch_smprobe(out, num_sms=budget, spin=spin)


def probe_times(num_sms: int | None = None, *, tiles_per_sm: int = 64, spin: int = 2048,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Launch the time probe on the current stream under `num_sms`: returns ``[programs, 3]``
    int64 (start ns, end ns, SM) per program, filled once the stream is done (-1 before).
    No host sync."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    why = probe_available(dev)
    if why is not None:
        raise SmProbeUnavailable(why)
    budget = resolve_num_sms(num_sms, dev)
    tiles = budget * tiles_per_sm
    (programs,) = persistent_grid(tiles, budget, current_programs_per_sm())
    out = torch.full((programs, 3), -1, dtype=torch.int64, device=dev)
    sink = torch.empty(programs, dtype=torch.int32, device=dev)
    launch_persistent(_timeprobe_kernel, "timeprobe", tiles, budget, (out, sink, tiles),
                      SPIN=spin)
    return out


def _span(times: torch.Tensor | Sequence[Sequence[int]]) -> tuple[int, int]:
    rows = times.tolist() if isinstance(times, torch.Tensor) else [list(r) for r in times]
    if not rows or any(r[0] < 0 or r[1] < r[0] for r in rows):
        raise ValueError("time probe results hold unwritten or reversed entries: read them "
                         "after the stream finished")
    return min(r[0] for r in rows), max(r[1] for r in rows)


def overlap_fraction(a: torch.Tensor | Sequence[Sequence[int]],
                     b: torch.Tensor | Sequence[Sequence[int]]) -> dict[str, float]:
    """How much two time-probe launches ran together: the length of the intersection of their
    spans (first start to last end) over the shorter span (1.0: the shorter ran entirely while
    the other did; 0.0: one after the other), with both spans in microseconds."""
    (s0, e0), (s1, e1) = _span(a), _span(b)
    both = max(0, min(e0, e1) - max(s0, s1))
    shorter = max(1, min(e0 - s0, e1 - s1))
    return {"overlap_fraction": round(min(1.0, both / shorter), 4),
            "a_us": (e0 - s0) / 1e3, "b_us": (e1 - s1) / 1e3,
            "start_gap_us": abs(s1 - s0) / 1e3}


@dataclass(frozen=True)
class ProbeReport:
    """SMs seen by each stage's probe and those seen by more than one stage."""

    sms: dict[str, tuple[int, ...]]
    budgets: dict[str, int] = field(default_factory=dict)
    shared: tuple[int, ...] = ()

    @property
    def disjoint(self) -> bool:
        return not self.shared

    def within_budgets(self) -> bool:
        """Whether every stage ran on no more distinct SMs than its budget."""
        return all(len(self.sms[k]) <= b for k, b in self.budgets.items() if k in self.sms)

    def summary(self) -> str:
        parts = [f"{k}: {len(v)} SMs" + (f" (budget {self.budgets[k]})" if k in self.budgets
                                         else "") for k, v in self.sms.items()]
        verdict = "disjoint" if self.disjoint else f"{len(self.shared)} SMs shared"
        return "; ".join(parts) + f"; {verdict}"


def probe_report(results: dict[str, torch.Tensor | Sequence[int]],
                 budgets: dict[str, int] | None = None) -> ProbeReport:
    """Summarise probe buffers ``{stage: smids}`` (read after the streams finished)."""
    seen: dict[str, tuple[int, ...]] = {}
    for name, ids in results.items():
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any(v < 0 for v in values):
            raise ValueError(f"results[{name!r}] holds unwritten entries (-1): read it after its "
                             "stream finished")
        seen[name] = tuple(sorted(set(int(v) for v in values)))
    counts: dict[int, int] = {}
    for ids in seen.values():
        for sm in ids:
            counts[sm] = counts.get(sm, 0) + 1
    shared = tuple(sorted(sm for sm, c in counts.items() if c > 1))
    return ProbeReport(seen, dict(budgets or {}), shared)


def compile_specs() -> list[Any]:
    """The probes for the sm_90 compile check."""
    sig = {"out_ptr": "*i32", "sink_ptr": "*i32", "num_tiles": "i32"}
    times = {"out_ptr": "*i64", "sink_ptr": "*i32", "num_tiles": "i32"}
    return [CompileSpec("smprobe", _smprobe_kernel, sig, {"SPIN": 2048}, num_warps=1),
            CompileSpec("timeprobe", _timeprobe_kernel, times, {"SPIN": 2048}, num_warps=1)]
