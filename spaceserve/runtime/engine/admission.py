"""The engine's SLO-aware admission (``EngineConfig.admission = "slo"``, `--admission slo`).

`Engine.add_request` asks `EngineAdmission.admit` before it queues a request: the predictor
(`policy.admission.AdmissionPolicy`) prices it against the requests still waiting for their
first token - encoder work left (the media not encoded yet), prefill left, in the scheduling
policy's order (TWSRFT's, or FIFO) and at the mode's costs (`policy.admission.stage_costs`
from the curves the engine schedules by) - and a request that cannot meet its TTFT bound
raises `Refused` at once (the server's 503 with ``Retry-After``), before anything is queued.
Each step (`check`, at most every `CHECK_S`) the waiting requests are priced again and a
request that can no longer meet its bound is ended like an abort, with finish reason "error":
its KV blocks and encoder work are freed and no token is drawn for it; its final output
carries ``extra = {"status": 503, "retry_after": s}`` so the server answers it as it answers a
refusal. A request whose prefill has begun is left to finish. The calibration learns from
every first token how far the curves' prediction is from this machine's time. With SIS's
superset each check first prices as the regime SIS runs (`policy.admission.RegimePricing`, as
the simulator does): while it takes turns, temporal-chunked's costs at the turns' window and
budget, in the turns' encoder order.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from typing import Any

from spaceserve.runtime.core.request import Request, RequestOutput, Status
from spaceserve.runtime.policy.admission import (
    AdmissionPolicy,
    Pricing,
    Queued,
    Refused,
    RegimePricing,
    retry_seconds,
    stage_costs,
)
from spaceserve.runtime.policy.model_curves import load_curves
from spaceserve.runtime.policy.sis_goodput import TURNS_ORDER

CHECK_S = 0.02  # the waiting requests are priced again at most this often (seconds)
DOOR_S = 0.005  # the server's door reuses the priced queue this long (seconds)
RECENT = 64  # the door prices an unseen request as the smallest of this many recent ones


class EngineAdmission:
    """Admission for one `Engine` (module docstring); inactive (admits everything, tracks
    nothing) under ``queue`` or without a TTFT bound."""

    def __init__(self, engine: Any) -> None:
        cfg = engine.config
        self.engine = engine
        order = cfg.encoder_policy if cfg.mode == "temporal-chunked" else (
            "fifo" if cfg.mode == "temporal" else "twsrft")
        self.policy = AdmissionPolicy(cfg.slo, mode=cfg.admission, order=order)
        self.active = self.policy.active
        self._lock = threading.Lock()
        self.waiting: dict[str, Request] = {}  # admitted, no first token yet
        self.predicted: dict[str, float] = {}  # their uncalibrated wait predicted at arrival
        self.ended: dict[str, Refused] = {}  # ended while waiting, until their final output
        self.front: dict[str, float] = {}  # request id -> when the server admitted it
        self.entering: dict[int, float] = {}  # past the server's door, not yet at `front`
        self._tickets = itertools.count()
        self.offset: dict[str, float] = {}  # request id -> its wait before add_request
        self.front_delay_s, self._front_at = 0.0, 0.0  # recent wait before add_request
        self._next_check = 0.0
        self._door: tuple[float, list[Queued]] = (-1.0, [])  # the door's priced queue, when
        # (encoder s, prefill s, has media) of the last requests priced at arrival
        self.recent: deque[tuple[float, float, bool]] = deque(maxlen=RECENT)
        self._media = getattr(engine.encoder, "media", None)  # which requests are encoded
        self.regimes: RegimePricing | None = None  # the superset's pricing per SIS regime
        if not self.active:
            return
        curves = load_curves(cfg.curves, engine.runner)
        self.depth = curves.encoder_depth
        self.enc_s, self.pre_s, pipelined = stage_costs(
            curves, cfg.mode, encoder_sms=cfg.encoder_sms, window_s=cfg.encoder_window_s,
            budget=cfg.max_num_batched_tokens)
        self.policy.pipelined = pipelined
        deadline = self.policy.bound_s * 0.9 if order == "twsrft" else None
        self.deadline_s = deadline
        if cfg.mode == "spatial" and cfg.sis_actions == "superset":  # priced as SIS's regime
            self.regimes = RegimePricing(
                curves, Pricing(self.enc_s, self.pre_s, pipelined, order, deadline), TURNS_ORDER)

    @property
    def counts(self) -> dict[str, int]:
        """Requests refused at arrival and ended while waiting, so far."""
        return {"admission_refused": self.policy.refused, "admission_ended": self.policy.ended}

    def _queued(self, req: Request, now: float) -> Queued:
        mm = req.mm
        encoded = mm is None or req.num_computed > 0 or req.first_token_time is not None or (
            self._media is not None and req.request_id in self.waiting
            and self._media.ready(req, 0))  # embeddings held (no lookup: any thread)
        patches = 0 if encoded else int(mm.pixel_values.shape[0])
        enc = self.enc_s(patches, self.depth) if patches else 0.0
        pre = self.pre_s(max(0, req.num_prompt_tokens - req.num_computed))
        late = self.deadline_s is not None and now + enc > req.arrival_time + self.deadline_s
        return Queued(enc, pre, req.arrival_time, late)

    def _queue(self, now: float) -> dict[str, Queued]:
        with self._lock:
            reqs = list(self.waiting.items())
        return {rid: self._queued(r, now) for rid, r in reqs}

    def admit(self, req: Request, error: str | None = None) -> None:
        """Refused (raised) when `req`, arriving now, cannot meet its TTFT bound; else it is
        tracked until its first token (any thread). A request whose prompt failed (`error`)
        is not priced: it ends with its error."""
        if not self.active:
            return
        now, rid = req.arrival_time, req.request_id
        came = self.front.pop(rid, None)
        if error is not None:
            return
        before = max(0.0, now - came) if came is not None else 0.0
        if came is not None:  # what a request meets before the engine (preprocessing)
            self.front_delay_s = 0.8 * self._front_delay(now) + 0.2 * before
            self._front_at = now
        own = self._queued(req, now)
        self.recent.append((own.encoder_s, own.prefill_s, req.mm is not None))
        queue = list(self._queue(now).values())
        p = self.policy.check_arrival(own, queue, before)
        if not p.admit:
            raise self.policy.refusal(p)
        self._door = (-1.0, [])
        with self._lock:
            self.offset[rid] = before
            self.waiting[req.request_id] = req
            self.predicted[req.request_id] = self.policy.predict_wait(own, queue) / \
                self.policy.scale

    def note_arrival(self, request_id: str, at: float, ticket: int | None = None) -> None:
        """The server admitted `request_id` at `at` (monotonic), before preprocessing it:
        that wait counts toward its TTFT; `ticket` (`enter`) moves it from the door (any
        thread)."""
        if self.active:
            self.front[request_id] = at
            self.leave(ticket)

    def enter(self, at: float) -> int:
        """A request passed the server's door at `at` (its body not read yet): it counts
        ahead of later arrivals until `note_arrival` or `leave` (any thread)."""
        ticket = next(self._tickets)
        self.entering[ticket] = at
        return ticket

    def leave_front(self, request_id: str) -> None:
        """`request_id` ended before `add_request` (its preprocessing failed or was given
        up): it no longer counts ahead of new arrivals (any thread)."""
        self.front.pop(request_id, None)

    def leave(self, ticket: int | None) -> None:
        """The request of `ticket` reached the engine's front, or ended before it."""
        if ticket is not None:
            self.entering.pop(ticket, None)

    def _front_delay(self, now: float) -> float:
        """The recent wait before add_request, fading over a second without news."""
        return self.front_delay_s * math.exp(-max(0.0, now - self._front_at))

    def precheck(self, now: float | None = None, front_s: float = 0.0,
                 media_front_s: float | None = None, margin: float = 1.0) -> Refused | None:
        """At the server's door, before any preprocessing: the refusal when even a request as
        small as the smallest of the last `RECENT` (no work at all before the first) would
        miss the bound behind the requests being preprocessed (each priced as that one), the
        wait before the engine (the recent one, or the one the
        server predicts from its preprocessing backlog: `front_s` for a prompt without
        media, `media_front_s` with) and the engine's queue; None otherwise (any thread).
        Refusing there spares the preprocessing that `admit` would refuse after; `margin`
        scales the bound (`policy.admission.DOOR_MARGIN` at the door itself)."""
        if not self.active:
            return None
        now = time.monotonic() if now is None else now
        at, queue = self._door
        if not 0.0 <= now - at < DOOR_S:  # priced at most every DOOR_S: a storm of arrivals
            queue = list(self._queue(now).values())  # costs O(1) each, not O(waiting)
            self._door = (now, queue)
        enc, pre, media = min(tuple(self.recent), key=lambda r: r[0] + r[1],  # a copy: other
                              default=(0.0, 0.0, False))  # threads append meanwhile
        if media and media_front_s is not None:
            front_s = media_front_s
        front = max(self._front_delay(now), front_s)
        # the requests past the door or being preprocessed join the queue first, each as
        # that small one (copies: other threads add and remove meanwhile)
        coming = [Queued(enc, pre, at) for at in (*tuple(self.front.values()),
                                                  *tuple(self.entering.values()))]
        p = self.policy.check_arrival(Queued(enc, pre, now), queue + coming, front, margin)
        return None if p.admit else self.policy.refusal(p)  # counted by check_arrival

    def check(self, now: float | None = None) -> None:
        """Learn from first tokens; end the waiting requests that can no longer meet their
        bound (the engine's step thread, at most every `CHECK_S`)."""
        if not self.active:
            return
        if self.regimes is not None:  # SIS entered or left turns: price as it runs now
            self.regimes.switch(self, getattr(self.engine.spatial, "sis", None))
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        self._next_check = now + CHECK_S
        with self._lock:
            items = list(self.waiting.items())
        for rid, req in items:
            if req.first_token_time is not None or req.status is Status.FINISHED:
                self._forget(rid, req)
        queue = self._queue(now)
        values = list(queue.values())
        eng = self.engine
        for rid, own in queue.items():
            req = self.waiting.get(rid)
            if req is None or req.num_computed > 0 or req.status is Status.FINISHED:
                continue
            seqs = req.group.started() if req.group is not None else (req,)
            if eng.spatial is not None and any(eng.spatial.defer_abort(s) for s in seqs):
                continue
            waited = now - req.arrival_time + self.offset.get(rid, 0.0)
            p = self.policy.check_waiting(own, values, waited)
            if p.admit:
                continue
            refusal = self.policy.refusal(p, waiting=True)
            self.ended[rid] = refusal
            self._forget(rid, None)
            for seq in seqs:
                if seq.status is not Status.FINISHED:
                    eng._end(seq, "error", str(refusal), now)

    def _forget(self, rid: str, req: Request | None) -> None:
        self._door = (-1.0, [])  # the queue changed: price it again
        with self._lock:
            self.waiting.pop(rid, None)
            self.offset.pop(rid, None)
            predicted = self.predicted.pop(rid, None)
        if req is not None and req.first_token_time is not None and predicted is not None:
            self.policy.observe(predicted, req.first_token_time - req.arrival_time)

    def annotate(self, req: Request, out: RequestOutput, finished: bool = True) -> None:
        """A request's output: a finished one is no longer tracked (learning from its first
        token); the final output of one ended while waiting gets the server's 503 and its
        ``Retry-After``."""
        if not self.active or not finished:
            return
        if req.request_id in self.waiting:
            self._forget(req.request_id, req)
        refusal = self.ended.get(req.request_id)
        if refusal is None:
            return
        out.extra["status"] = 503
        out.extra["retry_after"] = retry_seconds(refusal.retry_after_s)
        if req.group is None or req.group.all_finished():
            self.ended.pop(req.request_id, None)


__all__ = ["CHECK_S", "DOOR_S", "RECENT", "EngineAdmission", "Refused"]
