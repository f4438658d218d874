"""SLO-aware admission in the router: a replica that can still meet the TTFT bound goes first
whatever the routing policy ranks first, and the request is shed only when no replica can;
the calibration learns from the first tokens the router sees."""

from __future__ import annotations

import pytest

from spaceserve.runtime.policy.admission import AdmissionPolicy
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.routing.router import RouteRequest, WorkModel
from spaceserve.runtime.routing.tracker import ReplicaTracker

SLO = "ttft:1000,tpot:50"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def image(rid: str, tokens: int = 2691) -> RouteRequest:
    return RouteRequest(rid, tokens + 32, image_tokens=(tokens,), image_hashes=(rid,))


def tracker(mode: str = "slo", policy: str = "round_robin", clock=None) -> ReplicaTracker:
    adm = AdmissionPolicy(SLO, mode=mode, order="fifo", calibrate=False)
    t = ReplicaTracker(WorkModel(analytic_curves()), policy=policy, admission=adm,
                       clock=clock or Clock())
    t.sync({"a": {"rank": 0}, "b": {"rank": 1}})
    return t


def load(t: ReplicaTracker, key: str, n: int) -> None:
    for i in range(n):
        t.on_routed(key, image(f"{key}-{i}"))


def test_a_replica_that_can_meet_the_bound_goes_first() -> None:
    t = tracker()
    load(t, "a", 40)  # far more than 1 s of encoder work queued on "a"
    work = t.states(["a"])[0].queued_encoder_s + t.states(["a"])[0].queued_prefill_s
    assert work > 1.0
    assert t.rank(image("x"), ["a", "b"]) == ["b", "a"]
    assert t.shed(image("x")) is None
    plain = tracker(mode="queue")  # round robin alone: its turn (40 routed) is "a"
    load(plain, "a", 40)
    assert plain.rank(image("x"), ["a", "b"]) == ["a", "b"]


def test_shed_only_when_no_replica_can_meet_the_bound() -> None:
    t = tracker()
    load(t, "a", 40)
    load(t, "b", 30)
    refusal = t.shed(image("x"))
    assert refusal is not None and not refusal.admit
    b = t.states(["b"])[0]
    wait_b = b.queued_encoder_s + b.queued_prefill_s
    # Retry-After from the replica that drains soonest: its backlog past the bound
    assert refusal.retry_after_s == pytest.approx(refusal.ttft_s - 1.0)
    assert refusal.ttft_s < wait_b + 0.2 and t.admission.refused == 1
    assert tracker(mode="queue").shed(image("x")) is None


def test_the_router_learns_from_first_tokens() -> None:
    clock = Clock()
    t = tracker(clock=clock)
    t.admission.calibrate = True
    t.on_routed("a", image("r"))
    predicted = t._flights["r"].predicted_s
    clock.t = 10 * predicted  # this replica is 10x slower than the curves say
    t.on_first_token("r")
    assert t.admission.scale == pytest.approx(10 ** t.admission.alpha, rel=1e-6)
