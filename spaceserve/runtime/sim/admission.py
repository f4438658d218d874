"""SLO-aware admission in the simulator (``spaceserve sim --admission slo``): the engine's rule,
with the engine's predictor (`policy.admission.AdmissionPolicy`), on one simulated GPU.

At arrival a request is priced against the GPU's queue - encoder work left per request (TWSRFT's
jobs, or whole passes in ``temporal``), prefill left - with the mode's costs
(`policy.admission.stage_costs`); one predicted to miss its TTFT bound is refused and never
runs. Every `CHECK_S` of simulated time the requests still waiting for their first token are
priced again, and those that can no longer meet the bound are ended: their waiting encoder work
is cancelled, their KV blocks and held embeddings freed. A request whose prefill has started is
left to finish (its first token is near). With SIS's superset the pricing follows its regime
(`policy.admission.RegimePricing`): while it takes turns, temporal-chunked's costs at the turns'
window and budget, in the turns' encoder order. Refused and ended requests are ``shed``: goodput
counts them as misses, the results report their share and the TTFT of the requests served.
"""

from __future__ import annotations

from typing import Any

from spaceserve.runtime.policy.admission import (
    AdmissionPolicy,
    Pricing,
    Queued,
    RegimePricing,
    stage_costs,
)
from spaceserve.runtime.policy.sis_goodput import TURNS_ORDER
from spaceserve.runtime.sim.workload import Request

CHECK_S = 0.05  # how often waiting requests are priced again (simulated seconds)


class SimAdmission:
    """Admission for one `Simulator` (its ``admission`` attribute)."""

    def __init__(self, sim: Any) -> None:
        c = sim.config
        self.sim = sim
        order = c.encoder_policy or ("fifo" if c.mode == "temporal" else "twsrft")
        encoder_sms = None
        if c.mode == "spatial-static":
            encoder_sms = c.static_encoder_sms
        elif c.mode == "spatial":
            encoder_sms = sim.allowed[-1]
        window = sim.window_s if sim.window_s < float("inf") else 0.02
        self.enc_s, self.pre_s, pipelined = stage_costs(
            sim.curves, c.mode, encoder_sms=encoder_sms, window_s=window,
            budget=c.max_num_batched_tokens, decode_batch=c.background,
            decode_context=c.background_context + c.background_output / 2)
        self.policy = AdmissionPolicy(c.slo, mode=c.admission, order=order,
                                      pipelined=pipelined)
        self.deadline_s = sim.policy.deadline_s if order == "twsrft" else None
        self.regimes = None  # the superset: priced as the regime SIS runs (`RegimePricing`)
        if c.mode == "spatial" and c.sis_actions == "superset":
            self.regimes = RegimePricing(
                sim.curves, Pricing(self.enc_s, self.pre_s, pipelined, order, self.deadline_s),
                TURNS_ORDER, decode_batch=c.background,
                decode_context=c.background_context + c.background_output / 2)
        self.depth = sim.curves.encoder_depth
        self.waiting: dict[int, Request] = {}
        self.predicted: dict[int, float] = {}  # uncalibrated wait predicted at arrival
        self.cancel: set[int] = set()  # ended requests whose encoder job still runs
        self.landing: set[int] = set()  # ... and may still land in the prefill queue
        self.next_check = 0.0

    # -- pricing -------------------------------------------------------------------------------
    def _layers_left(self) -> dict[int, int]:
        sched = self.sim.sched
        if sched is None:
            return {}
        return {rid: j.layers_left for j in sched.jobs() for rid in j.request_ids}

    def _queued(self, req: Request, layers: dict[int, int]) -> Queued:
        sim = self.sim
        encoded = req.patches <= 0 or req.encoded_at is not None
        enc = 0.0 if encoded else self.enc_s(req.patches, layers.get(req.rid, self.depth))
        done = req.prefilled
        if sim.loop is not None and req.rid in sim.loop.core:
            done = max(done, sim.loop.core[req.rid].num_computed)
        pre = self.pre_s(req.prompt_tokens - done)
        late = self.deadline_s is not None and sim.now + enc > req.arrival + self.deadline_s
        return Queued(enc, pre, req.arrival, late)

    def _queue(self, layers: dict[int, int]) -> dict[int, Queued]:
        return {rid: self._queued(r, layers) for rid, r in self.waiting.items()}

    # -- the rule ------------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Whether `req`, arriving now, is admitted; a refused one is marked shed."""
        if not self.policy.active:
            return True
        self.check()
        layers = self._layers_left()
        own = self._queued(req, layers)
        queue = list(self._queue(layers).values())
        p = self.policy.check_arrival(own, queue)
        if not p.admit:
            req.shed = "refused"
            return False
        self.waiting[req.rid] = req
        self.predicted[req.rid] = self.policy.predict_wait(own, queue) / self.policy.scale
        return True

    def check(self) -> None:
        """Before every dispatch: no ended request stays in the prefill queue. Every `CHECK_S`:
        price the waiting requests again; end the hopeless ones."""
        sim = self.sim
        if self.regimes is not None:  # SIS entered or left turns: price as it runs now
            self.regimes.switch(self, sim.sis)
        for rid in list(self.landing):  # its running job was reported: out of the queue
            req = sim.requests[rid]
            if req in sim.prefill_q:
                sim.prefill_q.remove(req)
            if req.encoded_at is not None:
                self.landing.discard(rid)
        if sim.now < self.next_check or not self.policy.active:
            return
        self.next_check = sim.now + CHECK_S
        for rid in list(self.cancel):
            if self._cancel(rid):
                self.cancel.discard(rid)
        for rid, req in list(self.waiting.items()):
            if req.first_token is not None:
                del self.waiting[rid]
                self.policy.observe(self.predicted.pop(rid), req.first_token - req.arrival)
        if not self.policy.active or not self.waiting:
            return
        layers = self._layers_left()
        queue = self._queue(layers)
        values = list(queue.values())
        for rid, own in queue.items():
            req = self.waiting[rid]
            if self._started(req):
                continue
            if not self.policy.check_waiting(own, values, sim.now - req.arrival).admit:
                self._end(req)

    def _started(self, req: Request) -> bool:
        """Whether `req`'s prefill has begun (it is then left to finish)."""
        sim = self.sim
        if req.prefilled > req.cached_tokens:
            return True
        if sim.loop is not None:
            core = sim.loop.core.get(req.rid)
            return core is not None and core.num_computed > req.cached_tokens
        ops = sim.ops
        if "compute" in ops and ops["compute"].kind == "prefill" and \
                ops["compute"].payload is req:
            return True
        return "decode" in ops and ops["decode"].payload[1] is req

    def _end(self, req: Request) -> None:
        """End waiting `req`: free its queue places, encoder work, KV blocks, embeddings."""
        sim = self.sim
        req.shed = "ended"
        del self.waiting[req.rid]
        self.predicted.pop(req.rid, None)
        sim._open -= 1
        if req.patches > 0 and req.encoded_at is None and not self._cancel(req.rid):
            self.cancel.add(req.rid)
            self.landing.add(req.rid)
        loop = sim.loop
        if loop is None:
            if req in sim.prefill_q:
                sim.prefill_q.remove(req)
            return
        if req in loop.inbox:
            loop.inbox.remove(req)
        if req in loop.backlog:
            loop.backlog.remove(req)
        loop.release(req)

    def _cancel(self, rid: int) -> bool:
        """Drop `rid`'s waiting encoder job; False while it runs (tried again later)."""
        sched = self.sim.sched
        if sched is None:  # temporal: whole passes, never cancelled mid-pass
            return True
        scheds = getattr(sched, "scheds", None) or getattr(
            getattr(sched, "ranked", None), "scheds", None) or [sched]
        running = any(j.running and rid in j.request_ids for j in sched.jobs())
        if running:
            return False
        for s in scheds:
            s.cancel(rid)
        if self.sim.loop is not None:
            self.sim.loop.jobs.discard(rid)
        return True


def shed_of(requests: list[Request]) -> dict[str, int]:
    """How many of `requests` were refused at arrival and ended while waiting."""
    refused = sum(1 for r in requests if r.shed == "refused")
    ended = sum(1 for r in requests if r.shed == "ended")
    return {"refused": refused, "ended": ended}
