"""The engine executes SIS's whole-GPU window: the full partition becomes current, encoder steps
(decoder paused, the encoder launching on every SM) alternate with whole-device decode steps
that carry the prefill chunks, and no output token changes; pure sharing never takes one."""

import pytest

from spaceserve import SamplingParams
from spaceserve.runtime.policy.sis import Split
from tests.runtime.spatial.test_spatial import check_outputs, engine, workload

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]


def test_windows_run_and_change_no_token() -> None:
    eng = engine("spatial", encoder_splits=(16, 64))
    total = eng.spatial.partitions.total
    plan = [(total, "decode"), (total, "decode"), (16, "compute"), (total, "decode"),
            (0, "compute")]
    calls = iter(range(10**6))
    def decide(state):
        e, where = plan[next(calls) % len(plan)]
        return Split(e, total - e, where, 0.0, 0.0, 1.0, True)

    eng.spatial.sis.decide = decide
    try:
        prompts, params = workload(seed=3, n=12)
        check_outputs(eng, prompts, params, eng.generate(prompts, params))
        assert eng.spatial.num_windows > 0
        assert {e for _, e in eng.spatial.switches} >= {0, 16}
        eng.check_idle()
    finally:
        eng.close()


def test_the_engine_passes_sis_actions_on() -> None:
    for actions in ("share", "superset"):
        eng = engine("spatial", sis_actions=actions)
        try:
            assert eng.spatial.sis.actions == actions
        finally:
            eng.close()
    with pytest.raises(ValueError, match="sis.actions"):
        engine("spatial", sis_actions="everything")


@pytest.mark.parametrize("pipelined", [True, False])
def test_turns_pipeline_decode_steps_and_change_no_token(pipelined) -> None:
    """While SIS takes turns, asynchronous scheduling leaves each decode step on the full
    partition in flight, read back by the next step (windows, a split change and leaving turns
    read it back first): the tokens are the reference's, and nothing stays in flight."""
    eng = engine("spatial", encoder_splits=(16, 64), async_scheduling=pipelined)
    total = eng.spatial.partitions.total
    plan = [(total, "decode", True)] * 5 + [(0, "compute", True)] * 3 + \
        [(16, "compute", False), (total, "decode", True), (0, "compute", False)]
    calls = iter(range(10**6))

    def decide(state):
        e, where, turns = plan[next(calls) % len(plan)]
        eng.spatial.sis.turns = turns  # the superset's regime
        return Split(e, total - e, where, 0.0, 0.0, 1.0, True)

    eng.spatial.sis.decide = decide
    try:
        prompts, params = workload(seed=5, n=14)
        check_outputs(eng, prompts, params, eng.generate(prompts, params))
        assert eng.spatial.num_windows > 0
        assert (eng.spatial.num_pipelined > 10) == pipelined, eng.spatial.num_pipelined
        assert {e for _, e in eng.spatial.switches} >= {0, 16}
        eng.check_idle()
    finally:
        eng.close()


def test_abort_and_pause_while_a_turns_step_is_in_flight() -> None:
    """Aborts and a pause land while a pipelined decode step is in flight: the others' tokens
    (and the paused one's, once resumed) are the reference's, the aborted one ends, nothing is
    held at the end."""
    eng = engine("spatial", encoder_splits=(16, 64), async_scheduling=True)
    total = eng.spatial.partitions.total

    def decide(state):
        eng.spatial.sis.turns = True
        return Split(total, 0, "decode", 0.0, 0.0, 1.0, True)

    eng.spatial.sis.decide = decide
    try:
        prompts, params = workload(seed=7, n=8)
        params = [SamplingParams(max_tokens=12, temperature=0.8, seed=50 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs: dict[str, list] = {}
        ids = [eng.add_request(p, sp, sink=lambda o: outs.setdefault(o.request_id, []).append(o))
               for p, sp in zip(prompts, params, strict=True)]
        steps, inflight, paused_at = 0, 0, None
        while eng.has_unfinished():
            eng.step()
            steps += 1
            inflight += eng._inflight is not None
            if paused_at is None and steps >= 6 and eng._inflight is not None:
                assert eng.abort(ids[0]) and eng.pause(ids[1])  # they meet a step in flight
                paused_at = steps
            if paused_at is not None and steps == paused_at + 6:
                assert eng.resume(ids[1])
            assert steps < 500
        assert paused_at is not None
        assert inflight > 5 and eng.spatial.num_pipelined > 5
        final = {rid: next(o for o in v if o.finished) for rid, v in outs.items()}
        assert final[ids[0]].finish_reason == "abort"
        check_outputs(eng, prompts[1:], params[1:], [final[r] for r in ids[1:]])
        eng.check_idle()
    finally:
        eng.close()


def test_turns_order_the_encoder_fifo_and_admission_prices_them() -> None:
    """While SIS takes turns the engine's encoder stage runs jobs first in first out without a
    deadline and admission prices the work ahead as temporal-chunked at the turns' window and
    budget, in that order (`RegimePricing`, as the simulator); sharing again restores TWSRFT
    with the SLO's deadline and the sharing split's costs."""
    from spaceserve.runtime.policy.admission import stage_costs

    eng = engine("spatial", encoder_splits=(16, 64), sis_actions="superset", admission="slo",
                 slo="ttft:2000,tpot:50")
    sis, adm = eng.spatial.sis, eng.admission
    total = eng.spatial.partitions.total
    sharing = adm.regimes.sharing
    state = {"turns": True}

    def decide(_):
        sis.turns = state["turns"]
        sis.last_window_s, sis.last_turn_tokens = 0.0125, 512
        e = total if sis.turns else 16
        return Split(e, total - e, "decode" if sis.turns else "compute", 0.0, 0.0, 1.0, True)

    sis.decide = decide
    try:
        prompts, params = workload(seed=9, n=4)
        for p, sp in zip(prompts, params, strict=True):
            eng.add_request(p, sp)
        for turns in (True, False):
            state["turns"] = turns
            for _ in range(2):  # admission follows at the next step's check
                eng.step()
            s = eng.spatial.stage.sched.scheds[0]
            if turns:
                enc, pre, _ = stage_costs(adm.regimes.curves, "temporal-chunked",
                                          window_s=0.0125, budget=512)
                assert (s.policy, s.deadline_s) == ("fifo", None)
                assert (adm.policy.order, adm.deadline_s, adm.policy.pipelined) == (
                    "fifo", None, True)
                assert adm.enc_s(1024, 32) == enc(1024, 32) and adm.pre_s(300) == pre(300)
            else:
                assert (s.policy, s.deadline_s) == ("twsrft", eng.spatial.policy.deadline_s)
                assert (adm.enc_s, adm.pre_s, adm.policy.order) == (
                    sharing.enc_s, sharing.pre_s, "twsrft")
                assert adm.deadline_s == sharing.deadline_s is not None
        while eng.has_unfinished():
            eng.step()
        eng.check_idle()
    finally:
        eng.close()
    plain = engine("spatial", sis_actions="superset")  # nothing sheds: turns keep TWSRFT
    try:
        assert (eng.spatial.turns_order, plain.spatial.turns_order) == ("fifo", "twsrft")
        # SIS paces the turns by the oldest wait only where nothing sheds (`pace_window`)
        assert (eng.spatial.sis.turns_order, plain.spatial.sis.turns_order) == ("fifo", "twsrft")
    finally:
        plain.close()


@pytest.mark.parametrize("executor", ["engine", "simulator"])
def test_encoder_work_arriving_after_decode_steps_gets_the_next_window(executor, monkeypatch
                                                                       ) -> None:
    """Taking turns, a window alternates with a decode step; once the encoder has had nothing
    to run (decode steps only), the first step with encoder work is the encoder's, as
    temporal-chunked starts each step with its window - not a decode step more first. Both
    executors follow the rule (`SpatialRuntime._window_step`, `SpatialLoop._window_step`)."""
    from types import SimpleNamespace

    from spaceserve.runtime.sim.loops import spatial_loop
    from spaceserve.runtime.spatial.step import SpatialRuntime

    ready = iter([True, False, True, True, True, False, False, True, True])
    launched: list[bool] = []
    stub = SimpleNamespace(sis=SimpleNamespace(hold=False), _encoder_turn=False,
                           encoder_turn=False)
    stub._window_ready = lambda: next(ready)
    stub.sim = SimpleNamespace(sis=stub.sis)
    if executor == "engine":
        stub._window_launch = lambda hide=False: True
        step = SpatialRuntime._window_step
    else:
        monkeypatch.setattr(spatial_loop, "window_launch", lambda loop, hide=False: True)
        step = spatial_loop.SpatialLoop._window_step
    for _ in range(9):
        launched.append(step(stub))
    # window, idle (decode), window at once, decode, window, idle, idle, window at once, decode
    assert launched == [True, False, True, False, True, False, False, True, False]


def test_a_window_waiting_for_its_partition_steps_decodes_only() -> None:
    """SIS takes a whole-GPU window while the compute side still has work in flight (here its
    idleness is withheld two checks in three): the switch waits, and the steps run meanwhile
    on the shared partition carry no prefill chunk - one would run on the decoder's SMs,
    priced by nothing - and change no token."""
    eng = engine("spatial", encoder_splits=(16, 64))
    sp = eng.spatial
    total = sp.partitions.total
    plan = [(16, "compute"), (16, "compute"), (total, "decode"), (total, "decode"),
            (0, "compute")]
    calls, checks = iter(range(10**6)), iter(range(10**6))

    def decide(state):
        e, where = plan[next(calls) % len(plan)]
        return Split(e, total - e, where, 0.0, 0.0, 1.0, True)

    waiting: list[int] = []  # prefill tokens of each step taken while the switch waits
    schedule, idle = sp._schedule, sp.stage.idle

    def traced(sched):
        batch = schedule(sched)
        if sp._window and sp.partitions.current is not sp.partitions.full:
            waiting.append(batch.num_tokens - batch.num_decodes if batch else 0)
        return batch

    sp.sis.decide, sp._schedule = decide, traced
    sp.stage.idle = lambda: idle() and next(checks) % 3 == 2
    try:
        prompts, params = workload(seed=3, n=12)
        check_outputs(eng, prompts, params, eng.generate(prompts, params))
        assert waiting and not any(waiting), waiting
        assert sp.num_windows > 0
        eng.check_idle()
    finally:
        eng.close()
