"""The harness's verdict section on CPU: it takes the autotune section's measured curves file,
copies it up, states the hardware facts and the simulator's spatial vs best-temporal on it, and
says plainly when no measured curves exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import verdict
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.contention import Contention


def test_without_measured_curves_it_states_nothing(tmp_path: Path) -> None:
    [row] = verdict.run(tmp_path, 10.0)
    assert row["skipped"] == "no measured curves" and "autotune" in row["headline"]
    assert not (tmp_path / "measured_curves.json").exists()


def test_it_judges_on_the_measured_curves(tmp_path: Path, monkeypatch) -> None:
    curves = analytic_curves(device="H200").with_contention(Contention.flat(0.2))
    (tmp_path / "autotune").mkdir()
    curves.save(tmp_path / "autotune" / "curves.json")
    monkeypatch.setattr(verdict, "DURATION_S", 1.0)
    facts, *slos = verdict.judge(tmp_path / "autotune" / "curves.json", tmp_path, 1.0)
    assert (tmp_path / "measured_curves.json").read_text() == \
        (tmp_path / "autotune" / "curves.json").read_text()
    assert facts["slowdown_encoder"] == facts["slowdown_decoder"] == 0.2  # read off the file
    assert 8 <= facts["decode_sms_for_90pct"] < curves.num_sms
    assert 0.5 < facts["encoder_scaling_exponent"] <= 1.05
    assert [r["slo"] for r in slos] == ["A", "B"]
    for r in slos:
        assert r["ratio"] == pytest.approx(r["spatial_goodput"] / r["best_temporal_goodput"])
        assert r["best_temporal_knobs"]["mode"] in ("temporal", "temporal-chunked")
        assert f"{r['ratio']:.3f}x" in r["headline"]
    saved = json.loads((tmp_path / "verdict" / "verdict.json").read_text())
    assert [r.get("slo") for r in saved] == [None, "A", "B"]
