"""What the engine's spatial runtime tells SIS: waiting encoder jobs carry their requests' ages
on the engine's clock, ready prompts their ages, and the image arrival rate is measured - a
state with zero ages or no rate would let SIS take every queue for a fresh, idle one."""

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.policy.scheduling import MIN_SPAN_S
from spaceserve.runtime.worker.null import NullModelRunner
from tests.runtime.spatial.test_spatial import CFG, FixedClock, image_prompt

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]


def test_sis_sees_ages_and_the_arrival_rate() -> None:
    clock = FixedClock()
    eng = Engine(NullModelRunner(), EngineConfig(mode="spatial", **CFG), clock=clock)
    seen = []
    decide = eng.spatial.sis.decide

    def spy(state):
        seen.append((clock.t, state))
        return decide(state)

    eng.spatial.sis.decide = spy
    launch = eng.spatial.stage.launch  # nothing is encoded before the requests have waited
    eng.spatial.stage.launch = lambda *a, **kw: launch(*a, **kw) if clock.t > 0 else 0
    try:
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for _ in range(3):
            eng.add_request(image_prompt(gen, 5, (1, 8, 4)), params)
        eng.step()  # the stage takes them at t = 0
        clock.t = 0.75  # they have waited 0.75 s when the engine next looks
        eng.step()
        while eng.has_unfinished():
            clock.t += 0.01
            eng.step()
    finally:
        eng.close()
    encode = [(t, j) for t, s in seen for j in s.encode]
    assert any(t > 0 for t, _ in encode), "SIS never saw an encoder job wait"
    assert all(j.age_s == pytest.approx(t) for t, j in encode)  # ages from arrival (t = 0)
    ready = [(t, a) for t, s in seen for a in s.prefill_age_s]
    assert any(t > 0 for t, _ in ready) and all(a == pytest.approx(t) for t, a in ready)
    rates = [(t, s.arrival_rate) for t, s in seen if t < 2.0]  # before a window has passed:
    assert rates and all(r == pytest.approx(2 / max(t, MIN_SPAN_S)) for t, r in rates)  # burst
    assert all(s.arrival_patches > 0 and s.arrival_prompt > 0 for t, s in seen if t < 2.0)
