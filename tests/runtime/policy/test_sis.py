"""SIS's tpot objective on synthetic curves: the TPOT target, idle decoder, monotone splits,
hysteresis (the goodput objective: test_sis_goodput.py)."""

from __future__ import annotations

import math
import random

import pytest

from spaceserve.runtime.policy.curves import Curve, CurveSet
from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler

TOTAL = 132
SMS = list(range(4, TOTAL + 1, 4))
ALLOWED = list(range(8, 121, 8))


def _grid(fn, *axes):
    def rec(prefix, rest):
        if not rest:
            return fn(*prefix)
        return [rec((*prefix, x), rest[1:]) for x in rest[0]]

    return [rec((n,), list(axes)) for n in SMS]


def _enc(n, p):  # parallel up to p/64 SMs: small batches saturate early
    return p * 1e-7 * TOTAL / min(n, max(4.0, min(TOTAL, p / 64)))


def _pre(n, t, c):  # a fixed 1 ms plus work parallel up to t/2 SMs
    return 1e-3 + (t * 1e-5 + t * c * 1e-9) * TOTAL / min(n, max(2.0, min(TOTAL, t / 2)))


def _dec(n, b, c):  # memory-bound: saturates at 60 SMs
    return (2e-3 + b * c * 2e-9) * max(1.0, 60 / n) + 1e-5 * b


def curves() -> CurveSet:
    p = [256, 1024, 4096, 8192, 16384, 65536]
    t, tc = [16, 256, 1024, 4096], [0, 4096]
    b, dc = [1, 8, 32, 128], [0, 1024, 4096, 16384]
    enc = Curve(("patches",), {"patches": p}, SMS, _grid(_enc, p),
                _grid(lambda *a: 1.1 * _enc(*a), p))
    pre = Curve(("tokens", "context"), {"tokens": t, "context": tc}, SMS, _grid(_pre, t, tc),
                _grid(lambda *a: 1.1 * _pre(*a), t, tc))
    dec = Curve(("batch", "context"), {"batch": b, "context": dc}, SMS, _grid(_dec, b, dc),
                _grid(lambda *a: 1.08 * _dec(*a), b, dc))
    return CurveSet("H200", TOTAL, {"name": "synthetic", "vision_depth": 32}, "bfloat16",
                    "measured", enc, pre, dec)


def _waves(n, p):  # wave quantisation: 128-patch tiles, one wave per `n` tiles
    return math.ceil(math.ceil(p / 128) / n) * 2e-5


def wave_curves() -> CurveSet:
    """Encoder curves whose saturation point is not monotone in the work (72 vs 73 tiles)."""
    p = [1024, 4096, 9216, 9344, 16384, 65536]
    enc = Curve(("patches",), {"patches": p}, SMS, _grid(_waves, p),
                _grid(lambda *a: 1.1 * _waves(*a), p))
    c = curves()
    return CurveSet("H200", TOTAL, c.model, "bfloat16", "measured", enc, c.prefill_curve,
                    c.decode_curve)


CURVES = curves()
WAVES = wave_curves()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sis(clock=None, curves=CURVES, **kw) -> SpaceInferenceScheduler:
    kw.setdefault("objective", "tpot")
    return SpaceInferenceScheduler(curves, ALLOWED, clock=clock or Clock(), **kw)


SIZES = [256, 700, 1024, 3000, 4096, 8192, 9216, 9300, 9344, 10764, 30000]


def random_state(rng: random.Random) -> SisState:
    jobs = tuple(PendingEncode(rng.choice(SIZES),
                               rng.randint(1, 32), rng.choice([0, 320, 1260, 2755]))
                 for _ in range(rng.randint(0, 4)))
    prompts = tuple(rng.choice([16, 64, 300, 1500, 2755]) for _ in range(rng.randint(0, 3)))
    return SisState(jobs, prompts, rng.choice([0, 1, 8, 32, 64, 128]), rng.uniform(0, 12000))


def test_tpot_target_holds_whenever_some_split_meets_it() -> None:
    rng = random.Random(0)
    infeasible = feasible = 0
    for i in range(400):
        state = random_state(rng)
        if not state.encode and not state.prefill:
            continue
        absolute = rng.choice([None, None, 0.002, 0.003, 0.005])
        s = sis(tpot_target_s=absolute)
        split = s.decide(state)
        target = s.tpot_target(state.decode_batch, state.decode_context)
        assert split.tpot_target_s == target
        if any(s.predict_tpot(state, e) <= target for e in ALLOWED):
            feasible += 1
            assert s.predict_tpot(state, split.encoder_sms) <= target, (i, state, split)
            assert split.tpot_ok and split.encoder_sms in ALLOWED
        else:
            infeasible += 1  # the encoder still progresses, on the smallest split
            assert split.encoder_sms == ALLOWED[0] and not split.tpot_ok
        assert split.encoder_sms + split.decoder_sms == TOTAL
    assert feasible > 100 and infeasible > 10


def test_target_holds_through_a_sequence_with_hysteresis() -> None:
    rng, clock = random.Random(1), Clock()
    s = sis(clock)
    for _ in range(300):
        clock.t += rng.uniform(0.001, 0.02)
        state = random_state(rng)
        split = s.decide(state)
        target = s.tpot_target(state.decode_batch, state.decode_context)
        if any(s.predict_tpot(state, e) <= target for e in ALLOWED):
            assert s.predict_tpot(state, split.encoder_sms) <= target


def test_no_encoder_work_gives_decoder_every_sm() -> None:
    clock = Clock()
    s = sis(clock, min_dwell_s=10.0)
    busy = SisState((PendingEncode(8192, 32, 2755),), (), 32, 1024)
    assert s.decide(busy).encoder_sms > 0
    clock.t += 0.001  # well inside the dwell time
    for batch in (0, 1, 32, 128):
        split = s.decide(SisState((), (), batch, 2048))
        assert (split.encoder_sms, split.decoder_sms) == (0, TOTAL)
        assert split.predicted_ttft_s == 0.0
    assert s.decide(busy).encoder_sms > 0  # work appearing is not held back either


def _more(state: SisState, rng: random.Random) -> SisState:
    """`state` with strictly more pending work, at the same decode load."""
    jobs, prompts = list(state.encode), list(state.prefill)
    kind = rng.choice(["job", "bigger", "layers", "prompt", "longer"])
    if kind == "job" or not jobs:
        jobs.append(PendingEncode(rng.choice(SIZES), rng.randint(1, 32), rng.choice([0, 1300])))
    elif kind == "bigger":
        i = rng.randrange(len(jobs))
        j = jobs[i]
        jobs[i] = PendingEncode(j.patches + rng.choice([1, 100, 200, 5000, 20000]), j.layers_left,
                                j.prefill_tokens)
    elif kind == "layers":
        i = rng.randrange(len(jobs))
        j = jobs[i]
        jobs[i] = PendingEncode(j.patches, min(32, j.layers_left + rng.randint(1, 8)),
                                j.prefill_tokens + rng.randint(0, 500))
    elif kind == "prompt" or not prompts:
        prompts.append(rng.choice([16, 400, 3000]))
    else:
        i = rng.randrange(len(prompts))
        prompts[i] += rng.randint(1, 3000)
    return SisState(tuple(jobs), tuple(prompts), state.decode_batch, state.decode_context)


@pytest.mark.parametrize("curves", [CURVES, WAVES], ids=["smooth", "waves"])
def test_more_pending_work_never_gets_fewer_encoder_sms(curves) -> None:
    rng = random.Random(2)
    seen = set()
    for i in range(500):
        state = random_state(rng)
        more = _more(state, rng)
        for absolute in (None, 0.0025):
            a = sis(curves=curves, tpot_target_s=absolute).decide(state)
            b = sis(curves=curves, tpot_target_s=absolute).decide(more)
            assert b.encoder_sms >= a.encoder_sms, (i, state, more, a, b)
            seen.add(b.encoder_sms)
    assert len(seen) >= 4  # the property is exercised across many distinct splits


def test_ties_go_to_the_decoder() -> None:
    s = sis()
    small = SisState((PendingEncode(256, 32),), (), 32, 1024)  # saturates at 4 SMs
    split = s.decide(small)
    assert split.encoder_sms == ALLOWED[0]
    big = SisState((PendingEncode(65536, 32),), (), 32, 1024)
    cap = sis().decide(big).encoder_sms  # keeps scaling: the most the TPOT target allows
    assert cap > 32
    assert s.predict_ttft(small, ALLOWED[0]) == pytest.approx(s.predict_ttft(small, cap),
                                                               rel=0.011)
    mid = sis().decide(SisState((PendingEncode(4096, 32),), (), 32, 1024)).encoder_sms
    assert ALLOWED[0] < mid <= cap


def test_hysteresis_suppresses_flapping() -> None:
    def changes(**kw) -> tuple[int, int]:
        rng, clock = random.Random(3), Clock()
        s = sis(clock, **kw)
        prev, n, worst = None, 0, 0.0
        for _ in range(400):
            clock.t += 0.005
            patches = rng.choice([1024, 4096]) + rng.randint(-50, 50)
            state = SisState((PendingEncode(patches, rng.randint(20, 32)),), (), 32,
                             1024 + rng.uniform(-40, 40))
            split = s.decide(state)
            target = s.tpot_target(state.decode_batch, state.decode_context)
            worst = max(worst, s.predict_tpot(state, split.encoder_sms) / target)
            n += prev is not None and split.encoder_sms != prev
            prev = split.encoder_sms
        assert worst <= 1.0
        return n

    flappy = changes(min_gain=0.0, min_dwell_s=0.0)
    calm = changes()
    assert flappy >= 50 and calm <= 4, (flappy, calm)


def test_prefill_placement_compares_predictions() -> None:
    s = sis()
    short = s.decide(SisState((), (16,), 8, 1024))
    assert short.prefill_on == "decode"  # one cheap chunk beside decode beats waiting
    assert short.predicted_tpot_s <= short.tpot_target_s
    long = sis().decide(SisState((), (4000,), 8, 1024))
    assert long.prefill_on == "compute"  # chunks would break the TPOT target
    assert s.curves.mixed_step(8, 1024, 512, 0, TOTAL - long.encoder_sms, True) > \
        long.tpot_target_s


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="allowed_encoder_sms"):
        SpaceInferenceScheduler(CURVES, [])
    with pytest.raises(ValueError, match="allowed_encoder_sms"):
        SpaceInferenceScheduler(CURVES, [8, 132])
    with pytest.raises(ValueError, match="tpot_factor"):
        SpaceInferenceScheduler(CURVES, ALLOWED, tpot_factor=0.9)
    with pytest.raises(ValueError, match="tpot_target_s"):
        SpaceInferenceScheduler(CURVES, ALLOWED, tpot_target_s=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        SpaceInferenceScheduler(CURVES, ALLOWED, chunk_tokens=0)
