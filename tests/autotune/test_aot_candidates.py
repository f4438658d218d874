"""Every GPU tuning candidate compiles for sm_90a and fits the H200's shared memory (the
interpreter cannot tell), under this Triton and, when CI names one, Triton 3.6. The compile
is the session's one sm_90 check (`sm90_check`, tests/conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest

from autotune.aot_candidates import BASES, compile_specs
from autotune.cases import GPU_CANDIDATES, STORE_CANDIDATES
from spaceserve.kernels.configs import HONOURED

T36_ENV = "SPACESERVE_TRITON36_PYTHON"


def test_candidates_only_set_honoured_keys():
    for kernel, cands in [*GPU_CANDIDATES.items(), ("store_kv", STORE_CANDIDATES)]:
        per_budget, whole = HONOURED[kernel]
        for cand in cands:
            assert set(cand) <= set(per_budget) | set(whole), (kernel, cand)
    specs = compile_specs()
    assert len(specs) == sum(len(GPU_CANDIDATES[k]) * len(b) for k, b in BASES.items())


@pytest.mark.parametrize("python", [
    pytest.param(sys.executable, id="current"),
    pytest.param(os.environ.get(T36_ENV), id="triton36", marks=pytest.mark.skipif(
        not os.environ.get(T36_ENV), reason=f"{T36_ENV} unset (CI sets it)")),
])
def test_candidates_compile_for_sm90(sm90_check, python):
    rows = sm90_check(python)["autotune.aot_candidates"]
    failed = [r for r in rows if not r["ok"]]
    assert len(rows) == len(compile_specs()) and not failed, failed
