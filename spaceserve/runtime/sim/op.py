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
