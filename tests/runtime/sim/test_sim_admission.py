"""SLO-aware admission in the simulator: past saturation the served requests' TTFT stays
bounded, shed requests count as misses, goodput does not fall, nothing is left held, and
``queue`` (the default) sheds nothing. Modelled H200 curves, short runs."""

from __future__ import annotations

import dataclasses

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cli import main as sim_main
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.engine import SimConfig
from spaceserve.runtime.sim.metrics import image_goodput, summarize
from spaceserve.runtime.sim.sweep.rates import _row
from spaceserve.runtime.sim.workload import Workload

SLO = Slo.parse("ttft:2000,tpot:50")


@pytest.fixture(scope="module")
def curves():
    return analytic_curves()


@pytest.mark.parametrize("mode", ["spatial", "temporal-chunked"])
def test_admission_bounds_the_served_tail_past_saturation(curves, mode) -> None:
    work = Workload(22.0, 12.0, seed=0)
    base = SimConfig(mode=mode, slo=SLO)
    plain = simulate(curves, base, work)
    shed = simulate(curves, dataclasses.replace(base, admission="slo"), work)
    p, s = summarize(plain.requests, ("image",)), summarize(shed.requests, ("image",))
    assert p["shed"] == 0 and p["ttft"]["p99_ms"] > 2 * SLO.ttft  # the tail it fixes
    assert s["shed"] > 0 and s["ttft"]["p99_ms"] <= 2 * SLO.ttft
    assert s["unfinished"] == 0
    good_p, good_s = plain.goodput(SLO), shed.goodput(SLO)
    assert good_s.counted == good_p.counted  # shed requests are counted, as misses
    assert good_s.rate_per_s >= 0.98 * good_p.rate_per_s
    for gpu in shed.gpus:  # nothing held by a shed request
        adm = gpu.admission
        assert not adm.waiting and not adm.cancel
        assert gpu.sched is None or len(gpu.sched) == 0
        if gpu.loop is not None:
            assert not gpu.loop.held and not gpu.loop.jobs and not gpu.loop.backlog
        else:
            assert not gpu.prefill_q
    row = _row(22.0, [shed], SLO)["goodput"]
    assert row["shed_share"] == pytest.approx(s["shed"] / good_s.counted)
    assert row["image_ttft_p99_ms"] <= 2 * SLO.ttft and row["image_ttft_mean_ms"] > 0


def test_a_calm_rate_sheds_nothing(curves) -> None:
    work = Workload(6.0, 10.0, seed=1)
    res = simulate(curves, SimConfig(mode="spatial", slo=SLO, admission="slo"), work)
    assert summarize(res.requests, ("image",))["shed"] == 0
    assert image_goodput(res.requests, SLO, 10.0).attainment == 1.0


def test_sim_flag_and_bad_setting(tmp_path, capsys) -> None:
    assert sim_main(["--modes", "spatial", "--rates", "20", "--duration", "4", "--seeds", "0",
                     "--admission", "slo", "--no-plot", "--out", str(tmp_path)]) == 0
    assert "shed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="admission must be one of"):
        SimConfig(admission="drop")


def test_a_request_ended_while_its_encoding_runs_holds_nothing(curves) -> None:
    from spaceserve.runtime.sim.engine import Simulator
    from spaceserve.runtime.sim.workload import Request

    sim = Simulator(curves, SimConfig(mode="temporal-chunked", slo=SLO, admission="slo",
                                      background=0))
    req = Request(1, 0.0, 256, 16, 8, "image")
    sim.add(req)
    t = 0.0
    while not ("compute" in sim.ops and req in getattr(sim.ops["compute"].payload, "done", [])):
        t += 1e-4  # until the window that finishes its encoding is running
        sim.advance_to(t)
        assert t < 1.0
    sim.admission._end(req)
    sim.drain()
    assert req.shed == "ended" and req.first_token is None
    assert not sim.loop.held and not sim.loop.encoded and not sim.loop.jobs


def test_spatial_a_request_ended_while_its_grant_runs_is_never_prefilled(curves) -> None:
    from spaceserve.runtime.sim.engine import Simulator
    from spaceserve.runtime.sim.workload import Request

    sim = Simulator(curves, SimConfig(mode="spatial", slo=SLO, admission="slo", background=0))
    req = Request(1, 0.0, 256, 16, 8, "image")
    sim.add(req)
    t = 0.0
    while not ("compute" in sim.ops and sim.ops["compute"].kind == "encode"):
        t += 1e-4
        sim.advance_to(t)
        assert t < 1.0
    sim.admission._end(req)  # its job runs: cancelled once the grant is reported
    assert 1 in sim.admission.cancel
    sim.drain()
    assert req.first_token is None and not sim.prefill_q and len(sim.sched) == 0


@pytest.mark.parametrize("admission", ["slo", "queue"])
def test_the_superset_orders_and_prices_as_the_regime_it_runs(curves, admission,
                                                              monkeypatch) -> None:
    """While SIS takes turns under SLO-aware admission the encoder runs jobs first in first
    out without a deadline (temporal-chunked's best configuration) and admission prices the
    work ahead as that schedule (temporal-chunked's costs at the turns' window and budget,
    FIFO); while it shares, TWSRFT with the SLO's deadline and the sharing split's costs.
    Without admission nothing sheds, and turns keep TWSRFT. Checked at every decision of a run
    that takes turns and shares."""
    from spaceserve.runtime.policy.admission import stage_costs
    from spaceserve.runtime.sim.admission import SimAdmission
    from spaceserve.runtime.sim.loops.spatial_loop import SpatialLoop

    seen = {"order": set(), "pricing": set()}
    choose, check = SpatialLoop._choose, SimAdmission.check

    def choose_and_look(loop):
        ok = choose(loop)
        s = loop.twsrft.scheds[0]
        turns = loop.sim.sis.turns
        fifo = turns and admission == "slo"
        want = ("fifo", None) if fifo else ("twsrft", loop.plan.deadline_s)
        assert (s.policy, s.deadline_s) == want, (turns, s.policy, s.deadline_s)
        seen["order"].add(turns)
        return ok

    def check_and_look(adm):
        check(adm)
        sis, c = adm.sim.sis, adm.sim.config
        turns = sis.turns and sis.last_window_s > 0
        if turns:
            enc, pre, _ = stage_costs(
                curves, "temporal-chunked", window_s=round(sis.last_window_s, 5),
                budget=sis.last_turn_tokens, decode_batch=c.background,
                decode_context=c.background_context + c.background_output / 2)
        else:
            enc, pre = adm.regimes.sharing.enc_s, adm.regimes.sharing.pre_s
        assert adm.enc_s(1024, 32) == enc(1024, 32) and adm.pre_s(300) == pre(300)
        assert (adm.policy.order, adm.deadline_s) == (
            ("fifo", None) if turns else ("twsrft", adm.sim.policy.deadline_s))
        seen["pricing"].add(turns)

    monkeypatch.setattr(SpatialLoop, "_choose", choose_and_look)
    monkeypatch.setattr(SimAdmission, "check", check_and_look)
    cfg = SimConfig(mode="spatial", slo=SLO, admission=admission, sis_actions="superset")
    res = simulate(curves, cfg, Workload(20.0, 6.0, seed=1))
    assert res.gpus[0].sis.action_counts()["regime:turns"] >= 1
    assert seen == {"order": {False, True}, "pricing": {False, True}}
