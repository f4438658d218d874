"""Helpers shared by kernel tests, the kernel demo and the GPU harness."""

from __future__ import annotations

import torch

from spaceserve.kernels.budget import LaunchRecord

POISON = float("nan")

# Relative-error tolerances (||out - ref|| / ||ref||) per input dtype.
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so an unwritten element fails the comparison."""
    return torch.full_like(t, POISON)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; inf when `out` holds a NaN or inf."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64).to(o.device)
    if not torch.isfinite(o).all():
        return float("inf")
    denom = r.norm().item()
    diff = (o - r).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                 rtol: float | None = None) -> float:
    """Assert the relative error of `out` against an fp64 `ref` is within the dtype tolerance."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    tol = rtol if rtol is not None else RTOL[dtype or out.dtype]
    err = rel_error(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    return err


def assert_within_budget(records: list[LaunchRecord], num_sms: int | None = None) -> None:
    """Every recorded launch has grid product <= its budget (and <= `num_sms` when given)."""
    assert records, "no launch was recorded"
    for r in records:
        assert r.within_budget, f"{r.name}: grid {r.grid} exceeds num_sms={r.num_sms}"
        if num_sms is not None:
            assert r.num_sms <= num_sms, f"{r.name}: ran under {r.num_sms} SMs, budget {num_sms}"
            assert r.programs <= num_sms * r.programs_per_sm, f"{r.name}: grid {r.grid}"
