"""One behaviour, two executors: the engine and the simulator build the same scheduling policy
(split set, SIS objective and margins, TWSRFT deadline, window, aging and batching rule, launch
model) from the same curves, SLO and knobs."""

from __future__ import annotations

import dataclasses

import pytest

from spaceserve import Engine
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.policy.model_curves import load_curves
from spaceserve.runtime.policy.scheduling import RateEstimator, SchedulingPolicy, graph_count
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim import SimConfig, Simulator
from spaceserve.runtime.sim.config import chunked_window_s, sim_policy
from spaceserve.runtime.spatial.split_set import engine_policy
from spaceserve.runtime.worker.null import NullModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [("ttft:2000,tpot:50", "goodput"), ("ttft:2000,itl:21", "goodput"),
         ("ttft:2000,tpot:50", "tpot"), ("tpot:50", "goodput")]


@pytest.mark.parametrize("slo, objective", CASES)
def test_engine_and_simulator_schedule_alike(slo, objective) -> None:
    runner = NullModelRunner()
    eng = Engine(runner, EngineConfig(mode="spatial", num_kv_blocks=16, block_size=4,
                                      max_num_seqs=4, slo=slo, sis_objective=objective))
    curves = load_curves(None, runner)
    sim = Simulator(curves, SimConfig(mode="spatial", slo=Slo.parse(slo),
                                      sis_objective=objective))
    policy = eng.spatial.policy
    assert policy == sim.policy == engine_policy(curves, eng.config, 132)
    assert len(policy.splits) <= 6 and all(e % 8 == 0 for e in policy.splits)
    assert tuple(sorted(eng.spatial.partitions.splits)) == policy.splits == sim.allowed
    assert graph_count(policy) == len(eng.spatial.partitions.partitions())
    a, b = eng.spatial.sis, sim.sis
    for name in ("allowed", "objective", "slo", "decode_margin", "comfort_factor",
                 "tpot_factor", "total"):
        assert getattr(a, name) == getattr(b, name), name
    x, y = eng.spatial.stage.sched.scheds[0], sim.sched.scheds[0]  # one queue per rank
    for name in ("deadline_s", "window_s", "max_wait_s", "token_budget", "policy"):
        assert getattr(x, name) == getattr(y, name), name
    assert x.deadline_s == (None if "ttft" not in slo else pytest.approx(1.8))
    eng.close()


def test_sim_policy_follows_its_reference_load() -> None:
    curves = load_curves(None, NullModelRunner())
    base = sim_policy(curves, SimConfig())
    assert base == engine_policy(curves, EngineConfig(mode="spatial"), 132)
    heavy = sim_policy(curves, SimConfig(background=256, background_context=16000))
    assert heavy.splits != base.splits  # another decode load, another split set
    assert heavy == engine_policy(curves, EngineConfig(mode="spatial", sis_load=(256, 16128)),
                                  132)


def test_policy_validation_and_launch_model() -> None:
    p = SchedulingPolicy((32, 64), 132)
    assert p.layers_per_step() == int(0.003 / 0.00024)
    assert p.layers_per_step(0.040) == int(0.032 / 0.00024)  # a long decode step: more
    assert dataclasses.replace(p, launch_budget_s=0.0).layers_per_step(0.04) == 1
    for bad in (dict(objective="x"), dict(splits=(0,)), dict(decode_margin=0.0),
                dict(comfort_factor=0.5)):
        with pytest.raises(ValueError):
            dataclasses.replace(p, **bad)
    with pytest.raises(ValueError, match="sis_objective"):
        EngineConfig(sis_objective="latency")
    with pytest.raises(ValueError, match="sis_load"):
        EngineConfig(sis_load=(0, 10))
    est = RateEstimator(2.0)
    for t in (0.0, 0.5, 1.0, 1.5):
        est.add(t, 100 * (1 + int(t)), 10)
    assert est.estimate(1.5) == (2.0, 150.0, 10.0)
    assert est.estimate(3.2) == (0.5, 200.0, 10.0)  # only the arrival at 1.5 s is left


def test_a_burst_is_seen_before_the_window_fills() -> None:
    """From a cold start the rate is taken over the time seen, not over a whole window: 20/s
    read as 20/s after 0.3 s (not 3/s), at least `MIN_SPAN_S` (one arrival is no rate), and
    again after a window without arrivals."""
    from spaceserve.runtime.policy.scheduling import MIN_SPAN_S

    est = RateEstimator(2.0)
    assert est.estimate(0.0) == (0.0, 0.0, 0.0)
    for i in range(7):
        est.add(10.0 + 0.05 * i, 100, 10)
    assert est.estimate(10.3) == pytest.approx((20.0, 100.0, 10.0))
    est2 = RateEstimator(2.0)
    est2.add(1.0, 100, 10)
    est2.add(1.01, 100, 10)
    assert est2.estimate(1.01)[0] == pytest.approx(1 / MIN_SPAN_S)
    for t in (1.5, 2.0, 2.5, 3.0):  # a full window: the count over the window
        est2.add(t, 100, 10)
    assert est2.estimate(3.1)[0] == pytest.approx(4 / 2.0)  # 1.5 to 3.0 s
    est2.add(6.0, 100, 10)  # after 2.9 s without arrivals: a cold start again
    est2.add(6.1, 100, 10)
    est2.add(6.2, 100, 10)
    assert est2.estimate(6.5)[0] == pytest.approx(2 / 0.5)


def test_time_multiplexed_baselines_get_the_same_encoder_scheduling() -> None:
    """The baselines are not weakened: temporal-chunked runs the deadline-aware TWSRFT of
    spatial (each request alone, as the engine's chunked stage), in the simulator and in the
    engine; temporal runs the engine's whole FIFO passes."""
    curves = load_curves(None, NullModelRunner())
    slo = Slo.parse("ttft:2000,itl:21")
    spatial = Simulator(curves, SimConfig(mode="spatial", slo=slo)).sched.scheds[0]
    cfg = SimConfig(mode="temporal-chunked", slo=slo)
    chunked = Simulator(curves, cfg).sched.scheds[0]
    temporal = Simulator(curves, SimConfig(mode="temporal", slo=slo))
    assert (chunked.policy, chunked.deadline_s, chunked.window_s) == \
        ("twsrft", spatial.deadline_s, chunked_window_s(curves, cfg)) and \
        chunked.deadline_s == pytest.approx(1.8)
    assert temporal.sched is None and temporal.loop is not None and not temporal.loop.chunked
    eng = Engine(NullModelRunner(), EngineConfig(mode="temporal-chunked", slo=slo,
                                                 num_kv_blocks=64, block_size=4))
    stage = eng.encoder.sched
    assert (stage.policy, stage.deadline_s, stage.token_budget) == \
        (chunked.policy, pytest.approx(chunked.deadline_s), chunked.token_budget) == \
        ("twsrft", pytest.approx(1.8), 1)
