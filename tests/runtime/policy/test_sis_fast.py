"""The fast `decide` (per-split tables, one view per round) makes the decisions the original code
made: the same split, placement and predictions, round after round with hysteresis, on random
saturated and light states, for both objectives and both SLO kinds."""

from __future__ import annotations

import dataclasses
import random

import pytest

from bench.sim.bench_sis import random_state
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.scheduling import scheduling_policy
from spaceserve.runtime.policy.sis import SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from tests.runtime.policy._sis_reference import ReferenceSis

CURVES = analytic_curves()


def _pair(slo: str, objective: str) -> tuple[SpaceInferenceScheduler, ReferenceSis]:
    policy = scheduling_policy(CURVES, Slo.parse(slo), objective=objective)
    out = []
    for cls in (SpaceInferenceScheduler, ReferenceSis):
        t = [0.0]

        def clock(t=t) -> float:
            t[0] += 0.005
            return t[0]

        kw = dict(objective=policy.objective, slo=policy.slo, decode_margin=policy.decode_margin,
                  ttft_margin=policy.ttft_margin, comfort_factor=policy.comfort_factor,
                  clock=clock)
        if cls is SpaceInferenceScheduler:
            kw["actions"] = "share"  # the reference had no windows
        out.append(cls(CURVES, policy.splits, **kw))
    return out[0], out[1]


@pytest.mark.parametrize("slo", ["ttft:2000,tpot:50", "ttft:2000,itl:21", "ttft:1000,tpot:30"])
@pytest.mark.parametrize("objective", ["goodput", "tpot"])
def test_fast_decide_matches_the_reference(slo: str, objective: str) -> None:
    fast, ref = _pair(slo, objective)
    rng = random.Random(hash((slo, objective)) & 0xFFFF)
    seen = set()
    for i in range(400):
        pending = rng.choice((0, 0, 1, 2, 5, 16, 64))
        state = random_state(rng, pending)
        if rng.random() < 0.3:  # light load: few jobs, young, no arrivals
            state = random_state(rng, min(pending, 2))
        if rng.random() < 0.3:  # batched jobs carrying several requests
            state = dataclasses.replace(state, encode=tuple(
                dataclasses.replace(j, requests=rng.randint(1, 3)) for j in state.encode))
        a, b = fast.decide(state), ref.decide(state)
        assert dataclasses.astuple(a) == dataclasses.astuple(b), f"round {i}: {a} != {b}"
        seen.add((a.encoder_sms, a.prefill_on))
    assert len(seen) >= 2  # the rounds moved the decision: the comparison is not vacuous
