"""The sensitivity sweep's quick mode: every cell of its grid, ratios against best-temporal,
the JSON and the heat map; the knobs it varies reach the curves."""

from __future__ import annotations

import json

import pytest

from bench.sim.sensitivity import QUICK, curves_for, main


def test_the_facts_reach_the_curves() -> None:
    base = curves_for(0.0, 66, 1.0)
    assert curves_for(0.2, 66, 1.0).slowdown("encoder", 64, 68) == pytest.approx(0.2)
    # decode saturating HBM at 99 SMs instead of 66: slower on a 66-SM partition
    assert curves_for(0.0, 99, 1.0).decode(32, 1152, 66) > 1.2 * base.decode(32, 1152, 66)
    assert curves_for(0.0, 99, 1.0).decode(32, 1152, 132) == pytest.approx(
        base.decode(32, 1152, 132), rel=0.05)  # the whole GPU still reaches HBM
    # a sublinear encoder loses less on a partition, nothing on the whole GPU
    sub = curves_for(0.0, 66, 0.7)
    assert sub.encoder(4096, 1, 132) == pytest.approx(base.encoder(4096, 1, 132))
    assert sub.encoder(4096, 1, 64) < 0.85 * base.encoder(4096, 1, 64)


def test_quick_mode_writes_every_cell_and_the_map(tmp_path, capsys) -> None:
    assert main(["--quick", "--duration", "1.5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "sensitivity.json").read_text())
    cells = res["cells"]
    assert len(cells) == len(QUICK["contention"]) * len(QUICK["decoder_sms"]) * \
        len(QUICK["alpha"])
    for c in cells:
        assert c["share_x"] == pytest.approx(c["share"] / c["best-temporal"])
        assert c["best_knobs"]["mode"] in ("temporal", "temporal-chunked")
        assert c["superset_x"] == pytest.approx(c["superset"] / c["best-temporal"])
    assert (tmp_path / "sensitivity.png").stat().st_size > 0 and "heat map" in out


def test_admission_reaches_both_sides(tmp_path, monkeypatch) -> None:
    """``--admission slo`` runs every mode of every cell under SLO-aware admission."""
    import bench.sim.sensitivity as sens

    seen = []
    real = sens.run_sweep

    def spy(curves, modes, rates, workload, cfg, **kw):
        seen.append(cfg.admission)
        return real(curves, modes, rates, workload, cfg, **kw)

    monkeypatch.setattr(sens, "run_sweep", spy)
    grid = dict(QUICK, contention=(0.0,), alpha=(1.0,), factors=(1.0,))
    monkeypatch.setattr(sens, "QUICK", grid)
    out = tmp_path / "slo"
    assert main(["--quick", "--duration", "1.0", "--admission", "slo", "--no-plot",
                 "--out", str(out)]) == 0
    assert seen == ["slo"] * 3  # pure sharing, the superset, best-temporal
    assert json.loads((out / "sensitivity.json").read_text())["meta"]["admission"] == "slo"
