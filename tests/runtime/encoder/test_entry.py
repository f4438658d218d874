"""Entering the encoder's queue by deadline: when the held-embedding cap is full, the next free
slot goes to the oldest request that can still meet TWSRFT's deadline, before older ones that
cannot (`TwsrftScheduler.entry`) - in the engine's temporal-chunked and spatial stages and in
the simulator's loops. Past saturation without admission, entering in arrival order fills
every slot with requests already late and nothing after is on time."""

from __future__ import annotations

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.policy.twsrft import TwsrftScheduler
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.workload import Workload
from spaceserve.runtime.worker.null import NullModelRunner
from tests.runtime.engine.test_engine_null import image_prompt
from tests.runtime.policy.test_twsrft import Clock, cost  # 1 ms per 1000 patches per layer

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
CFG = dict(num_kv_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
           max_held_embeddings=1, slo="ttft:1000,tpot:50")


def test_entry_picks_the_oldest_request_that_can_still_meet_its_deadline() -> None:
    clock = Clock()
    clock.t = 1000.0
    s = TwsrftScheduler(10, cost, deadline_s=0.1, clock=clock)
    now = clock.t
    # late: arrived 0.5 s ago; late: 30 ms of work, 20 ms left; live: 5 ms of work, 50 ms left
    waiting = [(now - 0.5, 500), (now - 0.08, 3000), (now - 0.05, 500), (None, 500)]
    assert s.entry(waiting) == 2
    assert s.entry(iter(waiting)) == 2  # any iterable, read once
    assert s.entry(waiting[:2]) == 0  # none can: arrival order
    # an arrival ahead of the clock counts as now: 200 ms of work cannot meet 100 ms
    assert s.entry([(now - 0.5, 500), (now + 5.0, 20_000)]) == 0
    backlog = list(waiting)
    assert s.take(backlog, lambda w: w) == waiting[2] and backlog == waiting[:2] + waiting[3:]
    assert TwsrftScheduler(10, cost, clock=clock).entry(waiting) == 0  # no deadline
    fifo = TwsrftScheduler(10, cost, deadline_s=0.1, policy="fifo", clock=clock)
    assert fifo.entry(waiting) == 0


def _entered(eng: Engine, watch: dict[str, object]) -> list[str]:
    """Step `eng` to the end; the order in which the `watch`ed requests left its encoder
    stage's backlog (took a held slot)."""
    stage, order = eng.encoder, []
    for _ in range(10_000):
        queued = {id(j.req) for j in stage._backlog}
        for name, req in watch.items():
            if name not in order and id(req) not in queued:
                order.append(name)
        if not eng.has_unfinished():
            return order
        eng.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("mode", ["temporal-chunked", "spatial"])
def test_a_free_slot_goes_to_a_request_that_can_still_be_on_time(mode: str) -> None:
    """One held slot, taken; behind it an old request (late) and a fresh one: the fresh one
    enters first. Entered in arrival order (the rule removed), the old one would."""
    gen = torch.Generator().manual_seed(3)
    # the chunked stage reads each request's arrival (the engine's monotonic clock); the
    # spatial stage stamps arrivals on its own clock, which a test can move
    clock = Clock() if mode == "spatial" else None
    eng = Engine(NullModelRunner(encoder_layers=4),
                 EngineConfig(mode=mode, encoder_policy="twsrft", **CFG), clock=clock)
    eng.add_request(image_prompt(gen, 3), GREEDY)
    eng.step()  # it takes the slot
    old = eng._active[eng.add_request(image_prompt(gen, 3, grids=((1, 8, 8),)), GREEDY)]
    eng.step()
    if clock is not None:
        clock.t += 5.0
    else:
        old.arrival_time -= 5.0
    fresh = eng._active[eng.add_request(image_prompt(gen, 3), GREEDY)]
    eng.step()
    assert len(eng.encoder._backlog) == 2
    assert _entered(eng, {"old": old, "fresh": fresh}) == ["fresh", "old"]


@pytest.mark.parametrize("mode", ["temporal-chunked", "spatial"])
def test_past_saturation_without_admission_later_arrivals_stay_on_time(mode: str) -> None:
    """Simulator, queue admission, 22 img/s (past what the whole GPU sustains) with 16 held
    slots: a fifth or more of the last third of the arrivals still meets the TTFT bound
    (31 and 45 of 94 here); entered in arrival order, none does."""
    from spaceserve.models.presets import PRESETS

    curves = analytic_curves(PRESETS["qwen2-vl-7b"], "H200")
    cfg = SimConfig(mode=mode, max_held=16, slo=Slo.parse("ttft:2000,tpot:50"),
                    **({"sis_actions": "superset"} if mode == "spatial" else {}))
    res = simulate(curves, cfg, Workload(22.0, 12.0, seed=0), drain_s=10.0)
    last = [r for r in res.requests if r.kind == "image" and r.arrival >= 8.0]
    on_time = [r for r in last if r.first_token is not None and r.first_token - r.arrival <= 2.0]
    assert len(last) > 50
    assert len(on_time) >= 0.2 * len(last), (len(on_time), len(last))
