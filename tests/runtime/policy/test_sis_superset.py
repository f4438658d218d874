"""SIS's superset actions: the whole-GPU encoder window (what temporal-chunked does) is chosen
when its goodput prediction beats every sharing split, sized to keep the decode SLO's margin,
never offered by pure sharing, counted, and executed by the simulator."""

from __future__ import annotations

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.scheduling import scheduling_policy
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.engine import Simulator
from spaceserve.runtime.sim.workload import Workload, generate

CURVES = analytic_curves()
SLO_A = Slo.parse("ttft:2000,tpot:50")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.005
        return self.t


def sis(actions: str = "superset", slo: Slo = SLO_A, **kw) -> SpaceInferenceScheduler:
    policy = scheduling_policy(CURVES, slo)
    return SpaceInferenceScheduler(CURVES, policy.splits, slo=slo, actions=actions,
                                   clock=Clock(), **kw)


def backlog(batch: int, n: int = 24, age: float = 1.0) -> SisState:
    jobs = tuple(PendingEncode(10764, 32, 2755, age_s=age) for _ in range(n))
    return SisState(jobs, (), batch, 1152.0, arrival_rate=20.0, arrival_patches=5000,
                    arrival_prompt=1300)


def test_an_idle_decoder_under_pressure_gets_a_whole_gpu_window() -> None:
    s, share = sis(), sis("share")
    state = backlog(batch=0)
    split = s.propose(state)
    assert (split.encoder_sms, split.decoder_sms, split.prefill_on) == (s.total, 0, "decode")
    assert split.predicted_tpot_s == pytest.approx(s.window(state) + s.predict_tpot(state, 0))
    assert split.tpot_ok and split.predicted_tpot_s <= s.slo_target()
    assert s.misses(state, s.total) < min(s.misses(state, e) for e in s.allowed)
    assert share.propose(state).encoder_sms < share.total  # pure sharing never offers it


def test_the_window_keeps_the_decode_margin_or_is_not_offered() -> None:
    s = sis(window_s=0.02)
    state = backlog(batch=64)
    w = s.window(state)
    assert 0 < w <= 0.02 and w + s.predict_tpot(state, 0) <= s.slo_target() + 1e-12
    tight = sis(slo=Slo.parse("ttft:2000,itl:5"))  # a whole-device step alone breaks 0.8 x 5 ms
    big = backlog(batch=128)
    assert tight.window(big) == 0.0
    assert tight.propose(big).encoder_sms < tight.total


def test_actions_are_counted_and_checked() -> None:
    s = sis()
    s.decide(backlog(batch=0))
    s.decide(SisState((), (), 32, 1024.0))
    counts = s.action_counts()
    assert counts["window"] == 1 and counts["decoder-only"] == 1
    assert counts["prefill:decode"] == 1
    with pytest.raises(ValueError, match="sis actions"):
        sis("everything")
    with pytest.raises(ValueError, match="sis_actions"):
        SimConfig(sis_actions="everything")


def test_the_simulator_executes_windows_and_serves_everything() -> None:
    """Where SIS picks a whole-GPU window, the simulator's co-located step runs it as the
    engine's does: encoder steps on every SM with the decoder paused, between decode steps.
    (Run as the engine runs, SIS's own forecast takes no window on these curves even past
    saturation - docs/results/sim-best-temporal.md - so its proposal is forced here.)"""
    wl = Workload(24.0, 10.0, seed=0)  # past saturation: a backlog builds up
    sims = {a: Simulator(CURVES, SimConfig(mode="spatial", slo=SLO_A, sis_actions=a))
            for a in ("share", "superset")}
    sup = sims["superset"].sis
    propose = sup.propose

    def windows(state):
        split = propose(state)
        return sup._place(state, sup.total, split.tpot_target_s, True) if state.encode else split

    sup.propose = windows
    for sim in sims.values():
        for req in generate(wl):
            sim.advance_to(req.arrival)
            sim.add(req)
        sim.drain()
    assert sup.action_counts().get("window", 0) > 0 and sims["superset"].loop.num_windows > 0
    assert "window" not in sims["share"].sis.action_counts()
    for sim in sims.values():
        assert all(r.finish is not None for r in sim.requests.values() if r.kind == "image")
    # during windows the decoder is paused and the encoder holds every SM
    held = [(enc, dec) for _, enc, dec in sims["superset"].timeline]
    assert (CURVES.num_sms, 0) in held
