"""SIS's goodput objective on synthetic curves: calm splits protect TPOT, queue ages and the
arrival rate widen the encoder, the decoder keeps its SLO with a margin, hysteresis."""

from __future__ import annotations

import pytest

from spaceserve.runtime.policy.scheduling import choose_splits, scheduling_policy
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from tests.runtime.policy.test_sis import ALLOWED, CURVES, TOTAL, Clock

SLO_A = Slo.parse("ttft:2000,tpot:50")
BIG = 30000  # ViT patches of a large image: ~30 ms of encoder work on the synthetic curves


def sis(clock=None, **kw) -> SpaceInferenceScheduler:
    kw.setdefault("slo", SLO_A)
    return SpaceInferenceScheduler(CURVES, ALLOWED, clock=clock or Clock(), **kw)


def queue(n: int, age: float, rate: float = 0.0) -> SisState:
    jobs = tuple(PendingEncode(BIG, 32, 1500, age_s=age) for _ in range(n))
    return SisState(jobs, (), 32, 1024.0, arrival_rate=rate, arrival_patches=BIG,
                    arrival_prompt=1500)


def test_no_encoder_work_gives_the_decoder_every_sm() -> None:
    split = sis().propose(SisState((), (), 32, 1024.0))
    assert (split.encoder_sms, split.decoder_sms) == (0, TOTAL)


def test_calm_queue_keeps_the_comfort_split() -> None:
    s = sis()
    split = s.propose(queue(1, 0.0))
    unloaded = CURVES.decode(32, 1024.0, TOTAL)
    assert split.predicted_tpot_s <= s.comfort_factor * unloaded
    assert split.encoder_sms == s.propose(queue(1, 0.0, rate=0.5)).encoder_sms  # light arrivals
    tpot = sis(objective="tpot").propose(queue(1, 0.0))
    assert tpot.encoder_sms <= split.encoder_sms  # the tpot objective is the stricter one


def test_old_requests_widen_the_encoder_within_the_decode_slo() -> None:
    s = sis()
    calm = s.propose(queue(2, 0.0)).encoder_sms
    pressed = s.propose(queue(2, 1.5))  # 1.5 s old: 0.3 s left of the 1.8 s budget
    assert pressed.encoder_sms > calm
    assert pressed.predicted_tpot_s <= 0.8 * 0.050 + 1e-12  # the decode SLO with its margin
    assert s.predictor.misses(queue(2, 1.5), pressed.encoder_sms) < \
        s.predictor.misses(queue(2, 1.5), calm)
    # the tpot objective does not look at ages
    t = sis(objective="tpot")
    assert t.propose(queue(2, 1.5)).encoder_sms == t.propose(queue(2, 0.0)).encoder_sms


def test_arrival_rate_widens_the_encoder_before_the_queue_builds() -> None:
    s = sis()
    calm = s.propose(queue(1, 0.0)).encoder_sms
    fast = s.propose(queue(1, 0.0, rate=6.0))  # arrivals that would outgrow the calm split
    assert fast.encoder_sms > calm
    assert s.predictor.load(queue(1, 0.0, rate=6.0), calm) > s.predictor.max_load


def test_a_tighter_decode_slo_caps_the_encoder_lower() -> None:
    loose = sis().propose(queue(2, 1.5))
    tight = sis(slo=Slo.parse("ttft:2000,itl:10")).propose(queue(2, 1.5))
    assert tight.encoder_sms < loose.encoder_sms
    assert tight.predicted_tpot_s <= 0.8 * 0.010 + 1e-12


def test_growth_that_saves_requests_skips_the_dwell_shrinking_waits() -> None:
    clock = Clock()
    s = sis(clock, min_dwell_s=1.0)
    calm = s.decide(queue(2, 0.0)).encoder_sms
    clock.t = 0.001  # well inside the dwell
    grown = s.decide(queue(2, 1.5)).encoder_sms
    assert grown > calm
    clock.t = 0.002
    assert s.decide(queue(2, 0.0)).encoder_sms == grown  # shrinking waits for the dwell
    clock.t = 1.5
    assert s.decide(queue(2, 0.0)).encoder_sms == calm


def test_split_set_from_curves_and_slo() -> None:
    splits = choose_splits(CURVES, SLO_A)
    assert 0 < len(splits) <= 6 and all(e % 8 == 0 and 0 < e < TOTAL for e in splits)
    step = [CURVES.decode(32, 1024.0, TOTAL - e, True) for e in splits]
    assert step[-1] <= 0.8 * 0.050 and splits[-1] == 120  # the last multiple of 8 below 132
    tight = choose_splits(CURVES, Slo.parse("ttft:2000,itl:10"))
    assert max(tight) < max(splits)
    p = scheduling_policy(CURVES, SLO_A, objective="tpot")
    assert p.splits == splits and p.objective == "tpot" and p.deadline_s == pytest.approx(1.8)
    with pytest.raises(ValueError, match="objective"):
        scheduling_policy(CURVES, SLO_A, objective="latency")
    with pytest.raises(ValueError, match="objective"):
        sis(objective="latency")


def test_pressure_keeps_the_decode_step_within_the_margin_not_the_bare_slo() -> None:
    """The default decoder margin is 0.8 x the decode SLO, in the shared policy and in SIS: under
    any pressure the chosen split's co-running step stays within 0.8 x 25 ms, although splits
    that stay within the bare 25 ms (but not 20 ms) exist and would drain the queue faster."""
    slo = Slo.parse("ttft:2000,tpot:25")
    policy = scheduling_policy(CURVES, slo)
    assert policy.decode_margin == 0.8
    s = SpaceInferenceScheduler(CURVES, ALLOWED, slo=slo, clock=Clock())
    assert s.slo_target() == pytest.approx(0.8 * 0.025)
    state = SisState(tuple(PendingEncode(BIG, 32, 1500, age_s=1.5) for _ in range(8)), (),
                     128, 8192.0, arrival_rate=30.0, arrival_patches=BIG, arrival_prompt=1500)
    between = [e for e in ALLOWED
               if 0.8 * 0.025 < s.predict_tpot(state, e) <= 0.025]
    assert between, "the curves must offer splits between the margin and the bare SLO"
    split = s.propose(state)
    assert split.predicted_tpot_s <= 0.8 * 0.025 < s.predict_tpot(state, min(between))
    cap = choose_splits(CURVES, slo, batch=128, context=8192.0)[-1]
    assert CURVES.decode(128, 8192.0, TOTAL - cap, True) <= 0.8 * 0.025
