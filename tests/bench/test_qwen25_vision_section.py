"""The Qwen2.5-VL vision benchmark's code paths at tiny shapes on CPU (the GPU harness runs it at
7B shapes)."""

import time

import torch

from bench.gpu.harness import SECTIONS
from bench.kernels.qwen25_vision import run, run_suite
from tests.models.test_qwen2_5_vl import tiny_config


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_suite_runs_and_checks_at_tiny_shapes():
    rows = run_suite(tiny_config(), torch.device("cpu"), torch.float32,
                     images={"84x140": (84, 140)}, budgets=(None, 4), timer=_once,
                     time_budget_s=120)
    assert not [r for r in rows if "error" in r or "skipped" in r]
    timed = [r for r in rows if "ms" in r]
    assert {(r["impl"], r["num_sms"]) for r in timed} == {
        ("spaceserve", None), ("spaceserve", 4), ("transformers-sdpa", None),
        ("spaceserve-torch-ops", None)}
    checked = [r for r in timed if "rel_err_vs_torch_ops" in r]
    assert len(checked) == 3 and max(r["rel_err_vs_torch_ops"] for r in checked) < 1e-4
    assert timed[0]["patches"] == 60 and timed[0]["windows"] == 6  # 3x5 tokens, 2x2 windows
    assert len([r for r in rows if "headline" in r]) == 1


def test_time_budget_skips_instead_of_running():
    rows = run_suite(tiny_config(), torch.device("cpu"), torch.float32,
                     images={"56x56": (56, 56)}, budgets=(None,), timer=_once,
                     time_budget_s=0.0, hf=False)
    assert [r for r in rows if "skipped" in r] and not [r for r in rows if "ms" in r]


def test_gpu_entry_point_and_registration():
    if not torch.cuda.is_available():
        assert run("/tmp", 1.0)[0]["skipped"] == "needs a CUDA device"
    section = SECTIONS["qwen25-vision"]
    assert section.target == "bench.kernels.qwen25_vision:run" and section.budget_s > 0
