"""The autotune GPU section's code paths at tiny shapes on CPU (the harness runs it at 7B)."""

from __future__ import annotations

import json

import torch

from autotune.cases import TuneShapes
from autotune.profile import Grid
from autotune.timers import WallTimer
from autotune.workload import tiny_config
from bench.kernels.autotune import run, run_suite
from spaceserve.kernels.configs import clear_kernel_configs, load_kernel_configs
from spaceserve.runtime.policy.curves import CurveSet


def test_suite_at_tiny_shapes(tmp_path):
    grid = Grid(sms=(8, 132), patches=(16, 64), prefill_tokens=(8,), prefill_context=(0,),
                decode_batch=(1, 2), decode_context=(8,))
    rows = run_suite(tiny_config(), "tiny", torch.device("cpu"), torch.float32, tmp_path, 300.0,
                     grid=grid, timer=WallTimer(target_s=0.0), shapes=TuneShapes.tiny(),
                     budgets=(4,), kernels=("linear", "vit_attention"))
    assert not [r for r in rows if "error" in r]
    prof = next(r for r in rows if r["stage"] == "profile")
    assert prof["complete"] and prof["points"] == prof["of"] == 2 * 5 * 2
    CurveSet.load(tmp_path / "curves.json")
    assert (tmp_path / "curves.png").exists()
    errs = json.loads((tmp_path / "analytic_error.json").read_text())
    assert errs["preset"] == "H200" and len(errs["points"]) == prof["points"]
    summary = [r for r in rows if r["stage"] == "analytic-error" and "mode" in r]
    assert {(r["curve"], r["mode"]) for r in summary} == {(c, m) for m in ("isolated", "corun")
                                                         for c in ("encoder", "prefill", "decode")}
    assert sum(r["points"] for r in summary) == prof["points"]
    assert all(r["max_abs_err"] >= r["median_abs_err"] > 0 for r in summary)
    tuned = [r for r in rows if r["stage"] == "tune" and "budget" in r]
    assert {(r["kernel"], r["budget"]) for r in tuned} == {(k, b) for k in ("linear",
                                                                            "vit_attention")
                                                          for b in (4, 132)}
    assert all(r["identity"] == "ok" and r["tuned_ms"] > 0 for r in tuned)
    table = load_kernel_configs(tmp_path / "kernel_configs.json")
    clear_kernel_configs()
    assert set(table) == {"linear", "vit_attention"} and set(table["vit_attention"]) == {132}
    heads = [r["headline"] for r in rows if "headline" in r]
    assert len(heads) == 4 and heads[0].startswith("profile tiny: 20/20 points")


def test_gpu_entry_point():
    if not torch.cuda.is_available():
        assert run("/tmp", 1.0) == [{"section": "autotune", "skipped": "needs a CUDA device"}]
