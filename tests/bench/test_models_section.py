"""The models benchmark's code paths at tiny shapes on CPU (the GPU harness runs it at 7B)."""

import time

import torch

from bench.kernels.models import image_grid, qwen2_vl_7b_config, run, run_suite
from tests.models.conftest import tiny_config


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_suite_runs_and_checks_at_tiny_shapes():
    rows = run_suite(tiny_config("small"), torch.device("cpu"), torch.float32,
                     images={"56x84": (56, 84)}, batches=(1, 3), context=20,
                     budgets=(None, 4), backend="torch", timer=_once, time_budget_s=120)
    assert not [r for r in rows if "error" in r or "skipped" in r]
    timed = [r for r in rows if "ms" in r]
    impls = {(r["stage"], r["impl"]) for r in timed}
    assert impls == {(s, i) for s in ("vision", "decode")
                     for i in ("spaceserve", "spaceserve-torch-ops", "transformers-sdpa")}
    checked = [r for r in timed if "rel_err_vs_torch_ops" in r]
    assert len(checked) == 3 * 3  # spaceserve at two budgets + transformers, per workload
    assert max(r["rel_err_vs_torch_ops"] for r in checked) < 1e-4
    assert len([r for r in rows if "headline" in r]) == 3


def test_time_budget_skips_instead_of_running():
    rows = run_suite(tiny_config("small"), torch.device("cpu"), torch.float32,
                     images={"56x56": (56, 56)}, batches=(1,), context=8, budgets=(None,),
                     backend="torch", timer=_once, time_budget_s=0.0, hf=False)
    assert [r for r in rows if "skipped" in r] and not [r for r in rows if "ms" in r]


def test_gpu_entry_point_and_shapes():
    if not torch.cuda.is_available():
        assert run("/tmp", 1.0)[0]["skipped"] == "needs a CUDA device"
    cfg = qwen2_vl_7b_config()
    # docs/design.md: 448^2 -> 256 LLM tokens, 1024^2 -> 1369, 1920x1080 -> 2691
    assert [image_grid(h, w, cfg) for h, w in ((448, 448), (1024, 1024), (1080, 1920))] == \
        [[1, 32, 32], [1, 74, 74], [1, 78, 138]]
