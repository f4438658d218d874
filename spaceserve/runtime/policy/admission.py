"""SLO-aware admission (``--admission slo``): predict a request's TTFT from the scheduling state
and refuse, at once, the requests that cannot meet their TTFT bound.

Past saturation a queue grows without bound and the requests at its tail wait 20 s for an
answer that has long missed its SLO, while taking encoder, prefill and KV capacity from the
requests that could still meet theirs. A client would rather get a fast refusal with an honest
``Retry-After`` and try another replica. One predictor serves the engine, the Ray router and
the simulator, so what the simulator shows is what the engine does:

- **The work ahead.** Each queued request is a `Queued`: its encoder work left and its prefill
  left, in seconds at the split the engine runs now (`stage_costs` prices them from the
  resource-utility curves for each mode), its arrival, and whether TWSRFT has demoted it as
  late. Under TWSRFT a request waits for the live jobs with no more encoder work left than its
  own (shortest remaining first; late ones are demoted behind it); under FIFO for every earlier
  one. Every request ahead in the encoder and every encoded request that arrived before it is
  also ahead in prefill.
- **The prediction.** In the co-located modes encoder and prefill run at once (``pipelined``):
  TTFT = max(encoder work ahead + its own, prefill ahead) + its own prefill. In ``temporal``
  the stages take turns on the whole GPU and the terms add. The sum is scaled by a calibration
  learnt online (`observe`: actual over predicted wait of the requests served, a geometric
  moving average), so curves of another device (the analytic H200 ones on a CPU) still predict
  what this one does.
- **The rule.** At arrival a request is refused when its predicted TTFT exceeds
  ``admit_factor`` x the TTFT bound; a waiting request is ended (no token wasted; its KV blocks
  and encoder work freed) once what it has waited plus its predicted rest exceeds
  ``hopeless_factor`` x the bound - it has missed its SLO whatever runs next. Both carry a
  ``retry_after_s``: the predicted time for the backlog ahead to drain to where a new request
  would be admitted.

Without a TTFT bound nothing is refused. ``queue`` (the default, vLLM's behaviour) admits
everything. Pure Python; the curves are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spaceserve.checks import require_choice, require_number
from spaceserve.runtime.modes import ADMISSIONS, ENCODER_POLICIES, TEMPORAL_MODES
from spaceserve.runtime.policy.slo import Slo

ADMIT_FACTOR = 1.0  # refuse at arrival beyond this x the TTFT bound
HOPELESS_FACTOR = 1.0  # end a waiting request beyond this x the TTFT bound
# A server's door (before the request's body is read) refuses at this x the admit factor: a
# request it lets in is then rarely refused after its body was read and preprocessed.
DOOR_MARGIN = 0.9
SCALE_RANGE = (1e-3, 1e6)  # the calibration's bounds (a CPU runs the H200 curves ~1e4 slower)


class Refused(Exception):
    """A request refused (or ended while waiting) by SLO-aware admission: the TTFT it was
    predicted, its bound and when to retry. The server answers it with 503 and
    ``Retry-After``."""

    def __init__(self, predicted_s: float, bound_s: float, retry_after_s: float,
                 waiting: bool = False) -> None:
        self.predicted_s, self.bound_s = predicted_s, bound_s
        self.retry_after_s, self.waiting = retry_after_s, waiting
        what = "can no longer meet" if waiting else "cannot meet"
        super().__init__(f"overloaded: this request {what} its TTFT bound of {bound_s * 1e3:.0f} "
                         f"ms (predicted {predicted_s * 1e3:.0f} ms); retry after "
                         f"{retry_seconds(retry_after_s)} s")


def retry_seconds(retry_after_s: float) -> int:
    """A ``Retry-After`` header's whole seconds: the predicted drain rounded up, at least 1."""
    return max(1, math.ceil(retry_after_s - 1e-9))


@dataclass(frozen=True)
class Queued:
    """One queued request as admission sees it: work left in seconds at the current split."""

    encoder_s: float  # encoder work left (0: encoded, or nothing to encode)
    prefill_s: float  # prefill left
    arrival: float = 0.0
    late: bool = False  # TWSRFT has demoted it (it can no longer meet its deadline)


@dataclass(frozen=True)
class Prediction:
    """A request's predicted TTFT (from its arrival) and the verdict on it."""

    ttft_s: float
    admit: bool
    retry_after_s: float = 0.0


def _ahead(own: Queued, queue: Sequence[Queued], order: str) -> tuple[float, float]:
    """(encoder seconds, prefill seconds) of the work that runs before `own`."""
    enc = pre = 0.0
    for q in queue:
        if q is own:
            continue
        earlier = q.arrival < own.arrival
        if q.encoder_s <= 0.0:  # waiting for prefill only: ahead when it came first
            pre += q.prefill_s if earlier else 0.0
            continue
        if order == "fifo":
            first = earlier
        else:  # TWSRFT: live jobs with less work left first, late ones demoted
            first = not q.late and (q.encoder_s < own.encoder_s or (
                q.encoder_s == own.encoder_s and earlier))
        if first:
            enc += q.encoder_s
            pre += q.prefill_s
    return enc, pre


class AdmissionPolicy:
    """The admission rule (module docstring); `mode` ``queue`` admits everything."""

    def __init__(self, slo: Slo | str | None = None, *, mode: str = "slo",
                 order: str = "twsrft", pipelined: bool = True,
                 admit_factor: float = ADMIT_FACTOR, hopeless_factor: float = HOPELESS_FACTOR,
                 calibrate: bool = True, alpha: float = 0.2) -> None:
        self.mode = require_choice("admission", mode, ADMISSIONS)
        self.order = require_choice("order", order, ENCODER_POLICIES)
        self.slo = Slo.of(slo)
        self.bound_s = self.slo.ttft / 1e3 if self.slo.ttft is not None else None
        self.pipelined = bool(pipelined)
        self.admit_factor = float(require_number("admit_factor", admit_factor))
        self.hopeless_factor = float(require_number("hopeless_factor", hopeless_factor))
        self.calibrate = bool(calibrate)
        self.alpha = float(require_number("alpha", alpha))
        self.scale = 1.0
        self.refused = self.ended = 0  # counters: refused at arrival, ended while waiting

    @property
    def active(self) -> bool:
        """Whether anything can be refused (``slo`` mode with a TTFT bound)."""
        return self.mode == "slo" and self.bound_s is not None

    def predict_wait(self, own: Queued, queue: Sequence[Queued]) -> float:
        """Seconds from now to `own`'s first token, calibrated."""
        enc, pre = _ahead(own, queue, self.order)
        if self.pipelined:
            t = max(enc + own.encoder_s, pre) + own.prefill_s
        else:
            t = enc + own.encoder_s + pre + own.prefill_s
        return self.scale * t

    def _verdict(self, waited_s: float, wait_s: float, factor: float) -> Prediction:
        ttft = waited_s + wait_s
        if not self.active:
            return Prediction(ttft, True)
        limit = factor * self.bound_s
        # the backlog drains in real time: after (ttft - limit) a request like this fits
        return Prediction(ttft, ttft <= limit, max(0.0, ttft - limit))

    def check_arrival(self, own: Queued, queue: Sequence[Queued], waited_s: float = 0.0,
                      margin: float = 1.0) -> Prediction:
        """The verdict on a request arriving now, with `queue` (it may include `own`), that
        has already waited `waited_s` before reaching the queue (a server's preprocessing);
        `margin` < 1 refuses earlier (a server's door, before the request is known)."""
        p = self._verdict(waited_s, self.predict_wait(own, queue), margin * self.admit_factor)
        self.refused += not p.admit
        return p

    def check_waiting(self, own: Queued, queue: Sequence[Queued], waited_s: float
                      ) -> Prediction:
        """The verdict on a request that has waited `waited_s` (admit False: hopeless)."""
        p = self._verdict(waited_s, self.predict_wait(own, queue), self.hopeless_factor)
        self.ended += not p.admit
        return p

    def observe(self, predicted_wait_s: float, actual_wait_s: float) -> None:
        """A request served: its wait predicted at arrival (uncalibrated) against the wait it
        had; moves the calibration (geometric average, bounded)."""
        if not self.calibrate or not predicted_wait_s > 0 or not actual_wait_s > 0:
            return
        ratio = actual_wait_s / predicted_wait_s
        log = (1 - self.alpha) * math.log(self.scale) + self.alpha * math.log(ratio)
        self.scale = min(SCALE_RANGE[1], max(SCALE_RANGE[0], math.exp(log)))

    def refusal(self, p: Prediction, waiting: bool = False) -> Refused:
        """The error a refused (or hopeless) request ends with."""
        assert self.bound_s is not None
        return Refused(p.ttft_s, self.bound_s, p.retry_after_s, waiting)


def stage_costs(curves: Any, mode: str, *, encoder_sms: int | None = None,
                window_s: float = 0.02, budget: int = 2048, decode_batch: int = 0,
                decode_context: float = 0.0
                ) -> tuple[Callable[[int, int], float], Callable[[int], float], bool]:
    """How admission prices work in `mode` from resource-utility `curves`: (encoder seconds
    of `patches` x `layers`, prefill seconds of `tokens`, pipelined).

    ``temporal``: whole-GPU encoder passes and prefill in chunks of `budget` tokens, each chunk
    in a step beside the decode batch, taking turns (not pipelined). ``temporal-chunked``: the
    encoder runs `window_s` per step, so its work stretches by (window + step) / window while
    prefill rides in the steps (pipelined). Co-located modes: encoder and prefill on the
    encoder's `encoder_sms` while decode runs (pipelined)."""
    total = curves.num_sms
    step = curves.decode(decode_batch, decode_context, total) if decode_batch else 0.0

    def chunked_prefill(tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return curves.prefill(tokens, 0, total) + math.ceil(tokens / budget) * step

    if mode in TEMPORAL_MODES:
        if mode == "temporal":
            return (lambda p, n: curves.encoder(p, n, total) if p > 0 else 0.0,
                    chunked_prefill, False)
        cycle = window_s + step + curves.prefill(budget, 0, total)
        stretch = cycle / window_s
        return (lambda p, n: stretch * curves.encoder(p, n, total) if p > 0 else 0.0,
                chunked_prefill, True)
    sms = encoder_sms or total
    return (lambda p, n: curves.encoder(p, n, sms, True) if p > 0 else 0.0,
            lambda t: curves.prefill(t, 0, sms, True) if t > 0 else 0.0, True)


@dataclass(frozen=True)
class Pricing:
    """How admission prices the work ahead under one schedule: `stage_costs`'s encoder and
    prefill seconds and whether they pipeline, the encoder order and TWSRFT's deadline (None:
    no request is demoted as late)."""

    enc_s: Callable[[int, int], float]
    pre_s: Callable[[int], float]
    pipelined: bool
    order: str
    deadline_s: float | None


class RegimePricing:
    """Admission's pricing per SIS regime (``sis_actions`` superset), the same rule in the
    engine and the simulator: sharing as built (`sharing`); while SIS takes turns, as
    temporal-chunked with the turns' window and prefill budget and in the turns' encoder
    `order`, without a deadline (`stage_costs`), so the work ahead is priced as the schedule
    that runs now. The decode load is the caller's, as its sharing pricing has it."""

    def __init__(self, curves: Any, sharing: Pricing, order: str, *, decode_batch: int = 0,
                 decode_context: float = 0.0) -> None:
        self.curves, self.sharing = curves, sharing
        self.order = require_choice("order", order, ENCODER_POLICIES)
        self.decode_batch, self.decode_context = decode_batch, decode_context
        self._turns: dict[tuple[float, int], Pricing] = {}

    def pricing(self, turns: bool, window_s: float, budget: int) -> Pricing:
        """The pricing of the regime that runs: taking turns (`turns`, SIS's last window
        `window_s` carrying at most `budget` prefill tokens) or sharing."""
        if not turns or not window_s > 0 or budget <= 0:
            return self.sharing
        key = (round(window_s, 5), int(budget))
        hit = self._turns.get(key)
        if hit is None:
            if len(self._turns) > 1024:
                self._turns.clear()
            enc, pre, pipelined = stage_costs(
                self.curves, "temporal-chunked", window_s=key[0], budget=key[1],
                decode_batch=self.decode_batch, decode_context=self.decode_context)
            hit = self._turns[key] = Pricing(enc, pre, pipelined, self.order, None)
        return hit

    def switch(self, adm: Any, sis: Any) -> None:
        """Set `adm`'s pricing (an admission's ``enc_s``, ``pre_s``, ``deadline_s`` and its
        policy's ``pipelined`` and ``order``) to the regime `sis` (a
        `SpaceInferenceScheduler`, or None) runs now."""
        p = self.sharing if sis is None else self.pricing(
            sis.turns, sis.last_window_s, sis.last_turn_tokens)
        if adm.enc_s is p.enc_s:
            return
        adm.enc_s, adm.pre_s, adm.deadline_s = p.enc_s, p.pre_s, p.deadline_s
        adm.policy.pipelined, adm.policy.order = p.pipelined, p.order


__all__ = ["ADMISSIONS", "DOOR_MARGIN", "AdmissionPolicy", "Prediction", "Pricing", "Queued",
           "Refused", "RegimePricing", "retry_seconds", "stage_costs"]
