"""Kernel test fixtures."""

import pytest
import torch

from spaceserve.kernels.testing import poisoned_like


@pytest.fixture
def poisoned_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float buffer torch.empty hands out (outputs, intermediates, workspaces) starts as
    NaN, so a launcher that leaves any of it unwritten fails its comparison."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return poisoned_like(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
