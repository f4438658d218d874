"""The profiler's grid points: the stages and one measurement's coordinates (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class Point:
    """One measurement: `stage` at workload `work` on `sms` SMs, alone or co-running with the
    other stage on `other_sms` SMs. `units`: the curve value is seconds per call / units."""

    stage: str
    work: tuple[int, ...]
    sms: int
    corun: bool
    other_sms: int = 0
    units: float = 1.0

    @property
    def key(self) -> str:
        mode = "corun" if self.corun else "isolated"
        return f"{self.stage}:{'x'.join(str(w) for w in self.work)}@{self.sms}:{mode}"
