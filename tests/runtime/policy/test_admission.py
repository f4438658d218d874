"""The admission predictor: who is ahead (TWSRFT, FIFO, late jobs demoted), pipelined and
serial stages, the verdicts at arrival and while waiting, Retry-After from the drain, the
calibration and the mode's costs from the curves."""

import math

import pytest

from spaceserve.runtime.policy.admission import (
    AdmissionPolicy,
    Queued,
    Refused,
    retry_seconds,
    stage_costs,
)
from spaceserve.runtime.policy.analytic.model import analytic_curves

SLO = "ttft:1000,tpot:50"


def policy(**kw) -> AdmissionPolicy:
    return AdmissionPolicy(SLO, calibrate=False, **kw)


def test_twsrft_puts_less_work_ahead_and_demotes_late_jobs() -> None:
    p = policy(pipelined=False)
    own = Queued(0.3, 0.1, arrival=5.0)
    queue = [Queued(0.2, 0.1, 1.0),  # less work: ahead
             Queued(0.5, 0.1, 2.0),  # more work: behind
             Queued(0.1, 0.1, 3.0, late=True),  # demoted: behind
             Queued(0.3, 0.1, 4.0),  # as much, earlier: ahead
             Queued(0.0, 0.2, 4.5),  # encoded, earlier: ahead in prefill
             Queued(0.0, 0.2, 6.0)]  # encoded, later: behind
    assert p.predict_wait(own, queue) == pytest.approx(0.2 + 0.3 + 0.3 + 0.1 + 0.1 + 0.2 + 0.1)


def test_fifo_puts_every_earlier_request_ahead() -> None:
    p = policy(order="fifo", pipelined=False)
    own = Queued(0.3, 0.0, arrival=5.0)
    queue = [Queued(0.5, 0.0, 1.0), Queued(0.1, 0.0, 6.0), own]
    assert p.predict_wait(own, queue) == pytest.approx(0.8)


def test_pipelined_stages_overlap() -> None:
    own = Queued(0.2, 0.1, arrival=5.0)
    queue = [Queued(0.0, 0.7, 1.0), Queued(0.1, 0.1, 2.0)]
    assert policy(pipelined=True).predict_wait(own, queue) == pytest.approx(0.8 + 0.1)
    assert policy(pipelined=False).predict_wait(own, queue) == pytest.approx(0.3 + 0.8 + 0.1)


def test_verdicts_and_retry_after() -> None:
    p = policy()
    ok = p.check_arrival(Queued(0.5, 0.2), [])
    assert ok.admit and ok.ttft_s == pytest.approx(0.7)
    no = p.check_arrival(Queued(1.2, 0.3), [])
    assert not no.admit and no.retry_after_s == pytest.approx(0.5)
    late = p.check_waiting(Queued(0.2, 0.1), [], waited_s=0.8)
    assert not late.admit and p.refused == 1 and p.ended == 1
    assert p.check_waiting(Queued(0.2, 0.1), [], waited_s=0.6).admit
    exc = p.refusal(no)
    assert isinstance(exc, Refused) and exc.retry_after_s == pytest.approx(0.5)
    assert "1000 ms" in str(exc) and "retry after 1 s" in str(exc)
    assert retry_seconds(0.0) == 1 and retry_seconds(2.0) == 2 and retry_seconds(2.01) == 3


def test_queue_mode_and_no_ttft_bound_admit_everything() -> None:
    for p in (AdmissionPolicy(SLO, mode="queue"), AdmissionPolicy("tpot:50")):
        assert not p.active
        assert p.check_arrival(Queued(100.0, 100.0), []).admit
        assert p.check_waiting(Queued(1.0, 1.0), [], waited_s=1e3).admit
    with pytest.raises(ValueError, match="admission='drop'"):
        AdmissionPolicy(SLO, mode="drop")


def test_the_calibration_learns_the_machines_speed_within_bounds() -> None:
    p = AdmissionPolicy(SLO, alpha=0.5)
    for _ in range(40):
        p.observe(0.001, 0.1)  # this machine runs 100x slower than the curves say
    assert p.scale == pytest.approx(100.0, rel=1e-3)
    assert p.predict_wait(Queued(0.002, 0.0), []) == pytest.approx(0.2, rel=1e-3)
    for _ in range(200):
        p.observe(1e-9, 1e3)
    assert p.scale == 1e6
    p.observe(0.0, 1.0)  # nothing to learn from
    assert p.scale == 1e6
    frozen = policy()
    frozen.observe(0.001, 1.0)
    assert frozen.scale == 1.0


def test_stage_costs_follow_the_mode() -> None:
    curves = analytic_curves()
    depth, total = curves.encoder_depth, curves.num_sms
    enc_t, pre_t, piped_t = stage_costs(curves, "temporal", decode_batch=32,
                                        decode_context=1024)
    enc_c, _, piped_c = stage_costs(curves, "temporal-chunked", window_s=0.02,
                                    decode_batch=32, decode_context=1024)
    enc_s, pre_s, piped_s = stage_costs(curves, "spatial", encoder_sms=64)
    assert not piped_t and piped_c and piped_s
    whole = curves.encoder(4 * 1196, depth, total)
    assert enc_t(4 * 1196, depth) == pytest.approx(whole)
    assert enc_c(4 * 1196, depth) > 1.5 * whole  # a window per step, the decode step between
    assert enc_s(4 * 1196, depth) > whole  # fewer SMs, co-running
    assert enc_t(0, depth) == 0.0 and pre_t(0) == 0.0 and pre_s(0) == 0.0
    assert pre_t(4096) > pre_t(1024) > 0 and math.isfinite(pre_s(4096))
