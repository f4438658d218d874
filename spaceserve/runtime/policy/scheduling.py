"""One scheduling behaviour for both executors: the split set, SIS's objective, TWSRFT's knobs.

The engine (`epd.build_spatial`) and the simulator (`sim.Simulator`) both build a
`SchedulingPolicy` with `scheduling_policy` from the same inputs - resource-utility curves, the
SLO and a reference decode load - so a simulated sweep predicts what the engine would do: the
same encoder SM splits, the same SIS objective and margins, the same TWSRFT ordering, deadline,
window and batching rule, and the same encoder launch model (the engine's cooperative driver
issues at most ``launch_budget_s / layer_launch_s`` vision layers per decode step).

The split set is chosen once at start-up (`choose_splits`), because decode CUDA graphs are
captured per partition and stay bound to it: graph memory grows with the number of splits. At
most ``max_splits`` encoder SM counts, multiples of the device's SM granularity (8 on Hopper):

- the *SLO cap*: the most encoder SMs whose co-running decode step, at the reference load, stays
  within ``decode_margin`` x the decode SLO (the tighter of ``tpot`` and ``itl``) - what SIS
  gives the encoder under pressure;
- the *comfort cap*: the most encoder SMs whose decode step stays within ``comfort_factor`` x the
  unloaded step - SIS's choice while every waiting request is predicted to meet its SLO anyway;
- the rest spread evenly from a quarter of the device up to the SLO cap.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spaceserve.runtime.modes import OBJECTIVES
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import DEFAULT_SLO, Slo

SM_GRANULARITY = 8  # Hopper green contexts hand out SMs in groups of 8
MAX_SPLITS = 6


@dataclass(frozen=True)
class SchedulingPolicy:
    """What SIS and TWSRFT run with, identical in the engine and the simulator."""

    splits: tuple[int, ...]  # encoder SM counts partitions exist for (ascending)
    total_sms: int
    objective: str = "goodput"  # SIS: "goodput" (default) or "tpot" (the paper-like baseline)
    slo: Slo = DEFAULT_SLO
    decode_margin: float = 0.8  # the decode step SIS keeps within this x the decode SLO
    ttft_margin: float = 0.9  # a waiting request counts as on time within this x its TTFT SLO
    comfort_factor: float = 2.5  # goodput objective: decode step x unloaded while calm
    tpot_factor: float = 1.15  # tpot objective: decode step x unloaded it protects
    window_s: float = 0.02  # TWSRFT grant (and temporal-chunked window)
    max_wait_s: float = 0.5  # TWSRFT aging period
    overdue_s: float | None = None  # TWSRFT's bounded tail (opt-in): overdue past deadline + this
    token_budget: int = 16384  # TWSRFT batching cap (merges happen only where free)
    launch_budget_s: float = 0.003  # cooperative driver: host time per decode step (floor)
    launch_fraction: float = 0.8  # ... or this share of the decode step's predicted time
    layer_launch_s: float = 0.00024  # host time to launch one vision layer (12 x 20 us)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"sis objective {self.objective!r} is not one of "
                             f"{', '.join(OBJECTIVES)}")
        if not self.splits or any(not 0 < e < self.total_sms for e in self.splits):
            raise ValueError(f"splits {self.splits} must be in 1..{self.total_sms - 1}")
        for name in ("decode_margin", "ttft_margin"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.comfort_factor < 1 or self.tpot_factor < 1:
            raise ValueError("comfort_factor and tpot_factor must be >= 1")

    @property
    def deadline_s(self) -> float | None:
        """TWSRFT's deadline: the TTFT SLO's share (None without a TTFT bound: plain aging)."""
        if self.slo.ttft is None:
            return None
        return self.ttft_margin * self.slo.ttft / 1e3

    def launch_budget(self, step_s: float = 0.0) -> float:
        """Host seconds the cooperative driver spends launching encoder layers while a decode
        step predicted to take `step_s` runs: the host waits for that step's tokens anyway, so
        launching for ``launch_fraction`` of it delays nothing (``launch_budget_s`` at least;
        a zero budget means one layer per step)."""
        if self.launch_budget_s <= 0:
            return 0.0
        return max(self.launch_budget_s, self.launch_fraction * step_s)

    def layers_per_step(self, step_s: float = 0.0) -> int:
        """Vision layers the cooperative driver launches per decode step (at least one)."""
        if self.layer_launch_s <= 0:
            return 1 << 30
        return max(1, int(self.launch_budget(step_s) / self.layer_launch_s))


def decode_bound_s(slo: Slo) -> float | None:
    """The decode SLO in seconds: the tighter of ``tpot`` and ``itl`` (None: unbounded)."""
    bounds = [v for v in (slo.tpot, slo.itl) if v is not None]
    return min(bounds) / 1e3 if bounds else None


def choose_splits(curves: CurveSet, slo: Slo = DEFAULT_SLO, *, total_sms: int | None = None,
                  granularity: int = SM_GRANULARITY, max_splits: int = MAX_SPLITS,
                  batch: int = 32, context: float = 1024.0, decode_margin: float = 0.8,
                  comfort_factor: float = 2.5) -> tuple[int, ...]:
    """The encoder SM splits partitions are made for (module docstring)."""
    total = curves.num_sms if total_sms is None else total_sms
    if granularity < 1 or max_splits < 1:
        raise ValueError("granularity and max_splits must be >= 1")
    grid = list(range(granularity, total - granularity + 1, granularity))
    if not grid:
        return (max(1, total // 2),) if total > 1 else ()

    def step(e: int) -> float:
        return curves.decode(batch, context, total - e, True)

    bound = decode_bound_s(slo)
    ok = [e for e in grid if bound is None or step(e) <= decode_margin * bound]
    slo_cap = ok[-1] if ok else grid[0]
    unloaded = curves.decode(batch, context, total)
    calm = [e for e in grid if e <= slo_cap and step(e) <= comfort_factor * unloaded]
    comfort = calm[-1] if calm else grid[0]
    chosen = {slo_cap, comfort}
    lo = min(max(granularity, int(round(total / 4 / granularity)) * granularity), slo_cap)
    fill = max_splits - len(chosen)
    if fill > 0 and slo_cap > lo:
        for i in range(fill + 1):
            e = lo + (slo_cap - lo) * i / fill
            chosen.add(int(round(e / granularity)) * granularity)
    chosen = {e for e in chosen if 0 < e < total}
    while len(chosen) > max_splits:  # drop the fill point closest to a neighbour
        xs = sorted(chosen)
        gaps = [(xs[i + 1] - xs[i - 1], xs[i]) for i in range(1, len(xs) - 1)
                if xs[i] not in (slo_cap, comfort)]
        chosen.discard(min(gaps)[1])
    return tuple(sorted(chosen))


def scheduling_policy(curves: CurveSet, slo: Slo | None = None, *, objective: str = "goodput",
                      total_sms: int | None = None, splits: tuple[int, ...] | None = None,
                      batch: int = 32, context: float = 1024.0,
                      granularity: int = SM_GRANULARITY, **knobs: float) -> SchedulingPolicy:
    """The policy both executors run; `splits` None chooses them (`choose_splits`). `knobs`
    set any other `SchedulingPolicy` field."""
    slo = DEFAULT_SLO if slo is None else slo
    total = curves.num_sms if total_sms is None else total_sms
    margin = float(knobs.get("decode_margin", 0.8))
    comfort = float(knobs.get("comfort_factor", 2.5))
    if splits is None:
        splits = choose_splits(curves, slo, total_sms=total, granularity=granularity,
                               batch=batch, context=context, decode_margin=margin,
                               comfort_factor=comfort)
    return SchedulingPolicy(tuple(sorted(set(splits))), total, objective, slo, **knobs)


MIN_SPAN_S = 0.25  # the shortest time a cold-start rate is taken over


class RateEstimator:
    """Image arrivals over a sliding window: rate, mean ViT patches and prompt tokens.

    From a cold start (the first arrival, or the first after a window without any) less than
    a window has been seen: the rate is then the arrivals after the first over the time since
    it (at least `MIN_SPAN_S`), so a burst is seen as it comes, not over a window it has not
    filled yet."""

    def __init__(self, window_s: float = 2.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._seen: deque[tuple[float, int, int]] = deque()
        self._patches = self._prompt = 0
        self._start = 0.0  # the first arrival since the window was last empty

    def add(self, t: float, patches: int, prompt_tokens: int) -> None:
        self._trim(t)
        if not self._seen:
            self._start = t
        self._seen.append((t, patches, prompt_tokens))
        self._patches += patches
        self._prompt += prompt_tokens

    def _trim(self, now: float) -> None:
        while self._seen and self._seen[0][0] <= now - self.window_s:
            _, p, q = self._seen.popleft()
            self._patches -= p
            self._prompt -= q

    def estimate(self, now: float) -> tuple[float, float, float]:
        """(images/s, mean patches, mean prompt tokens) over the last window (or since a
        cold start)."""
        self._trim(now)
        n = len(self._seen)
        if not n:
            return 0.0, 0.0, 0.0
        span = now - self._start
        rate = n / self.window_s if span >= self.window_s else (n - 1) / max(span, MIN_SPAN_S)
        return rate, self._patches / n, self._prompt / n


def graph_count(policy: SchedulingPolicy) -> int:
    """Partitions decode graphs are captured for: each split plus the whole device."""
    return len(policy.splits) + 1


__all__ = ["MAX_SPLITS", "OBJECTIVES", "SM_GRANULARITY", "RateEstimator", "SchedulingPolicy",
           "choose_splits", "decode_bound_s", "graph_count", "scheduling_policy"]
