"""SIS's superset: a regime that takes turns on the whole GPU (whole-GPU encoder windows between
whole-device decode steps, what temporal-chunked does) while the arrivals outgrow what sharing
sustains and taking turns sustains more, with hysteresis; windows sized to keep the decode SLO's
margin; never taken by pure sharing; counted, and executed by the simulator."""

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


def backlog(batch: int, n: int = 24, age: float = 1.0, rate: float = 20.0,
            prompt: int = 1300) -> SisState:
    jobs = tuple(PendingEncode(10764, 32, 2755, age_s=age) for _ in range(n))
    return SisState(jobs, (), batch, 1152.0, arrival_rate=rate, arrival_patches=5000,
                    arrival_prompt=prompt)


def test_arrivals_past_what_sharing_sustains_take_turns() -> None:
    s, share = sis(), sis("share")
    state = backlog(batch=64)
    cap_share, cap_turns = s.capacities(state)
    assert cap_turns > s.turns_at * cap_share > 0  # turns sustain more than sharing's discount
    assert state.arrival_rate >= s.turns_at * cap_share
    plan = s.turns_plan(state)
    assert plan.tokens in (256, 512, 1024, 2048, 4096) and plan.rate == cap_turns
    split = s.decide(state)
    assert (split.encoder_sms, split.decoder_sms, split.prefill_on) == (s.total, 0, "decode")
    assert s.last_window_s == pytest.approx(plan.window_s) and s.last_window_s > 0
    assert s.last_turn_tokens == plan.tokens
    # the window and its step (the plan's prefill budget) keep the decode SLO's margin
    step = CURVES.mixed_step(64, 1152.0, plan.tokens, 0, s.total)
    assert plan.window_s + step <= s.slo_target() + 1e-12
    assert split.predicted_tpot_s == pytest.approx(s.window(state) + s.predict_tpot(state, 0))
    assert split.tpot_ok and split.predicted_tpot_s <= s.slo_target() + 1e-12
    assert share.decide(state).encoder_sms < share.total  # pure sharing never takes turns
    calm = sis()  # the same backlog at a rate below the regime's threshold: SIS shares
    low = 0.9 * calm.turns_at * cap_share
    assert calm.decide(backlog(batch=64, rate=low)).encoder_sms < calm.total


def test_the_regime_has_hysteresis() -> None:
    s = sis(turns_dwell_s=1.0)
    cap_share = s.capacities(backlog(batch=64))[0]
    assert s.decide(backlog(64, rate=cap_share)).encoder_sms == s.total
    between = 0.5 * (s.turns_at + s.turns_until) * cap_share  # inside the band: no change
    low = 0.5 * s.turns_until * cap_share
    assert s.decide(backlog(64, rate=low)).encoder_sms == s.total  # within the dwell
    s.clock.t += 1.0
    assert s.decide(backlog(64, 2, 0.0, rate=between)).encoder_sms == s.total  # in the band
    assert s.decide(backlog(64, rate=low)).encoder_sms == s.total  # a backlog that would miss
    assert s.decide(backlog(64, 2, 0.0, rate=low)).encoder_sms < s.total  # drained: share
    assert s.decide(backlog(64, 2, 0.0, rate=between)).encoder_sms < s.total  # in the band
    counts = s.action_counts()
    assert counts["regime:turns"] == 1 and counts["regime:share"] == 1
    with pytest.raises(ValueError, match="turns_until"):
        sis(turns_at=0.5, turns_until=0.7)


def test_the_window_keeps_the_decode_margin_or_is_not_offered() -> None:
    s = sis(window_s=0.02)
    state = backlog(batch=64)
    w = s.window(state)
    assert 0 < w and w + s.predict_tpot(state, 0) <= s.slo_target() + 1e-12  # SLO-derived
    tight = sis(slo=Slo.parse("ttft:2000,itl:5"))  # a whole-device step alone breaks 0.8 x 5 ms
    big = backlog(batch=128, rate=100.0)
    assert tight.window(big) == 0.0 and tight.capacities(big)[1] == 0.0
    assert tight.decide(big).encoder_sms < tight.total


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


def test_the_simulator_takes_turns_past_saturation_and_serves_everything() -> None:
    """Past what sharing sustains, the simulator's co-located step (the engine's) takes turns:
    encoder windows on every SM with the decoder paused, between whole-device decode steps."""
    wl = Workload(24.0, 10.0, seed=0)  # past saturation: a backlog builds up
    sims = {a: Simulator(CURVES, SimConfig(mode="spatial", slo=SLO_A, sis_actions=a))
            for a in ("share", "superset")}
    for sim in sims.values():
        for req in generate(wl):
            sim.advance_to(req.arrival)
            sim.add(req)
        sim.drain()
    counts = sims["superset"].sis.action_counts()
    assert counts.get("window", 0) > 0 and counts.get("regime:turns", 0) >= 1
    assert sims["superset"].loop.num_windows > 0
    assert "window" not in sims["share"].sis.action_counts()
    for sim in sims.values():
        assert all(r.finish is not None for r in sim.requests.values() if r.kind == "image")
    # during windows the decoder is paused and the encoder holds every SM
    held = [(enc, dec) for _, enc, dec in sims["superset"].timeline]
    assert (CURVES.num_sms, 0) in held


def test_turns_order_fifo_only_where_admission_sheds() -> None:
    """Taking turns, the encoder runs FIFO without a deadline under SLO-aware admission (which
    sheds the hopeless requests) and keeps TWSRFT with its deadline without it; sharing always
    runs TWSRFT with the deadline."""
    from spaceserve.runtime.policy.sis_goodput import order_encoder, turns_order
    from spaceserve.runtime.policy.twsrft import TwsrftScheduler

    assert (turns_order("slo"), turns_order("queue")) == ("fifo", "twsrft")
    s = TwsrftScheduler(32, lambda p, n: p * n * 1e-6, deadline_s=1.8)
    for turns, admission, want in ((True, "slo", ("fifo", None)),
                                   (False, "slo", ("twsrft", 1.8)),
                                   (True, "queue", ("twsrft", 1.8))):
        order_encoder([s], turns, 1.8, turns_order(admission))
        assert (s.policy, s.deadline_s) == want


SLO_B = Slo.parse("ttft:2000,itl:21")


def feed(s: SpaceInferenceScheduler, gaps: list[float]) -> None:
    """Decode steps read back in turns `gaps` apart (the executors' `IntervalSpread.read`)."""
    t = s.spread._last
    if t is None:
        t = 100.0
        s.spread.read(t, True)
    for g in gaps:
        t += g
        s.spread.read(t, True)


def test_under_an_itl_bound_the_window_follows_the_measured_intervals() -> None:
    """The turns' interval is planned against 0.9 x the ITL bound less the p99 of the measured
    intervals' excess over their prediction (`IntervalSpread`); before MIN_SPREADS intervals
    (and under a TPOT bound) against the flat 0.8 margin; never below half the bound."""
    from spaceserve.runtime.policy.sis_goodput import MIN_SPREADS, SPREADS

    state = backlog(batch=64, prompt=900)  # no embedded prompt waits: the window is unpaced
    s = sis(slo=SLO_B)
    s.turns = True
    s.decide(state)
    flat = s.turns_plan(state)
    planned = flat.window_s + flat.step_s
    assert planned == pytest.approx(s.slo_target()) and s.spread.planned == planned
    feed(s, [planned + 0.0005] * (MIN_SPREADS - 1))  # too few measured: the flat margin
    assert s.turns_plan(state) == flat
    feed(s, [planned + 0.0005] * 120 + [planned + 0.002] * 2)
    wide = s.turns_plan(state)  # p99 of the excess: 0.5 ms (2 of the last 128 reach 2 ms)
    assert wide.window_s + wide.step_s == pytest.approx(0.9 * 0.021 - 0.0005, abs=1e-4)
    assert wide.window_s > flat.window_s and len(s.spread.spreads) == SPREADS
    feed(s, [planned + 0.003] * 8)  # 8 of 128 intervals 3 ms over: the p99 grows
    assert s.turns_plan(state).window_s == pytest.approx(wide.window_s - 0.0025, abs=1e-4)
    feed(s, [planned + 0.05] * SPREADS)  # far slower than predicted: half the bound at least
    assert s.spread.bound(s.slo, s.slo_target()) == pytest.approx(0.5 * 0.021, abs=1e-4)
    s.spread.read(0.0, False)  # a step outside turns: the next interval is not measured
    n = list(s.spread.spreads)
    s.spread.read(1e3, True)
    assert list(s.spread.spreads) == n
    tpot = sis()  # under a TPOT bound the measured intervals change nothing
    tpot.turns = True
    tpot.decide(state)
    before = tpot.turns_plan(state)
    feed(tpot, [0.001] * SPREADS)
    assert tpot.turns_plan(state) == before


def test_the_turns_encoder_passes_its_window_while_the_prefill_is_a_third_of_the_bound_behind(
) -> None:
    """Taking turns under a TPOT bound, the encoder passes its window (``hold``, counted as
    ``window:held``) while the prompts already embedded take at least a third of the TTFT bound
    to prefill at the turns' pace (one budget per interval); the interval then predicted is the
    decode step alone. Without a TTFT bound, or under an ITL bound, it never passes."""
    from spaceserve.runtime.policy.sis_goodput import AHEAD_OF_TTFT, hold_encoder

    assert AHEAD_OF_TTFT == pytest.approx(1 / 3)
    s = sis()
    s.turns = True
    plan = s.turns_plan(backlog(batch=64))
    cycle = plan.window_s + plan.step_s
    edge = 2.0 * AHEAD_OF_TTFT / cycle * plan.tokens  # prompt tokens drained in 2 s / 3
    for tokens, held in ((0, False), (int(edge * 0.97), False), (int(edge * 1.03), True)):
        prompts = (tokens // 2, tokens - tokens // 2) if tokens else ()
        state = SisState(backlog(batch=64).encode, prompts, 64, 1152.0, arrival_rate=20.0,
                         arrival_patches=5000, arrival_prompt=1300)
        assert s.turns_plan(state) == plan
        split = s.decide(state)
        assert split.encoder_sms == s.total and s.hold is held, tokens
        window = s.pace * plan.window_s  # the paced window (`pace_window`)
        assert s.spread.planned == pytest.approx(plan.step_s + (0 if held else window))
        assert s.last_window_s == pytest.approx(window)  # admission still prices it
    counts = s.action_counts()
    assert counts["window:held"] == 1 and counts["window"] + counts["window:paced"] == 2
    assert plan.drain_s(plan.tokens) == pytest.approx(cycle)
    assert hold_encoder(plan, int(edge * 1.03), SLO_A)
    assert not hold_encoder(plan, int(edge * 0.97), SLO_A)
    for slo in ("tpot:50", "ttft:2000,itl:21", "ttft:2000,itl:40,tpot:50"):
        other = sis(slo=Slo.parse(slo))  # no TTFT bound, or an ITL bound: never passes
        other.turns = True
        split = other.decide(SisState(backlog(batch=64).encode, (10**6,), 64, 1152.0,
                                      arrival_rate=20.0, arrival_patches=5000,
                                      arrival_prompt=1300))
        assert split.encoder_sms == other.total and not other.hold, slo
    assert hold_encoder(plan, 10**6, Slo.parse("ttft:2000,itl:60,tpot:50"))  # TPOT governs


def test_the_turns_window_is_paced_to_the_prefill() -> None:
    """Under an ITL bound the turns' pace (the share of the planned window the encoder runs)
    falls by exp(PACE_STEP) each turns round while the embedded prompts take more than a third
    of the TTFT bound to prefill at the paced turns' pace (the budget less one token per
    decoding request, each interval), down to PACE_FLOOR, and rises back to 1 otherwise;
    counted as ``window:paced``. Under a TPOT bound alike; without a TTFT bound it stays 1."""
    import math

    from spaceserve.runtime.policy.sis_goodput import (
        AHEAD_OF_TTFT,
        PACE_FLOOR,
        PACE_STEP,
        Turns,
        pace_window,
    )

    def waiting(tokens: int) -> SisState:
        prompts = (tokens // 2, tokens - tokens // 2) if tokens else ()
        return SisState(backlog(batch=64).encode, prompts, 64, 1152.0, arrival_rate=20.0,
                        arrival_patches=5000, arrival_prompt=1300)

    s = sis(slo=SLO_B)
    s.turns = True
    plan = s.turns_plan(waiting(0))
    for k in range(1, 4):  # far behind: the pace falls a step a round
        split = s.decide(waiting(10**6))
        assert split.encoder_sms == s.total and not s.hold
        assert s.pace == pytest.approx(math.exp(-k * PACE_STEP))
        assert s.last_window_s == pytest.approx(s.pace * plan.window_s)
        assert s.spread.planned == pytest.approx(s.last_window_s + plan.step_s)
    for _ in range(200):
        s.decide(waiting(10**6))
    assert s.pace == PACE_FLOOR and s.last_window_s == pytest.approx(PACE_FLOOR * plan.window_s)
    paced = s.action_counts()["window:paced"]
    assert paced == 203
    pace = s.pace  # the edge: a third of the TTFT bound at the paced interval
    interval = pace * plan.window_s + plan.step_s
    edge = AHEAD_OF_TTFT * 2.0 / interval * (plan.tokens - 64)
    s.decide(waiting(int(edge * 1.03)))
    assert s.pace == PACE_FLOOR
    s.decide(waiting(int(edge * 0.97)))
    assert s.pace == pytest.approx(PACE_FLOOR * math.exp(PACE_STEP))
    for _ in range(200):  # caught up: back to the planned window
        s.decide(waiting(0))
    assert s.pace == 1.0 and s.last_window_s == pytest.approx(plan.window_s)
    assert s.action_counts()["window"] >= 1
    assert pace_window(0.7, Turns(0.0, 512, 0.0), 10**6, 64, SLO_B) == 0.7  # no window fits
    for slo, paced in ((SLO_A, True), (Slo.parse("itl:21"), False),
                       (Slo.parse("tpot:50"), False)):
        other = sis(slo=slo)  # without a TTFT bound never paced
        other.turns = True
        for _ in range(5):
            other.decide(waiting(10**6))
        assert (other.pace < 1) is paced, slo
        assert ("window:paced" in other.action_counts() or other.hold) is paced, slo


def test_where_nothing_is_shed_the_pace_also_follows_the_oldest_wait() -> None:
    """Without SLO-aware admission (the turns' encoder runs TWSRFT with the deadline) the pace
    also falls while the oldest request waiting for its prefill arrived more than AGE_HIGH x the
    TTFT bound ago and rises as soon as it is younger (no band where it holds: that made it a
    ratchet), down to QUEUE_PACE_FLOOR under a TPOT bound and QUEUE_ITL_PACE_FLOOR under an ITL
    bound; with admission (FIFO turns) the ages are not looked at and PACE_FLOOR is the floor."""
    import math

    from spaceserve.runtime.policy.sis_goodput import (
        AGE_HIGH,
        PACE_FLOOR,
        PACE_STEP,
        QUEUE_ITL_PACE_FLOOR,
        QUEUE_PACE_FLOOR,
        Turns,
        pace_window,
    )

    plan, up, down = Turns(0.01, 512, 1.0, 0.008), math.exp(PACE_STEP), math.exp(-PACE_STEP)
    high = AGE_HIGH * 2.0  # SLO A's TTFT bound: 2 s
    assert pace_window(0.7, plan, 0, 64, SLO_A) == pytest.approx(0.7 * up)  # shed: no ages
    assert pace_window(0.7, plan, 0, 64, SLO_A, high * 1.01) == pytest.approx(0.7 * down)
    assert pace_window(0.5, plan, 0, 64, SLO_A, high * 1.01) == pytest.approx(0.5 * down)
    assert pace_window(0.5, plan, 0, 64, SLO_A, high * 0.99) == pytest.approx(0.5 * up)
    assert pace_window(0.5, plan, 0, 64, SLO_A, 0.0) == pytest.approx(0.5 * up)
    assert pace_window(0.5, plan, 10**6, 64, SLO_A, 0.0) == pytest.approx(0.5 * down)
    assert pace_window(0.3, plan, 0, 64, SLO_A, 9.0) == pytest.approx(0.3 * down)
    assert pace_window(QUEUE_PACE_FLOOR, plan, 0, 64, SLO_A, 9.0) == QUEUE_PACE_FLOOR
    assert pace_window(0.3, plan, 0, 64, SLO_A) == PACE_FLOOR  # shed: PACE_FLOOR's range
    assert pace_window(0.3, plan, 10**6, 64, SLO_A) == PACE_FLOOR
    assert QUEUE_ITL_PACE_FLOOR < PACE_FLOOR
    assert pace_window(PACE_FLOOR, plan, 0, 64, SLO_B, 9.0) == pytest.approx(PACE_FLOOR * down)
    assert pace_window(QUEUE_ITL_PACE_FLOOR, plan, 0, 64, SLO_B, 9.0) == QUEUE_ITL_PACE_FLOOR
    assert pace_window(0.3, plan, 0, 64, SLO_B, 0.0) == QUEUE_ITL_PACE_FLOOR
    assert pace_window(0.3, plan, 0, 64, SLO_B) == PACE_FLOOR  # shed: PACE_FLOOR's range

    def old(age: float) -> SisState:
        return SisState(backlog(batch=64).encode, (40, 40), 64, 1152.0, (age, 0.0),
                        arrival_rate=20.0, arrival_patches=5000, arrival_prompt=1300)

    queue, shed = sis(turns_order="twsrft"), sis()
    assert (queue.turns_order, shed.turns_order) == ("twsrft", "fifo")
    for s in (queue, shed):
        s.turns = True
        for _ in range(5):
            s.decide(old(1.5))
    assert queue.pace == pytest.approx(down ** 5) and shed.pace == 1.0
    with pytest.raises(ValueError, match="turns_order"):
        sis(turns_order="lifo")
    for admission, want in (("queue", "twsrft"), ("slo", "fifo")):
        sim = Simulator(CURVES, SimConfig(mode="spatial", slo=SLO_A, sis_actions="superset",
                                          admission=admission))
        assert sim.sis.turns_order == want


@pytest.mark.parametrize("seed", [0, 1])
def test_with_128_decodes_and_nothing_shed_the_turns_keep_up(seed: int) -> None:
    """128 decodes fill the sequence cap, so an encoded request waits for a decoding slot about
    its place in the queue x the interval. Without admission the turns' 20 ms windows under a
    TPOT bound let that queue grow until most requests were late (45% / 35% of the arrivals met
    SLO A at 18 img/s, seeds 0 / 1); paced by the oldest wait 91% / 86% (`best-temporal` over
    30 s, seeds 0 and 1: 83% attainment)."""
    from spaceserve.runtime.sim.cluster import simulate

    cfg = SimConfig(mode="spatial", slo=SLO_A, sis_actions="superset", background=128)
    res = simulate(CURVES, cfg, Workload(18.0, 20.0, seed=seed), drain_s=10.0)
    assert res.goodput(SLO_A).attainment >= 0.8
