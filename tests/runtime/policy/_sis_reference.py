"""SIS as it was before `decide` was made fast: the reference the fast one must agree with,
split for split and prediction for prediction (test_sis_fast.py). Not a public module."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spaceserve.runtime.modes import OBJECTIVES
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.scheduling import decode_bound_s
from spaceserve.runtime.policy.sis_state import SisState
from spaceserve.runtime.policy.slo import DEFAULT_SLO, Slo


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
        limit = self.limit
        t, missed = 0.0, 0
        ages: Sequence[float] = state.prefill_age_s
        for i, tokens in enumerate(state.prefill):
            t += self.prefill_s(tokens, e)
            if (ages[i] if i < len(ages) else 0.0) + t > limit:
                missed += 1
        live = []
        for j in state.encode:
            run = self.encode_s(j.patches, j.layers_left, e)
            pre = self.prefill_s(j.prefill_tokens, e)
            if j.age_s + t + run + pre > limit:
                missed += j.requests
            else:
                live.append((run + pre, j.age_s, j.requests))
        live.sort()
        for work, age, n in live[: self.horizon]:
            t += work
            if age + t > limit:
                missed += n
        return missed

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
        fcs = [self.forecast(state, e) for e in cands]
        return min(fcs, key=lambda f: (f.misses, max(0.0, f.load - self.max_load),
                                       -f.encoder_sms))

    def calm(self, fc: Forecast) -> bool:
        """Nothing predicted late and the arrivals leave headroom: no need to grow."""
        return fc.misses == 0 and fc.load <= self.max_load


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


class ReferenceSis:
    """Chooses the encoder/decoder SM split each scheduling round."""

    def __init__(self, curves: CurveSet, allowed_encoder_sms: Sequence[int], *,
                 total_sms: int | None = None, tpot_factor: float = 1.15,
                 tpot_target_s: float | None = None, tie_tolerance: float = 0.01,
                 min_gain: float = 0.1, min_dwell_s: float = 0.05, chunk_tokens: int = 512,
                 objective: str = "goodput", slo: Slo | None = None,
                 decode_margin: float = 0.8, ttft_margin: float = 0.9,
                 comfort_factor: float = 2.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if not 0 < decode_margin <= 1 or not 0 < ttft_margin <= 1 or comfort_factor < 1:
            raise ValueError("decode_margin, ttft_margin must be in (0, 1]; comfort_factor >= 1")
        self.objective, self.slo = objective, DEFAULT_SLO if slo is None else slo
        self.decode_margin, self.comfort_factor = decode_margin, comfort_factor
        ttft = None if self.slo.ttft is None else self.slo.ttft / 1e3
        self.predictor = GoodputPredictor(curves, ttft, ttft_margin=ttft_margin)
        total = curves.num_sms if total_sms is None else total_sms
        allowed = sorted(set(allowed_encoder_sms))
        if not allowed or any(not isinstance(e, int) or not 0 < e < total for e in allowed):
            raise ValueError(f"allowed_encoder_sms must be ints in 1..{total - 1}, "
                             f"got {list(allowed_encoder_sms)}")
        if not tpot_factor >= 1.0:
            raise ValueError(f"tpot_factor must be >= 1, got {tpot_factor}")
        if tpot_target_s is not None and not tpot_target_s > 0:
            raise ValueError(f"tpot_target_s must be positive, got {tpot_target_s}")
        if not 0 <= tie_tolerance < 1 or min_gain < 0 or min_dwell_s < 0:
            raise ValueError("tie_tolerance must be in [0, 1); min_gain, min_dwell_s >= 0")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.curves, self.total, self.allowed = curves, total, allowed
        self.tpot_factor, self.tpot_target_s = tpot_factor, tpot_target_s
        self.tie_tolerance, self.min_gain, self.min_dwell_s = tie_tolerance, min_gain, min_dwell_s
        self.chunk_tokens, self.clock = chunk_tokens, clock
        self.current: Split | None = None
        self._since = -math.inf
        self._sat_cache: dict[tuple, int] = {}
        self._cap_cache: dict[tuple, tuple[int, bool]] = {}

    # -- predictions -------------------------------------------------------------------------
    def tpot_target(self, batch: int, context: float) -> float:
        """The decode step SIS protects: the tpot objective's, or the goodput objective's
        calm (comfort) target."""
        if self.tpot_target_s is not None:
            return self.tpot_target_s
        unloaded = self.curves.decode(batch, context, self.total)
        if self.objective == "tpot":
            return self.tpot_factor * unloaded
        return min(self.comfort_factor * unloaded, self.slo_target())

    def slo_target(self) -> float:
        """The goodput objective's decode bound: ``decode_margin`` x the decode SLO."""
        bound = decode_bound_s(self.slo)
        return float("inf") if bound is None else self.decode_margin * bound

    def predict_tpot(self, state: SisState, encoder_sms: int) -> float:
        """Decode step time with `encoder_sms` given to a busy encoder (0: whole device)."""
        corun = encoder_sms > 0
        return self.curves.decode(state.decode_batch, state.decode_context,
                                  self.total - encoder_sms, corun)

    def predict_ttft(self, state: SisState, encoder_sms: int, prefill_on: str = "compute") -> float:
        """Mean predicted TTFT of waiting requests: jobs drain shortest first, then prefill."""
        c, e = self.curves, encoder_sms
        if e <= 0:
            return math.inf if (state.encode or state.prefill) else 0.0
        d = self.total - e
        finish: list[float] = []
        jobs = sorted(c.encoder(j.patches, j.layers_left, e, True) for j in state.encode)
        now = 0.0
        for t in jobs:
            now += t
            finish.append(now)
        prompts = list(state.prefill) + [j.prefill_tokens for j in state.encode
                                         if j.prefill_tokens > 0]
        done_at = finish[-1] if finish else 0.0
        for tokens in prompts:
            if prefill_on == "compute":
                done_at += c.prefill(tokens, 0, e, True)
            else:
                steps = math.ceil(tokens / self.chunk_tokens)
                step = c.mixed_step(state.decode_batch, state.decode_context,
                                    min(tokens, self.chunk_tokens), 0, d, True)
                done_at += steps * step
            finish.append(done_at)
        return sum(finish) / len(finish) if finish else 0.0

    def _saturation(self, kind: str, work: float, cap: int, cands: list[int]) -> int:
        """Fewest candidate SMs at which `work` runs within tolerance of its time at `cap`.

        Evaluated at curve grid points up to the first one >= `work` and maximised over them,
        so the answer never falls as the work grows.
        """
        if kind == "encoder":
            grid = self.curves.encoder_curve.grid["patches"]
            fn = lambda x, n: self.curves.encoder(x, 1, n, True)
        else:
            grid = self.curves.prefill_curve.grid["tokens"]
            fn = lambda x, n: self.curves.prefill(x, 0, n, True)
        top = min(bisect.bisect_left(grid, work), len(grid) - 1)
        key = (kind, cap, top)
        hit = self._sat_cache.get(key)
        if hit is not None:
            return hit
        best = cands[0]
        for x in grid[: top + 1]:
            limit = fn(x, cap) * (1.0 + self.tie_tolerance)
            best = max(best, next(n for n in cands if fn(x, n) <= limit))
        self._sat_cache[key] = best
        return best

    # -- the decision ------------------------------------------------------------------------
    def propose(self, state: SisState) -> Split:
        """The split SIS wants for `state`, ignoring hysteresis."""
        target = self.tpot_target(state.decode_batch, state.decode_context)
        if not state.encode and not state.prefill:
            tpot = self.predict_tpot(state, 0)
            return Split(0, self.total, "compute", 0.0, tpot, target, tpot <= target)
        cap, feasible = self._cap(state, target)
        cands = [e for e in self.allowed if e <= cap]
        enc = cands[0]
        for j in state.encode:
            enc = max(enc, self._saturation("encoder", j.patches, cap, cands))
        for tokens in [*state.prefill, *(j.prefill_tokens for j in state.encode)]:
            if tokens > 0:
                enc = max(enc, self._saturation("prefill", tokens, cap, cands))
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
        return p.best(state, cands).encoder_sms, max(slo, target), ok

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
        tpot = self.predict_tpot(state, enc)
        ttft = self.predict_ttft(state, enc, "compute")
        placement = "compute"
        prompts = [*state.prefill, *(j.prefill_tokens for j in state.encode)]
        if prompts and any(p > 0 for p in prompts):
            chunk = min(self.chunk_tokens, max(prompts))
            mixed = self.curves.mixed_step(state.decode_batch, state.decode_context, chunk, 0,
                                           self.total - enc, True)
            alt = self.predict_ttft(state, enc, "decode")
            if mixed <= target and alt < ttft:
                placement, ttft, tpot = "decode", alt, mixed
        return Split(enc, self.total - enc, placement, ttft, tpot, target,
                     feasible and tpot <= target)

    def decide(self, state: SisState) -> Split:
        """The split to use now: `propose` filtered through hysteresis."""
        now = self.clock()
        new = self.propose(state)
        cur = self.current
        if cur is None or self._forced(cur, new, state) or self._worth(cur, new, state, now):
            if cur is None or (new.encoder_sms, new.prefill_on) != (cur.encoder_sms,
                                                                     cur.prefill_on):
                self._since = now
            self.current = new
            return new
        held = self._place(state, cur.encoder_sms, new.tpot_target_s,
                           self.predict_tpot(state, cur.encoder_sms) <= new.tpot_target_s)
        self.current = held
        return held

    def _forced(self, cur: Split, new: Split, state: SisState) -> bool:
        if new.encoder_sms == cur.encoder_sms:
            return True  # same split: adopt fresh predictions and placement
        if new.encoder_sms == 0 or cur.encoder_sms == 0:
            return True  # work vanished or appeared
        shrinks = new.encoder_sms < cur.encoder_sms
        # the goodput objective's hard bound is the decode SLO's margin, not the calm target
        bound = new.tpot_target_s if self.objective == "tpot" else self.slo_target()
        if shrinks and self.predict_tpot(state, cur.encoder_sms) > bound:
            return True
        if self.objective == "goodput" and not shrinks:  # growing saves predicted misses
            p = self.predictor
            return p.misses(state, new.encoder_sms) < p.misses(state, cur.encoder_sms)
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
