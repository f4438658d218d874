"""A launch in flight in the simulator: the work left and how long the whole launch takes at
a given SM count, alone or beside the other lane."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Op:
    """A launch in flight on one lane: remaining work fraction and its latency model
    ``fn(sms, other)`` (whole-op seconds; `other` False alone, else the other lane's SMs)."""

    lane: str
    kind: str
    sms: int
    fn: Callable[[int, int | bool], float]
    payload: object
    remaining: float = 1.0
    _lat: dict = field(default_factory=dict, repr=False)

    def latency(self, sms: int, other: int | bool) -> float:
        key = (sms, other)
        if key not in self._lat:
            self._lat[key] = self.fn(sms, other)
        return self._lat[key]


def lane_latencies(ops: dict[str, Op], shared: bool, total: int,
                   share: float) -> dict[str, float]:
    """Whole-op seconds of each running op (by lane) at the current co-running state; `shared`:
    both on all `total` SMs, decode getting `share` of their throughput. The ``host`` lane (an
    engine's host time, no device work) runs beside either at its own pace."""
    out = {lane: op.latency(op.sms, False) for lane, op in ops.items()}
    if "compute" not in ops or "decode" not in ops:
        return out
    comp, dec = ops["compute"], ops["decode"]
    if shared:
        d = max(1, round(total * share))
        e = max(1, round(total * (1 - share)))
    else:
        e, d = comp.sms, dec.sms
    out.update(compute=comp.latency(e, d), decode=dec.latency(d, e))
    return out
