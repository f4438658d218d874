"""Every GPU tuning candidate compiles for sm_90a and fits the H200's shared memory (the
interpreter cannot tell), under this Triton and, when CI names one, Triton 3.6. Spill counts
are not checked, so ptxas is not re-run for them (`--no-spills`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.aot_candidates import BASES, compile_specs
from autotune.cases import GPU_CANDIDATES, STORE_CANDIDATES
from spaceserve.kernels.configs import HONOURED

ROOT = Path(__file__).resolve().parents[2]
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
def test_candidates_compile_for_sm90(tmp_path, python):
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([python, "-m", "spaceserve.kernels.aot", "--module",
                           "autotune.aot_candidates", "--jobs", "2", "--no-spills", "--json",
                           str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["results"] if out.exists() else []
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and rows and not failed, proc.stdout[-3000:] + proc.stderr[-2000:]
