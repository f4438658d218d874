"""SIS: the space inference scheduler, which picks the SM split between encoder and decoder.

Each scheduling round the engine describes what waits (encoder jobs, prompts to prefill) and the
decode load; SIS answers with a split from the partition's allowed encoder SM counts and with
where prefill runs. The rule, with every latency predicted from resource-utility curves:

1. No encoder or prefill work: the decoder gets every SM.
2. The TPOT target is ``tpot_factor`` x the decode step at the full device (or an absolute
   ``tpot_target_s``). Feasible splits are those whose co-running decode step meets it; the
   encoder may take at most the largest feasible split (if none is feasible, the smallest split,
   so encoder work still progresses).
3. Time-to-first-token of the waiting requests (encoder drain + prefill) only falls as the
   encoder gets SMs, so SIS minimises it with ties to the decoder: it gives the encoder the
   fewest SMs at which every waiting job - and every prompt's prefill - runs within
   ``tie_tolerance`` of its time at the cap. Each job's point is taken from a monotone envelope
   over the curve's workload grid, so more pending work never gets fewer encoder SMs at equal
   decode load.
4. Hysteresis: a change that is not forced (TPOT violated, work appearing or vanishing) needs
   ``min_dwell_s`` on the current split and a predicted gain (TTFT when the encoder grows,
   TPOT when it shrinks) of at least ``min_gain``.

Prefill runs beside the encoder ("compute") unless running it in chunks beside decode
("decode") keeps each mixed step within the TPOT target and predicts a lower TTFT.

That is the ``tpot`` objective (the paper's: TPOT first, at any TTFT cost). The default
``goodput`` objective maximises the requests predicted to meet their SLO (`sis_goodput`):

1. No encoder or prefill work: the decoder gets every SM (as above).
2. Calm - every waiting request predicted on time and the arrival-rate estimate leaving the
   encoder headroom at the comfort split: the rule above with the target ``comfort_factor`` x
   the unloaded step (bounded by the decode SLO's margin), so light load keeps TPOT near its
   unloaded value.
3. Under pressure: the decoder gets the fewest SMs whose co-running step keeps its SLO with a
   margin (``decode_margin`` x the tighter of the ``tpot`` and ``itl`` bounds) and the encoder
   may take the rest; among the splits from the comfort choice to that cap SIS takes the one with
   the fewest predicted TTFT misses (queue, ages, TWSRFT order), then the arrival load within
   bounds, then the most encoder SMs (the backlog drains as fast as the decode SLO allows).
4. Hysteresis as above; a split that saves predicted misses is adopted at once.

Actions (``actions``): "share" is the rule above, pure sharing. "superset" adds the
time-multiplexed schedule as a regime: when the image arrivals outgrow ``turns_at`` x what
sharing sustains (`capacities`: the mean arrival's encode + prefill on the compute partition at
the decode SLO's cap, blind to hand-offs waiting for a starved decoder; 0.3: where the sweeps of
sim-best-temporal.md find turns ahead) and taking turns sustains more than that (`turns_plan`), SIS
gives the encoder the whole GPU in windows (every SM, the decoder 0, prefill "decode"; each
followed by a whole-device step carrying at most the plan's prefill budget; the encoder's jobs
first in first out, `sis_goodput.order_encoder`) - what temporal-chunked runs - until the
arrivals fall below ``turns_until`` x the sharing capacity and no waiting request is predicted
to miss at that cap. Each change waits ``turns_dwell_s``. Window and budget keep the decode
SLO's margin (under an ITL bound, on the gaps measured: `sis_goodput.IntervalSpread`); where no
window fits, SIS shares. The encoder is held to the prefill's pace: under a TPOT bound it passes
its window (``hold``) while the embedded prompts outlast a third of the TTFT bound
(`sis_goodput.hold_encoder`), and under any TTFT bound its window shrinks while they do (or,
where nothing is shed, while the oldest of them waits long) and grows back when they do not
(``pace``, `sis_goodput.pace_window`). `action_counts` counts every action.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from spaceserve.checks import require_choice, require_int, require_number
from spaceserve.runtime.modes import ENCODER_POLICIES, OBJECTIVES, SIS_ACTIONS
from spaceserve.runtime.policy import sis_goodput as goodput
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.scheduling import decode_bound_s
from spaceserve.runtime.policy.sis_state import PendingEncode, SisState
from spaceserve.runtime.policy.slo import DEFAULT_SLO, Slo

__all__ = ["PendingEncode", "SisState", "SpaceInferenceScheduler", "Split"]


@dataclass(frozen=True)
class Split:
    """A decision: SMs per stage, prefill placement and the predictions behind it."""

    encoder_sms: int
    decoder_sms: int
    prefill_on: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    tpot_target_s: float
    tpot_ok: bool


class SpaceInferenceScheduler:
    """Chooses the encoder/decoder SM split each scheduling round."""

    def __init__(self, curves: CurveSet, allowed_encoder_sms: Sequence[int], *,
                 total_sms: int | None = None, tpot_factor: float = 1.15,
                 tpot_target_s: float | None = None, tie_tolerance: float = 0.01,
                 min_gain: float = 0.1, min_dwell_s: float = 0.05, chunk_tokens: int = 512,
                 objective: str = "goodput", slo: Slo | None = None,
                 decode_margin: float = 0.8, ttft_margin: float = 0.9,
                 comfort_factor: float = 2.5, actions: str = "share",
                 window_s: float = 0.02, turns_at: float = 0.3, turns_until: float = 0.2,
                 turns_dwell_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 turns_order: str = goodput.TURNS_ORDER) -> None:
        require_choice("sis actions", actions, SIS_ACTIONS)
        # the encoder's order in turns (`sis_goodput.turns_order`); "twsrft": nothing is shed
        self.turns_order = require_choice("turns_order", turns_order, ENCODER_POLICIES)
        require_number("window_s", window_s)
        if not 0 < turns_until <= turns_at or turns_dwell_s < 0:
            raise ValueError("need 0 < turns_until <= turns_at, turns_dwell_s >= 0; got "
                             f"{turns_until}, {turns_at}, {turns_dwell_s}")
        self.actions, self.window_s = actions, window_s
        self.turns_at, self.turns_until, self.turns_dwell_s = turns_at, turns_until, turns_dwell_s
        self.turns = False  # the superset's regime: taking turns on the whole GPU
        self._turns_since = -math.inf
        self.last_window_s, self.last_turn_tokens = 0.0, 0  # the last window and its budget
        self.hold = False  # the last window is passed: the encoder is ahead of the prefill
        self.pace = 1.0  # the share of the planned window the encoder runs (`pace_window`)
        self._turns_cache: dict[tuple, goodput.Turns] = {}  # keys bucketed; cleared at 1e5
        self.spread = goodput.IntervalSpread()  # the executors report each decode step's tokens
        self.counts: Counter[str] = Counter()
        require_choice("objective", objective, OBJECTIVES)
        if not 0 < decode_margin <= 1 or not 0 < ttft_margin <= 1 or comfort_factor < 1:
            raise ValueError("decode_margin, ttft_margin must be in (0, 1]; comfort_factor >= 1")
        self.objective, self.slo = objective, DEFAULT_SLO if slo is None else slo
        self.decode_margin, self.comfort_factor = decode_margin, comfort_factor
        ttft = None if self.slo.ttft is None else self.slo.ttft / 1e3
        self.predictor = goodput.GoodputPredictor(curves, ttft, ttft_margin=ttft_margin)
        total = curves.num_sms if total_sms is None else total_sms
        allowed = sorted(set(allowed_encoder_sms))
        if not allowed or any(not isinstance(e, int) or not 0 < e < total for e in allowed):
            raise ValueError(f"allowed_encoder_sms must be ints in 1..{total - 1}, "
                             f"got {list(allowed_encoder_sms)}")
        if not tpot_factor >= 1.0:
            raise ValueError(f"tpot_factor must be >= 1, got {tpot_factor}")
        require_number("tpot_target_s", tpot_target_s, optional=True)
        if not 0 <= tie_tolerance < 1 or min_gain < 0 or min_dwell_s < 0:
            raise ValueError("tie_tolerance must be in [0, 1); min_gain, min_dwell_s >= 0")
        require_int("chunk_tokens", chunk_tokens)
        self.curves, self.total, self.allowed = curves, total, allowed
        self.predictor.table.total = total
        self.tpot_factor, self.tpot_target_s = tpot_factor, tpot_target_s
        self.tie_tolerance, self.min_gain, self.min_dwell_s = tie_tolerance, min_gain, min_dwell_s
        self.chunk_tokens, self.clock = chunk_tokens, clock
        self.current: Split | None = None
        self._since = -math.inf
        self._cap_cache: dict[tuple, tuple[int, bool]] = {}
        self._tpot_cache: dict[tuple, float] = {}
        self._slo_key, self._slo_target = None, math.inf  # slo_target's cache

    # -- predictions -------------------------------------------------------------------------
    def tpot_target(self, batch: int, context: float) -> float:
        """The decode step SIS protects: the tpot objective's, or the goodput objective's
        calm (comfort) target."""
        if self.tpot_target_s is not None:
            return self.tpot_target_s
        key = (batch, context, 0)
        unloaded = self._tpot_cache.get(key)
        if unloaded is None:
            unloaded = self._tpot_cache[key] = self.curves.decode(batch, context, self.total)
        if self.objective == "tpot":
            return self.tpot_factor * unloaded
        return min(self.comfort_factor * unloaded, self.slo_target())

    def slo_target(self) -> float:
        """The goodput objective's decode bound: ``decode_margin`` x the decode SLO."""
        key = (self.slo, self.decode_margin)
        if self._slo_key != key:  # computed once (decide asks several times a round)
            bound = decode_bound_s(self.slo)
            self._slo_key, self._slo_target = key, (float("inf") if bound is None
                                                    else self.decode_margin * bound)
        return self._slo_target

    def predict_tpot(self, state: SisState, encoder_sms: int) -> float:
        """Decode step time with `encoder_sms` given to a busy encoder (0: whole device; every
        SM: a whole-GPU window, the interval between two decode steps)."""
        if encoder_sms >= self.total:
            return self.window(state) + self.predict_tpot(state, 0)
        key = (state.decode_batch, state.decode_context, encoder_sms)
        t = self._tpot_cache.get(key)
        if t is None:
            if len(self._tpot_cache) > 100_000:
                self._tpot_cache.clear()
            t = self._tpot_cache[key] = self.curves.decode(
                state.decode_batch, state.decode_context, self.total - encoder_sms,
                encoder_sms > 0)
        return t

    def predict_ttft(self, state: SisState, encoder_sms: int, prefill_on: str = "compute") -> float:
        """Mean predicted TTFT of waiting requests: jobs drain shortest first, then prefill."""
        if encoder_sms <= 0:
            return math.inf if (state.encode or state.prefill) else 0.0
        if encoder_sms >= self.total:
            stretch = self._stretch(state)
            return self.predictor.view(state).ttft(0, "compute", self.chunk_tokens, self.total,
                                                   stretch) if stretch else math.inf
        return self.predictor.view(state).ttft(encoder_sms, prefill_on, self.chunk_tokens,
                                               self.total)

    def window(self, state: SisState) -> float:
        """The whole-GPU window for `state` (`turns_plan`): 0 if none of ``MIN_WINDOW_S`` fits."""
        return self.turns_plan(state).window_s

    def turns_plan(self, state: SisState) -> goodput.Turns:
        """Taking turns for `state` (`sis_goodput.plan_turns`): the window and prefill budget
        that keep the decode SLO's margin and sustain the most of the mean arrival."""
        patches, prompt = _arrival(state)
        bound = self.spread.bound(self.slo, self.slo_target())  # under ITL: as measured
        key = (patches, prompt, state.decode_batch, state.decode_context, bound)
        hit = self._turns_cache.get(key)
        if hit is None:  # under a decode bound the bound alone sizes the window
            if len(self._turns_cache) > 100_000:
                self._turns_cache.clear()
            hit = self._turns_cache[key] = goodput.plan_turns(
                self.curves, self.total, state.decode_batch, state.decode_context, bound,
                self.window_s if math.isinf(bound) else math.inf, patches, prompt)
        return hit

    def _stretch(self, state: SisState) -> float:
        """Wall time per second of whole-device encoder time in windows (0: no window fits)."""
        return (w + self.predict_tpot(state, 0)) / w if (w := self.window(state)) else 0.0

    def misses(self, state: SisState, encoder_sms: int) -> int:
        """Waiting requests predicted to miss their TTFT with this split (every SM: a window)."""
        p = self.predictor
        if encoder_sms < self.total:
            return p.misses(state, encoder_sms)
        if p.limit is None:
            return 0
        stretch, view = self._stretch(state), p.view(state)
        if not stretch:  # no window fits: nothing would be served in one
            return view.total_requests + len(view.ready)
        return view.misses(0, p.limit, p.horizon, stretch)

    def capacities(self, state: SisState) -> tuple[float, float]:
        """(sharing, taking turns): image requests/s of the mean arrival (its ViT patches and
        prompt) sustained by the compute partition at the decode SLO's cap (encode + prefill on
        its co-running SMs), and by the whole GPU taking turns (`turns_plan`)."""
        patches, prompt = _arrival(state)
        c, e = self.curves, self._cap(state, self.slo_target())[0]
        share = 1.0 / (c.encoder(patches, c.encoder_depth, e, True) + c.prefill(prompt, 0, e, True))
        return share, self.turns_plan(state).rate

    def _regime(self, state: SisState, now: float) -> None:
        """The superset's hysteresis: take turns while the arrivals outgrow sharing and taking
        turns sustains more; share again once they fall back (module docstring)."""
        if self.actions != "superset" or now - self._turns_since < self.turns_dwell_s:
            return
        (share, turns), rate = self.capacities(state), state.arrival_rate
        if self.turns:  # back to sharing once the arrivals and the backlog fit it
            cap = self._cap(state, self.slo_target())[0]
            flip = turns <= 0 or (rate <= self.turns_until * share
                                  and not self.predictor.misses(state, cap))
        else:
            flip = turns > self.turns_at * share and rate >= self.turns_at * share
        if flip:
            self.turns, self._turns_since = not self.turns, now
            self.counts["regime:turns" if self.turns else "regime:share"] += 1

    # -- the decision ------------------------------------------------------------------------
    def propose(self, state: SisState) -> Split:
        """The split SIS wants for `state`, ignoring hysteresis."""
        target = self.tpot_target(state.decode_batch, state.decode_context)
        if not state.encode and not state.prefill:
            tpot = self.predict_tpot(state, 0)
            return Split(0, self.total, "compute", 0.0, tpot, target, tpot <= target)
        if self.turns and self.window(state) > 0:  # the superset's regime: take turns
            return self._place(state, self.total, max(self.slo_target(), target), True)
        cap, feasible = self._cap(state, target)
        cands = [e for e in self.allowed if e <= cap]
        enc = cands[0]
        view, sat = self.predictor.view(state), self.predictor.table.saturation
        tol = self.tie_tolerance  # saturation never falls as work grows: the largest job and
        if view.keys:             # prompt decide
            enc = max(enc, sat("encoder", view.max_patches, cap, cands, tol))
        if view.max_prompt > 0:
            enc = max(enc, sat("prefill", view.max_prompt, cap, cands, tol))
        if self.objective == "goodput":
            enc, target, feasible = self._pressure(state, enc, target, feasible)
        return self._place(state, enc, target, feasible)

    def _pressure(self, state: SisState, calm: int, target: float, feasible: bool
                  ) -> tuple[int, float, bool]:
        """The goodput objective: keep the calm split unless requests are predicted to miss
        or the arrivals outgrow it; then the best split up to the decode SLO's cap."""
        p = self.predictor
        if p.calm(p.forecast(state, calm)):
            return calm, target, feasible
        slo = self.slo_target()
        cap, ok = self._cap(state, slo)
        cands = [e for e in self.allowed if calm <= e <= cap] or [calm]
        best = p.best(state, cands)
        return best.encoder_sms, max(slo, target), ok

    def _cap(self, state: SisState, target: float) -> tuple[int, bool]:
        """The most encoder SMs whose co-running decode step meets `target` (and whether any
        split does; if none, the smallest split)."""
        key = (state.decode_batch, state.decode_context, target)
        hit = self._cap_cache.get(key)
        if hit is None:
            feasible = [e for e in self.allowed if self.predict_tpot(state, e) <= target]
            hit = (feasible[-1], True) if feasible else (self.allowed[0], False)
            if len(self._cap_cache) > 100_000:
                self._cap_cache.clear()
            self._cap_cache[key] = hit
        return hit

    def _place(self, state: SisState, enc: int, target: float, feasible: bool) -> Split:
        if enc >= self.total:  # a whole-GPU window; prompts prefill in the decode steps
            plan, backlog = self.turns_plan(state), sum(state.prefill)
            self.hold = goodput.hold_encoder(plan, backlog, self.slo)
            oldest = max(state.prefill_age_s, default=0.0) if self.turns_order != "fifo" \
                else None
            self.pace = goodput.pace_window(self.pace, plan, backlog, state.decode_batch,
                                            self.slo, oldest)
            if self.pace < 1:
                plan = replace(plan, window_s=max(goodput.MIN_WINDOW_S,
                                                  self.pace * plan.window_s))
            self.spread.plan(plan, self.hold)
            self.last_window_s, self.last_turn_tokens = plan.window_s, plan.tokens
            tpot = self.predict_tpot(state, enc)
            return Split(enc, 0, "decode", self.predict_ttft(state, enc), tpot, target,
                         tpot <= self.slo_target())
        tpot = self.predict_tpot(state, enc)
        ttft = self.predict_ttft(state, enc, "compute")
        placement = "compute"
        top = self.predictor.view(state).max_prompt
        if top > 0:
            chunk = min(self.chunk_tokens, top)
            mixed = self.predictor.table.mixed(state.decode_batch, state.decode_context, chunk,
                                               self.total - enc)
            alt = self.predict_ttft(state, enc, "decode")
            if mixed <= target and alt < ttft:
                placement, ttft, tpot = "decode", alt, mixed
        return Split(enc, self.total - enc, placement, ttft, tpot, target,
                     feasible and tpot <= target)

    def decide(self, state: SisState) -> Split:
        """The split to use now: `propose` filtered through hysteresis."""
        now = self.clock()
        self._regime(state, now)
        new = self.propose(state)
        cur = self.current
        if cur is None or self._forced(cur, new, state) or self._worth(cur, new, state, now):
            if cur is None or (new.encoder_sms, new.prefill_on) != (cur.encoder_sms,
                                                                     cur.prefill_on):
                self._since = now
            self.current = new
            return self._count(state, new)
        held = self._place(state, cur.encoder_sms, new.tpot_target_s,
                           self.predict_tpot(state, cur.encoder_sms) <= new.tpot_target_s)
        self.current = held
        return self._count(state, held)

    def _count(self, state: SisState, split: Split) -> Split:
        e = split.encoder_sms
        if e >= self.total:
            name = "window:held" if self.hold else "window:paced" if self.pace < 1 else "window"
        else:
            name = "decoder-only" if e == 0 else f"split:{e}"
        self.counts[name] += 1
        if e and self.predictor.view(state).max_prompt > 0:
            self.counts[f"prefill:{split.prefill_on}"] += 1
        return split

    def action_counts(self) -> dict[str, int]:
        """How often each action was chosen: ``split:E`` (E encoder SMs shared), ``window``
        (the whole GPU to the encoder), ``window:held`` (that window passed: `hold_encoder`) or
        ``window:paced`` (a share of it: `pace_window`),
        ``decoder-only``, and ``prefill:compute`` /
        ``prefill:decode`` (where prompts went, in rounds that had some)."""
        return dict(sorted(self.counts.items()))

    def _forced(self, cur: Split, new: Split, state: SisState) -> bool:
        if new.encoder_sms == cur.encoder_sms:
            return True  # same split: adopt fresh predictions and placement
        if 0 in (new.encoder_sms, cur.encoder_sms) or self.total in (new.encoder_sms,
                                                                      cur.encoder_sms):
            return True  # work vanished or appeared; a window begins or ends
        shrinks = new.encoder_sms < cur.encoder_sms
        # the goodput objective's hard bound is the decode SLO's margin, not the calm target
        bound = new.tpot_target_s if self.objective == "tpot" else self.slo_target()
        if shrinks and self.predict_tpot(state, cur.encoder_sms) > bound:
            return True
        if self.objective == "goodput" and not shrinks:  # growing saves predicted misses
            return self.misses(state, new.encoder_sms) < self.misses(state, cur.encoder_sms)
        return False

    def _worth(self, cur: Split, new: Split, state: SisState, now: float) -> bool:
        if now - self._since < self.min_dwell_s:
            return False
        if new.encoder_sms > cur.encoder_sms:
            old = self.predict_ttft(state, cur.encoder_sms, new.prefill_on)
            gain = (old - new.predicted_ttft_s) / old if old > 0 else 0.0
        else:
            old = self.predict_tpot(state, cur.encoder_sms)
            gain = (old - new.predicted_tpot_s) / old if old > 0 else 0.0
        return gain >= self.min_gain


def _arrival(state: SisState) -> tuple[int, int]:  # the mean arrival, in buckets of 64
    return max(1, round(state.arrival_patches / 64) * 64), round(state.arrival_prompt / 64) * 64
