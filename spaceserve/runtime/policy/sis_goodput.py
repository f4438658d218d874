"""SIS's goodput objective: which waiting requests a split lets meet their TTFT SLO.

For a candidate encoder SM count `e` the prediction drains the queue as the executors would:
prompts whose embeddings are ready prefill first (the compute partition prefers them), then
encoder jobs in TWSRFT's order - jobs that can still meet their deadline shortest-remaining
first, late ones after - each followed by its requests' prefill, every latency from the curves
at `e` SMs co-running with the decoder. A request is on time when its age plus its predicted
finish stays within ``ttft_margin`` x the TTFT SLO. Only the first ``horizon`` live jobs are
drained one by one (beyond that the order no longer changes the split); a job already late at
`e` on its own counts as a miss without draining.

The arrival-rate term: ``load(e)`` = arrival rate x the mean image's encode + prefill time at
`e` SMs, the fraction of the encoder partition the arrivals keep busy. A split whose load stays
above ``max_load`` lets the queue grow however empty it is now.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.sis_state import SisState
from spaceserve.runtime.policy.sis_view import StateView, WorkTable
from spaceserve.runtime.policy.slo import Slo


@dataclass(frozen=True)
class Forecast:
    """A candidate split's predicted outcome for the waiting requests."""

    encoder_sms: int
    misses: int
    load: float


class GoodputPredictor:
    """Predicts TTFT misses and the arrival load per candidate split (module docstring)."""

    def __init__(self, curves: CurveSet, ttft_s: float | None, *, ttft_margin: float = 0.9,
                 max_load: float = 0.75, horizon: int = 48) -> None:
        self.curves = curves
        self.limit = None if ttft_s is None else ttft_margin * ttft_s
        self.max_load, self.horizon = max_load, horizon
        self._enc: dict[tuple, float] = {}
        self._pre: dict[tuple, float] = {}
        self.table = WorkTable(curves)
        self._view: StateView | None = None

    def view(self, state: SisState) -> StateView:
        """The round's view of `state` (built once per state: predictions are memoised)."""
        v = self._view
        if v is None or v.state is not state:
            v = self._view = StateView(state, self.table)
        return v

    def encode_s(self, patches: int, layers: int, e: int) -> float:
        key = (patches, layers, e)
        t = self._enc.get(key)
        if t is None:
            if len(self._enc) > 200_000:
                self._enc.clear()
            t = self._enc[key] = self.curves.encoder(patches, layers, e, True)
        return t

    def prefill_s(self, tokens: int, e: int) -> float:
        key = (tokens, e)
        t = self._pre.get(key)
        if t is None:
            if len(self._pre) > 200_000:
                self._pre.clear()
            t = self._pre[key] = self.curves.prefill(tokens, 0, e, True) if tokens > 0 else 0.0
        return t

    def misses(self, state: SisState, e: int) -> int:
        """Waiting requests predicted to miss their TTFT SLO with `e` encoder SMs."""
        if self.limit is None:
            return 0
        return self.view(state).misses(e, self.limit, self.horizon)

    def load(self, state: SisState, e: int) -> float:
        """Fraction of `e` encoder SMs the recent arrival rate keeps busy."""
        if state.arrival_rate <= 0:
            return 0.0
        patches = max(1, int(round(state.arrival_patches)))
        tokens = int(round(state.arrival_prompt))
        per = self.encode_s(patches, self.curves.encoder_depth, e) + self.prefill_s(tokens, e)
        return state.arrival_rate * per

    def forecast(self, state: SisState, e: int) -> Forecast:
        return Forecast(e, self.misses(state, e), self.load(state, e))

    def best(self, state: SisState, cands: Sequence[int]) -> Forecast:
        """Fewest predicted misses, then load within `max_load` (else the lowest), then the
        most encoder SMs: under pressure the backlog drains as fast as the decoder's SLO
        allows, so the next arrivals find a short queue."""
        return min((self.forecast(state, e) for e in cands), key=self.rank)

    def rank(self, fc: Forecast) -> tuple[int, float, int]:
        """Fewer misses, then less load beyond `max_load`, then more encoder SMs first."""
        return fc.misses, max(0.0, fc.load - self.max_load), -fc.encoder_sms

    def calm(self, fc: Forecast) -> bool:
        """Nothing predicted late and the arrivals leave headroom: no need to grow."""
        return fc.misses == 0 and fc.load <= self.max_load


# The encoder's order while SIS takes turns with SLO-aware admission: temporal-chunked's best
# configuration's. The best-temporal tuner (sim/sweep/tune.py) picks FIFO at the SLO-derived
# window at 14 of 19 points under SLO A, SLO B, batch 128 and ttft:1000,tpot:30 (within 0.9% of
# its pick at the others): with admission shedding the hopeless requests, arrival order under
# one shared TTFT bound is earliest deadline first. Without shedding, FIFO past saturation
# serves every request late, so there turns keep TWSRFT with the deadline (`turns_order`).
TURNS_ORDER = "fifo"
TURN_BUDGETS = (256, 512, 1024, 2048, 4096)  # prefill tokens per whole-device step, tried
MIN_WINDOW_S = 0.001  # a shorter window than this is not worth pausing the decoder for


@dataclass(frozen=True)
class Turns:
    """Taking turns on the whole GPU (temporal-chunked's schedule): an encoder window, then a
    whole-device decode step carrying at most `tokens` prompt tokens; `rate`: images/s of the
    mean arrival it sustains (0: no window fits)."""

    window_s: float
    tokens: int
    rate: float
    step_s: float = 0.0  # the predicted decode step carrying `tokens` (interval = window + it)

    def drain_s(self, tokens: float) -> float:
        """Seconds these turns take to prefill `tokens` (one budget per interval)."""
        return tokens / self.tokens * (self.window_s + self.step_s) if self.tokens else math.inf


# Under a TPOT bound the encoder passes its turn while the prompts it has already embedded
# would take at least AHEAD_OF_TTFT x the TTFT bound to prefill at the turns' pace
# (`hold_encoder`): another window then only lengthens the queue those requests wait in - where
# admission ends some of them after their encode, which is wasted - and stretches every decode
# interval. A TPOT bound (a mean) lets the window grow to most of the bound (20 ms against
# temporal-chunked's best 3.5-7 ms past saturation with 128 decodes): there the encoder outruns
# the prefill. Under an ITL bound the window is already what each gap leaves
# (`IntervalSpread`), and passing it starves the encoder (`--batch 128`, `ttft:2000,itl:21`:
# 3-15% fewer served at 14-20 img/s). A third: a quarter and a half held the bar as well
# against the grid tuner (sim-best-temporal.md).
AHEAD_OF_TTFT = 1 / 3


def itl_governs(slo: Slo) -> bool:
    """Whether `slo`'s decode bound is an ITL bound (no TPOT bound, or a looser one)."""
    return slo.itl is not None and (slo.tpot is None or slo.tpot >= slo.itl)


def hold_encoder(plan: Turns, backlog_tokens: int, slo: Slo) -> bool:
    """Whether the turns' encoder passes its window: under a TPOT bound, its embedded prompts'
    `backlog_tokens` take at least ``AHEAD_OF_TTFT`` x `slo`'s TTFT bound to prefill (no TTFT
    bound, or an ITL bound: never)."""
    return slo.ttft is not None and backlog_tokens > 0 and not itl_governs(slo) and \
        plan.drain_s(backlog_tokens) >= AHEAD_OF_TTFT * slo.ttft / 1e3


def plan_turns(curves: CurveSet, total: int, batch: int, context: float, bound_s: float,
               window_max_s: float, patches: int, prompt: int) -> Turns:
    """The turn-taking schedule sustaining the most arrivals within the decode bound: for each
    prefill budget, the largest window (up to `window_max_s`) whose interval - window plus the
    step carrying that budget - keeps `bound_s`; a cycle encodes window / (a mean image's
    whole-device encode) images and prefills budget / (its prompt) of them."""
    best = Turns(0.0, TURN_BUDGETS[0], 0.0)
    enc = curves.encoder(max(1, patches), curves.encoder_depth, total)
    for tokens in TURN_BUDGETS:
        step = curves.mixed_step(max(1, batch), context, tokens, 0, total)
        window = min(window_max_s, bound_s - step)
        if window < MIN_WINDOW_S:
            continue
        rate = min(window / enc, tokens / max(1, prompt)) / (window + step)
        if rate > best.rate:
            best = Turns(window, tokens, rate, step)
    return best


# The turns' window is paced to the prefill (`pace_window`): a pace - the share of the planned
# window the encoder runs - falls by a factor exp(PACE_STEP) each turns round while the prompts
# already embedded would take AHEAD_OF_TTFT x the TTFT bound or more to prefill at the paced
# turns' pace (the budget less one token per decoding request, each interval), and rises back
# otherwise, never below PACE_FLOOR. The queue then forms before the encoder, where admission
# ends a request before its encode, not after it. Past saturation temporal-chunked's best window
# is 0.6-0.7x the SLO-derived one with 128 decodes under an ITL bound and the derived one or
# longer with 32 (sim-best-temporal.md); a window cut to what a mean image's prefill absorbs
# (the rule this replaced there) missed both ways. Under a TPOT bound the pace comes on top of
# `hold_encoder`, which passes whole windows (0-1.3% more served with 128 decodes and under
# `ttft:1000,tpot:30` at 16-20 img/s; SLO A unchanged). The floor, 0.65 of the plan: with 128
# decodes under an ITL bound a half let the window swing between 3.7 and 7.5 ms around
# temporal-chunked's best 4.8 ms; 0.65 serves 1.5% more at 20 img/s on 8 seeds (0.9% on 8
# others), 0.3-0.6% less with 128 decodes under a TPOT bound (sim-best-temporal.md).
PACE_STEP = 0.02
PACE_FLOOR = 0.65

# Where nothing is shed (no SLO-aware admission: the turns' encoder runs TWSRFT with the
# deadline, `turns_order`), a request that waits after its encode - for a decoding slot or for
# its prefill - waits in arrival order whatever its deadline, and no one ends it: a queue there
# grows until every request is late. With 128 decodes at the sequence cap a request waits for a
# slot about (its place in the queue) x the interval, and the queue ahead grows with the
# interval too: the turns' 20 ms windows under a TPOT bound left 0.34-0.86x of `best-temporal`
# (4.8 ms windows) at 16-20 img/s, and 0.55-0.77x under an ITL bound. So there the pace also
# falls while the oldest request waiting for its prefill arrived more than AGE_HIGH x the TTFT
# bound ago and rises otherwise, down to QUEUE_PACE_FLOOR under a TPOT bound and
# QUEUE_ITL_PACE_FLOOR under an ITL bound. A band where the pace held (rising only below 0.2 x
# the bound) made it a ratchet: each spike of the oldest age lowered it, few raised it, and with 128
# decodes under an ITL bound it sat at the 0.65 floor, 4.6-4.9 ms windows where temporal-chunked's
# best is 4.1 ms (6.8 ms collapses); without the band and with the lower ITL floor 1.028 / 1.035x
# `best-temporal` at 18 / 20 img/s on seeds 0-7 and 1.003 / 0.993x on seeds 8-15, from 0.977 /
# 0.953x and 0.958 / 0.883x (sim-best-temporal.md). The ages also count the encoder's queue, so
# with 32 decodes under SLO A it costs 1.2% / 5.6% at 20 / 22 img/s (8 seeds).
AGE_HIGH = 0.5
QUEUE_PACE_FLOOR = 0.25
QUEUE_ITL_PACE_FLOOR = 0.55


def pace_window(pace: float, plan: Turns, backlog_tokens: int, batch: int, slo: Slo,
                oldest_s: float | None = None) -> float:
    """The turns' next pace (module comments above) from `pace`, for `plan` with
    `backlog_tokens` embedded prompt tokens waiting and `batch` decoding requests under `slo`;
    `oldest_s`: where nothing is shed, the age of the oldest request waiting for its prefill
    (None: SLO-aware admission sheds). 1 (the planned window) without a TTFT bound; unchanged
    where no window fits."""
    if slo.ttft is None:
        return 1.0
    if plan.rate <= 0:
        return pace
    ttft = slo.ttft / 1e3
    paced = replace(plan, window_s=pace * plan.window_s, tokens=max(1, plan.tokens - batch))
    down = paced.drain_s(backlog_tokens) > AHEAD_OF_TTFT * ttft
    floor = PACE_FLOOR
    if oldest_s is not None:
        down = down or oldest_s > AGE_HIGH * ttft
        floor = QUEUE_ITL_PACE_FLOOR if itl_governs(slo) else QUEUE_PACE_FLOOR
    return min(1.0, max(floor, pace * math.exp(-PACE_STEP if down else PACE_STEP)))


# Under an ITL bound (each request's own p99 gap) the turns' interval - window plus decode
# step - is held to what the requests measure, not to a flat margin over its prediction: SIS
# plans against TURNS_MARGIN x the bound less the p99 of the recent intervals' excess over their
# prediction (host time, a window's last layer running past it), never below SPREAD_FLOOR x the
# bound; until MIN_SPREADS intervals are measured, against ``decode_margin`` x the bound. Under
# a TPOT bound (a mean) the flat margin stays: there a longer window slows the turns' prefill
# (one budget per interval) more than it speeds the encoder (sim-best-temporal.md).
TURNS_MARGIN = 0.9
SPREAD_FLOOR = 0.5
SPREADS = 128  # recent intervals the spread is measured over
MIN_SPREADS = 16


class IntervalSpread:
    """The measured spread of the turns' decode intervals over their prediction: the executors
    report each decode step's tokens as they are read back (`read`), SIS each turns plan's
    predicted interval (`plan`); `bound` sizes the next window from them."""

    def __init__(self) -> None:
        self.spreads: deque[float] = deque(maxlen=SPREADS)
        self.planned = 0.0  # the last plan's interval: its window + its decode step
        self._last: float | None = None  # when the previous turns step's tokens were read
        self._p99: float | None = None  # the spreads' p99 (None: to be computed)

    def plan(self, turns: Turns, held: bool = False) -> None:
        """The interval `turns` predict: its decode step, after its window unless `held`."""
        self.planned = turns.step_s + (0.0 if held else turns.window_s)

    def read(self, now: float, turns: bool) -> None:
        """A decode step's tokens read back at `now`; `turns`: it ran on the whole GPU while SIS
        takes turns (else the next interval is not a turns interval and is not measured)."""
        if not turns:
            self._last = None
            return
        if self._last is not None and self.planned > 0:
            self.spreads.append(now - self._last - self.planned)
            self._p99 = None
        self._last = now

    def bound(self, slo: Slo, fallback_s: float) -> float:
        """The interval bound the turns are planned against under `slo` (module comment
        above), rounded down to 0.1 ms: `fallback_s` (``decode_margin`` x the decode bound)
        unless an ITL bound is the tighter and enough intervals are measured."""
        if not itl_governs(slo) or len(self.spreads) < MIN_SPREADS:
            return fallback_s
        itl = slo.itl
        if self._p99 is None:  # sorted once per new interval, not per question
            self._p99 = sorted(self.spreads)[int(0.99 * (len(self.spreads) - 1))]
        b = max(SPREAD_FLOOR, TURNS_MARGIN - max(0.0, self._p99) / (itl / 1e3)) * itl / 1e3
        return math.floor(b * 1e4) / 1e4


def turns_order(admission: str) -> str:
    """The encoder's order while taking turns: `TURNS_ORDER` under SLO-aware admission
    (``slo``), else TWSRFT (with its deadline)."""
    return TURNS_ORDER if admission == "slo" else "twsrft"


def order_encoder(scheds: Sequence[Any], turns: bool, deadline_s: float | None,
                  order: str = TURNS_ORDER) -> None:
    """Order the encoder jobs of `scheds` (`TwsrftScheduler`s) as the regime that runs: taking
    turns (`turns`), `order` (`turns_order`; FIFO without a deadline, as temporal-chunked's
    best configuration runs them); sharing, TWSRFT with the SLO's `deadline_s`. The engine's
    spatial step and the simulator's call it after each SIS decision, so both order alike."""
    fifo = turns and order == "fifo"
    policy, deadline = ("fifo", None) if fifo else ("twsrft", deadline_s)
    for s in scheds:
        if s.policy != policy or s.deadline_s != deadline:
            s.policy, s.deadline_s = policy, deadline
