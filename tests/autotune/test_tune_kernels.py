"""The kernel tuner on CPU: interpreter launches at tiny shapes with an injected bench, the
honoured-keys-only search, rejection of wrong or failing candidates, and the bitwise identity
check across budgets (with the fallback to the whole-device config)."""

from __future__ import annotations

import pytest
import torch

from autotune.cases import Case, TuneShapes
from autotune.tune_kernels import Tuner, main, result_rows
from spaceserve.kernels import record_launches
from spaceserve.kernels.configs import (
    HONOURED,
    clear_kernel_configs,
    kernel_config,
    kernel_configs,
    load_kernel_configs,
)
from spaceserve.kernels.testing import assert_within_budget

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean():
    clear_kernel_configs()
    yield
    clear_kernel_configs()


def block_cost(name: str, key: str):
    """A bench preferring small `key` in the launches named `name` (recorded configs)."""

    def bench(fn) -> float:
        with record_launches() as rec:
            fn()
        assert_within_budget(rec)
        return float(sum(r.config[key] for r in rec if r.name == name))

    return bench


def test_linear_picks_the_faster_config_per_bucket(tmp_path):
    tuner = Tuner(CPU, torch.float32, TuneShapes.tiny(), [4], bench=block_cost("linear",
                                                                                  "BLOCK_N"),
                  log=lambda m: None)
    res = tuner.tune_kernel("linear")
    want = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    # Tile shape and warps are tuned once, at the whole device; smaller buckets tune only the
    # per-budget keys (tile order, stages) on top of them.
    assert tuner.buckets == [4, 132] and res.entry[132] == want
    assert set(res.entry[4]) <= set(HONOURED["linear"][0])
    assert res.identity == "ok" and not [t for t in res.trials if "rejected" in t]
    assert all(set(t["config"]) <= set(HONOURED["linear"][0]) for t in res.trials
               if t["bucket"] == 4)
    assert res.tuned_ms[132] < res.default_ms[132]
    rows = result_rows([res])
    assert [r["budget"] for r in rows] == [4, 132] and rows[1]["speedup"] == 2.0
    path = tuner.save(tmp_path / "k.json")
    assert kernel_configs() == {}  # tuning never leaves a table installed
    assert load_kernel_configs(path) == {"linear": res.entry}


def test_whole_device_keys_are_tuned_once():
    """paged_decode: BLOCK_N and warps at the whole device only, stages per bucket."""
    tuner = Tuner(CPU, torch.float32, TuneShapes.tiny(), [4],
                  bench=block_cost("paged_decode", "BLOCK_N"), log=lambda m: None)
    res = tuner.tune_kernel("paged_decode")
    assert res.entry[132]["BLOCK_N"] == 16 and set(res.entry[4]) <= {"num_stages"}
    small = [t for t in res.trials if t["bucket"] == 4]
    assert small and all(set(t["config"]) <= {"num_stages"} for t in small)
    assert res.identity == "ok"


def _synthetic(state: dict):
    """A fake "linear" case whose output shows the GROUP_M it ran with: GROUP_M=8 is wrong,
    GROUP_M=128 fails, anything else passes but differs bitwise between configs."""

    def make(shapes, device, dtype) -> Case:
        def run(n: int) -> torch.Tensor:
            state["n"] = n
            bm = kernel_config("linear", n, {"GROUP_M": 64})["GROUP_M"]
            if bm == 128:
                raise RuntimeError("out of resources")
            return torch.full((4,), 1.0 + bm * 1e-7 + (0.1 if bm == 8 else 0.0))

        return Case("synthetic", torch.float32, run, lambda: torch.ones(4, dtype=torch.float64))

    return make


def test_identity_check_reverts_buckets_that_change_results():
    state: dict = {}

    def bench(fn) -> float:  # prefers GROUP_M 16 at small budgets, 32 at the whole device
        bm = round((float(fn()[0]) - 1.0) / 1e-7)
        return 1.0 + abs(bm - (16 if state["n"] <= 4 else 32))

    cands = [{"GROUP_M": 16, "BLOCK_K": 32, "UNKNOWN": 1}, {"GROUP_M": 32}, {"GROUP_M": 8},
             {"GROUP_M": 128}]
    tuner = Tuner(CPU, torch.float32, TuneShapes.tiny(), [4], bench=bench,
                  cases={"linear": _synthetic(state)}, candidates_fn=lambda *a: cands,
                  log=lambda m: None)
    res = tuner.tune_kernel("linear")
    assert res.identity == "reverted buckets [4]"
    assert res.entry == {4: {"GROUP_M": 32}, 132: {"GROUP_M": 32}}
    tried = [t["config"] for t in res.trials]
    assert {"GROUP_M": 16} in tried and not [c for c in tried if set(c) - {"GROUP_M"}]
    why = {t["config"].get("GROUP_M"): t.get("rejected") for t in res.trials}
    assert "relative error" in why[8] and "out of resources" in why[128]
    assert why[16] is None and why[32] is None


def test_time_budget_and_bad_arguments():
    tuner = Tuner(CPU, torch.float32, TuneShapes.tiny(), [4], time_budget_s=0.0,
                  log=lambda m: None)
    res = tuner.tune_kernel("linear")
    assert res.skipped and result_rows([res]) == [{"kernel": "linear", "skipped": res.skipped}]
    with pytest.raises(ValueError, match="budgets"):
        Tuner(CPU, torch.float32, TuneShapes.tiny(), [0])
    with pytest.raises(ValueError, match="no tuning case for 'nope'"):
        Tuner(CPU, torch.float32, TuneShapes.tiny(), [4]).tune_kernel("nope")
    assert Tuner(CPU, torch.float32, TuneShapes.tiny(), [500, 8]).buckets == [8, 132]


def test_cli_writes_a_loadable_table(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    assert main(["--out", str(out), "--kernels", "rms_norm", "--budgets", "4"]) == 0
    assert "wrote" in capsys.readouterr().out
    table = load_kernel_configs(out)
    assert set(table) == {"rms_norm"} and set(table["rms_norm"]) == {4, 132}
    assert set(table["rms_norm"][4]) <= {"num_stages"}


def test_every_case_matches_its_reference_at_tiny_shapes():
    """Each kernel's case runs through the interpreter within its dtype's tolerance for the
    default and the CPU candidates, and the tuned table keeps results budget-independent."""
    from autotune.cases import CASES

    names = [n for n in CASES if n not in ("linear", "paged_decode", "rms_norm")]
    tuner = Tuner(CPU, torch.float32, TuneShapes.tiny(), [4], log=lambda m: None)
    for res in tuner.tune(names):
        assert res.trials and not [t for t in res.trials if "rejected" in t], res.name
        assert res.identity == "ok" and set(res.tuned_ms) == {4, 132}, res.name
    assert set(tuner.table) == set(names)
