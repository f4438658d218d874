"""Ahead-of-time sm_90a compile of every kernel configuration, under each Triton version.

The check runs `python -m spaceserve.kernels.aot` in a subprocess without TRITON_INTERPRET (it
needs real @triton.jit functions): for the package's kernels, the session's one run over every
module with compile specs (`sm90_check`, tests/conftest.py). It runs for the current
interpreter, and for Triton 3.6 (the GPU image's version) when SPACESERVE_TRITON36_PYTHON names
a python whose triton is 3.6 (.ci/run sets it). A fixture module of deliberately bad specs,
checked in a run of its own, proves the checker fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spaceserve.kernels.aot import compile_sm90, kernel_module_names
from spaceserve.kernels.persistent import CompileSpec

ROOT = Path(__file__).resolve().parents[2]
T36_ENV = "SPACESERVE_TRITON36_PYTHON"

BAD_SPECS = textwrap.dedent('''
    import triton
    import triton.language as tl
    from spaceserve.kernels.persistent import CompileSpec


    @triton.jit
    def _mm(a_ptr, b_ptr, c_ptr, N, K, num_tiles,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        num_n = tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            rm = (tile // num_n) * BM + tl.arange(0, BM)
            rn = (tile % num_n) * BN + tl.arange(0, BN)
            rk = tl.arange(0, BK)
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(0, K, BK):
                a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
                b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
                acc = tl.dot(a, b, acc)
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


    SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "N": "i32", "K": "i32:16",
           "num_tiles": "i32"}
    NO_TILES = {k: v for k, v in SIG.items() if k != "num_tiles"}


    def compile_specs():
        return [
            CompileSpec("good", _mm, SIG, {"BM": 64, "BN": 64, "BK": 32}, 4, 3, True),
            CompileSpec("dot_k8", _mm, SIG, {"BM": 64, "BN": 64, "BK": 8}, 4, 3, False),
            CompileSpec("huge_smem", _mm, SIG, {"BM": 256, "BN": 256, "BK": 128}, 8, 4, False),
            CompileSpec("no_wgmma", _mm, SIG, {"BM": 16, "BN": 16, "BK": 16}, 1, 1, True),
            CompileSpec("missing_arg", _mm, NO_TILES, {"BM": 64, "BN": 64, "BK": 32}, 4, 3),
        ]
''')


def _pythons() -> list:
    t36 = os.environ.get(T36_ENV)
    return [
        pytest.param(sys.executable, id="current"),
        pytest.param(t36, id="triton36", marks=pytest.mark.skipif(
            not t36, reason=f"{T36_ENV} unset: no Triton 3.6 python to check with (CI sets it)")),
    ]


def _run_aot(python: str, args: list[str], tmp_path: Path) -> tuple[int, str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "aot.json"
    proc = subprocess.run([python, "-m", "spaceserve.kernels.aot", "--json", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, text, data


def _triton_version(python: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([python, "-c", "import triton; print(triton.__version__)"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("python", _pythons())
def test_checker_fails_bad_specs(python: str, tmp_path: Path) -> None:
    if python != sys.executable:
        assert _triton_version(python).startswith("3.6"), f"{T36_ENV} must have triton 3.6"
    mod = tmp_path / "bad_specs.py"
    mod.write_text(BAD_SPECS)
    rc, text, data = _run_aot(python, ["--module", str(mod), "--jobs", "2"], tmp_path)
    assert rc == 1, text
    by_name = {r["name"]: r for r in data["results"]}
    assert set(by_name) == {"good", "dot_k8", "huge_smem", "no_wgmma", "missing_arg"}, text
    good = by_name["good"]
    assert good["ok"] and good["has_wgmma"] and 0 < good["shared_bytes"] <= 232448, text
    assert not by_name["dot_k8"]["ok"] and "K >= 16" in by_name["dot_k8"]["error"]
    assert not by_name["huge_smem"]["ok"] and "shared memory" in by_name["huge_smem"]["error"]
    assert by_name["huge_smem"]["shared_bytes"] > 232448
    assert not by_name["no_wgmma"]["ok"] and "wgmma" in by_name["no_wgmma"]["error"]
    assert not by_name["missing_arg"]["ok"] and "'num_tiles'" in by_name["missing_arg"]["error"]
    assert "1 ok, 4 failing" in text


@pytest.mark.parametrize("python", _pythons())
def test_kernel_package_compiles_for_sm90(python: str, sm90_check) -> None:
    """Every kernel module's specs (the session's one sm_90 check, tests/conftest.py)."""
    by_module = sm90_check(python)
    rows = [r for m in kernel_module_names() for r in by_module[m]]
    if not rows:
        pytest.skip("no kernel module of spaceserve.kernels defines compile_specs() yet")
    failed = [(r["name"], r["error"]) for r in rows if not r["ok"]]
    assert not failed, f"sm_90 compile failures {failed}"


def test_interpreted_kernel_is_refused() -> None:
    """Under TRITON_INTERPRET the function is not compilable; the result says why."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))

    res = compile_sm90(CompileSpec("k", _k, {"x_ptr": "*fp32"}, {"BLOCK": 16}))
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not res.ok and "TRITON_INTERPRET" in res.error
    else:
        assert res.ok, res.error
