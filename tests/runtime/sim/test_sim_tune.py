"""best-temporal: the strongest time-multiplexed configuration, tuned per rate and named in
results.json; the SLO-derived chunked window; the tail reported beside goodput."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cli import main
from spaceserve.runtime.sim.config import SimConfig, chunked_window_s
from spaceserve.runtime.sim.engine import Simulator
from spaceserve.runtime.sim.sweep.tune import (
    FLIPS,
    REFINE_STEPS,
    TUNE_BUDGETS,
    WINDOW_STEPS,
    candidates,
    flipped,
    refined,
)


@pytest.fixture(scope="module")
def h200() -> CurveSet:
    return analytic_curves(device="H200")


def test_the_chunked_window_fits_the_decode_bound(h200) -> None:
    """The largest window whose step (a full prefill chunk beside the batch) stays within the
    decode margin of the TPOT / ITL bound; 20 ms without one, 1 ms at least."""
    for text in ("ttft:2000,tpot:50", "ttft:2000,itl:21", "ttft:1000,tpot:30"):
        cfg = SimConfig(mode="temporal-chunked", slo=Slo.parse(text), max_num_batched_tokens=512)
        w = chunked_window_s(h200, cfg)
        step = h200.mixed_step(32, 1024 + 128, 512 - 32, 1024, 132) + cfg.host_s
        bound = min(v for v in (cfg.slo.tpot, cfg.slo.itl) if v) / 1e3
        assert w == pytest.approx(max(0.001, 0.8 * bound - step))
        assert Simulator(h200, cfg).window_s == w
    assert chunked_window_s(h200, SimConfig(slo=Slo.parse("ttft:2000"))) == 0.02
    wide = SimConfig(mode="temporal-chunked", slo=Slo.parse("ttft:2000,itl:21"))
    assert chunked_window_s(h200, wide) == 0.001  # a 2048-token step alone breaks 21 ms


def test_candidates_cover_budget_window_and_order(h200) -> None:
    base = SimConfig(slo=Slo.parse("ttft:2000,tpot:50"))
    got = candidates(h200, base)
    assert {k["max_num_batched_tokens"] for k, _ in got} == set(TUNE_BUDGETS)
    assert {(k["mode"], k["encoder_policy"]) for k, _ in got} == {
        ("temporal", "fifo"), ("temporal-chunked", "twsrft"), ("temporal-chunked", "fifo")}
    for k, cfg in got:
        assert (cfg.mode, cfg.max_num_batched_tokens) == (k["mode"], k["max_num_batched_tokens"])
        if k["window_ms"] is not None:
            assert cfg.window_s == pytest.approx(k["window_ms"] / 1e3, abs=1e-6)
    derived = chunked_window_s(h200, SimConfig(mode="temporal-chunked", slo=base.slo,
                                               max_num_batched_tokens=1024))
    for policy in ("fifo", "twsrft"):  # each order at each step of the derived window
        assert sorted(k["window_ms"] for k, _ in got if k["encoder_policy"] == policy
                      and k["mode"] == "temporal-chunked" and k["max_num_batched_tokens"] == 1024
                      ) == pytest.approx([round(1e3 * f * derived, 3) for f in WINDOW_STEPS])
    itl = candidates(h200, SimConfig(slo=Slo.parse("ttft:2000,itl:21")))
    assert len(itl) == len({str(k) for k, _ in itl})  # windows clamped to 1 ms: tried once
    assert all(k["window_ms"] is None or k["window_ms"] >= 1.0 for k, _ in itl)


def test_the_window_is_refined_around_the_best_pairs(h200) -> None:
    """The second stage tries REFINE_STEPS x the window of the two best chunked (budget, order)
    pairs of the grid at that rate - not of a worse pair, not a window already run."""
    base = SimConfig(slo=Slo.parse("ttft:2000,itl:21"))

    def row(good: float) -> dict:
        return {"goodput": {"rate_per_s": good}, "image": {"ttft": {"p99_ms": 900.0}}}

    def knobs(budget: int, policy: str, window_ms: float | None, mode="temporal-chunked"):
        return {"mode": mode, "max_num_batched_tokens": budget, "encoder_policy": policy,
                "window_ms": window_ms, "async_scheduling": True}

    rows = [(knobs(512, "fifo", None, "temporal"), row(19.0)),  # not chunked: not refined
            (knobs(512, "fifo", 6.8), row(15.0)), (knobs(512, "fifo", 3.4), row(16.0)),
            (knobs(512, "twsrft", 6.8), row(15.5)), (knobs(1024, "fifo", 2.0), row(12.0)),
            (knobs(512, "fifo", 4.76), row(1.0))]  # already run: 1.4 x 3.4
    got = refined(base, rows)
    want = [(512, "fifo", round(f * 3.4, 3)) for f in REFINE_STEPS if round(f * 3.4, 3) != 4.76]
    want += [(512, "twsrft", round(f * 6.8, 3)) for f in REFINE_STEPS]
    assert [(k["max_num_batched_tokens"], k["encoder_policy"], k["window_ms"])
            for k, _ in got] == want
    for k, cfg in got:
        assert cfg.mode == "temporal-chunked" and cfg.encoder_policy == k["encoder_policy"]
        assert cfg.window_s == pytest.approx(k["window_ms"] / 1e3)


def test_the_best_configurations_run_again_with_the_other_scheduling(h200) -> None:
    """The last stage runs the FLIPS best configurations (any stage) with the engine's other
    scheduling - unpipelined when the sweep pipelines, and back - once each."""
    base = SimConfig(slo=Slo.parse("ttft:2000,tpot:50"))
    tried = candidates(h200, base)
    configs = {repr(k): c for k, c in tried}
    goods = [10.0 + i for i in range(len(tried))]  # the last two are the best

    def row(good: float) -> dict:
        return {"goodput": {"rate_per_s": good}, "image": {"ttft": {"p99_ms": 900.0}}}

    rows = [(k, row(g)) for (k, _), g in zip(tried, goods, strict=True)]
    got = flipped(tried, rows)
    assert len(got) == FLIPS == 2
    for (k, cfg), (want, _) in zip(got, reversed(tried[-2:]), strict=True):
        assert k == {**want, "async_scheduling": False} and cfg.async_scheduling is False
        assert cfg == dataclasses.replace(configs[repr(want)], async_scheduling=False)
    done = rows + [(k, row(99.0)) for k, _ in got]  # flipped already run: not again
    assert flipped(tried + got, done) == []  # the best two flip back to what already ran


def test_best_temporal_in_the_sweep_names_its_knobs(tmp_path, capsys) -> None:
    rc = main(["--modes", "temporal,best-temporal", "--rates", "0,10", "--duration", "3",
               "--seeds", "0", "--no-plot", "--batch", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "best-temporal" in out and "img p99" in out and "budget" in out
    res = json.loads((tmp_path / "results.json").read_text())
    best, plain = res["sweep"]["best-temporal"], res["sweep"]["temporal"]
    for b, t in zip(best, plain, strict=True):
        assert b["knobs"]["mode"] in ("temporal", "temporal-chunked")
        grid = len(TUNE_BUDGETS) * (1 + 2 * len(WINDOW_STEPS))  # SLO A: no window clamped
        assert grid < len(b["tuned"]) <= grid + 2 * len(REFINE_STEPS) + FLIPS  # refined, flipped
        flips = [k for k in b["tuned"] if not k["async_scheduling"]]
        assert 0 < len(flips) <= FLIPS  # the best again, unpipelined
        assert "async_scheduling" in b["knobs"]
        assert len({json.dumps(k, sort_keys=True) for k in b["tuned"]}) == len(b["tuned"])
        assert b["goodput"]["rate_per_s"] == max(c["rate_per_s"] for c in b["tuned"])
        assert b["goodput"]["rate_per_s"] >= t["goodput"]["rate_per_s"]  # temporal is a candidate
        for row in (b, t):
            g = row["goodput"]
            assert "image_ttft_p99_ms" in g and 0 <= g["unfinished_share"] <= 1
    with pytest.raises(SystemExit, match="prefill_on='compute'"):
        main(["--modes", "temporal", "--prefill-on", "compute", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown"):
        main(["--modes", "best-spatial", "--out", str(tmp_path)])


def test_the_goodput_sweep_judges_against_best_temporal() -> None:
    from bench.sim.goodput_sweep import strongest

    def row(rate: float, good: float, att: float, p99: float, knobs=None) -> dict:
        out = {"rate": rate, "goodput": {"rate_per_s": good, "attainment": att,
                                         "image_ttft_p99_ms": p99}}
        return out | ({"knobs": knobs} if knobs else {})

    k = {"mode": "temporal-chunked", "max_num_batched_tokens": 512, "encoder_policy": "twsrft",
         "window_ms": 5.0}
    res = {"meta": {"slo": {"ttft": 2000.0, "tpot": 50.0}}, "sweep": {
        "best-temporal": [row(10, 10, 1.0, 900, k), row(20, 16, 0.8, 5000, k)],
        "spatial": [row(10, 10, 1.0, 1500), row(20, 15.9, 0.79, 3900)]}}
    (ok_good, text), (ok_tail, tail) = strongest("A", res)
    assert ok_good and "0.994x at 20" in text and "budget 512" in text
    assert ok_tail and "up to 24/s" in tail  # 1.2x the rate best-temporal fell below 90%
    res["sweep"]["spatial"][1]["goodput"] |= {"rate_per_s": 15.0, "image_ttft_p99_ms": 4100}
    (ok_good, _), (ok_tail, _) = strongest("A", res)
    assert not ok_good and not ok_tail


def test_spatial_rows_count_the_sis_actions(tmp_path) -> None:
    """Each spatial point of results.json says how often SIS took each action (splits, whole-GPU
    windows, prefill placements); the time-multiplexed modes run no SIS and carry none."""
    rc = main(["--modes", "spatial,temporal", "--rates", "0,12", "--duration", "3", "--seeds",
               "0", "--no-plot", "--batch", "8", "--sis-actions", "superset", "--out",
               str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    loaded = res["sweep"]["spatial"][1]["sis_actions"]
    assert any(k.startswith("split:") for k in loaded) and all(n > 0 for n in loaded.values())
    assert all("sis_actions" not in row for row in res["sweep"]["temporal"])
