"""best-temporal: the strongest time-multiplexed configuration, tuned per rate and named in
results.json; the SLO-derived chunked window; the tail reported beside goodput."""

from __future__ import annotations

import json

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cli import main
from spaceserve.runtime.sim.config import SimConfig, chunked_window_s
from spaceserve.runtime.sim.engine import Simulator
from spaceserve.runtime.sim.sweep.tune import TUNE_BUDGETS, candidates


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


def test_best_temporal_in_the_sweep_names_its_knobs(tmp_path, capsys) -> None:
    rc = main(["--modes", "temporal,best-temporal", "--rates", "0,10", "--duration", "3",
               "--seeds", "0", "--no-plot", "--batch", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "best-temporal" in out and "img p99" in out and "budget" in out
    res = json.loads((tmp_path / "results.json").read_text())
    best, plain = res["sweep"]["best-temporal"], res["sweep"]["temporal"]
    for b, t in zip(best, plain, strict=True):
        assert b["knobs"]["mode"] in ("temporal", "temporal-chunked")
        assert len(b["tuned"]) == 4 * len(TUNE_BUDGETS)
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
