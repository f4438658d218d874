"""Kernel config files: round trip, validation with one logged line, the env var, and
launchers picking their budget bucket's config (through the launch recorder)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.configs import (
    ENV,
    FORMAT,
    check_config,
    kernel_config,
    kernel_configs,
    load_kernel_configs,
    reset_kernel_configs,
    save_kernel_configs,
    set_kernel_configs,
    using_kernel_configs,
)
from spaceserve.kernels.testing import assert_close, assert_within_budget

TABLE = {
    "linear": {4: {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2},
               132: {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 4, "num_warps": 8}},
    "paged_decode": {32: {"num_stages": 2}, 132: {"BLOCK_N": 64, "num_warps": 4}},
}
LOGGER = "spaceserve.kernels"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    reset_kernel_configs()
    yield
    monkeypatch.delenv(ENV, raising=False)
    reset_kernel_configs()
    set_kernel_configs({})


def _write(path, kernels, **extra):
    path.write_text(json.dumps({"format": FORMAT, **extra, "kernels": kernels}))
    return path


def _records(caplog):
    return [r for r in caplog.records if r.name == LOGGER]


def test_round_trip(tmp_path, caplog):
    path = save_kernel_configs(tmp_path / "k.json", TABLE, {"device": {"name": "x"}})
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["device"] == {"name": "x"}
    assert list(doc["kernels"]["linear"]) == ["4", "132"]  # numeric order, string keys
    with caplog.at_level(logging.WARNING, LOGGER):
        assert load_kernel_configs(path) == TABLE
    assert kernel_configs() == TABLE and not _records(caplog)
    again = save_kernel_configs(tmp_path / "k2.json", kernel_configs(), {"device": {"name": "x"}})
    assert again.read_bytes() == path.read_bytes()
    default = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4}
    assert kernel_config("linear", 3, default) == {**default, **TABLE["linear"][4]}
    assert kernel_config("linear", 5, default) == {**default, **TABLE["linear"][132]}


@pytest.mark.parametrize("bad, why", [
    ({"BLOCK_K": 32}, "BLOCK_K"),  # sets the reduction order: never read per budget
    ({"BLOCK_N": 48}, "power of two"),
    ({"num_warps": 3}, "num_warps"),
    ({"num_stages": 0}, "positive"),
    ({"BLOCK_M": True}, "positive integer"),
    ([16, 16], "object"),
])
def test_malformed_entry_falls_back_with_one_line(tmp_path, caplog, bad, why):
    path = _write(tmp_path / "k.json", {"linear": {"4": bad, "132": {"BLOCK_M": 32}},
                                        "paged_decode": {"132": {"BLOCK_N": 64}}})
    with caplog.at_level(logging.WARNING, LOGGER):
        table = load_kernel_configs(path)
    recs = _records(caplog)
    assert len(recs) == 1
    msg = recs[0].getMessage()
    assert "'linear'" in msg and "bucket 4" in msg and why in msg and str(path) in msg
    default = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}
    assert kernel_config("linear", 2, default) == default  # that bucket: the defaults
    assert kernel_config("linear", 100, default)["BLOCK_M"] == 32  # the rest still loads
    assert table["paged_decode"] == {132: {"BLOCK_N": 64}}


def test_missing_entry_logs_once(tmp_path, caplog):
    path = _write(tmp_path / "k.json", {"linear": {"132": {"BLOCK_M": 32}}})
    load_kernel_configs(path)
    default = {"BLOCK_M": 1, "num_warps": 4}
    with caplog.at_level(logging.WARNING, LOGGER):
        for n in (1, 66, 132):
            assert kernel_config("rms_norm", n, default) == default
        assert kernel_config("linear", 8, default)["BLOCK_M"] == 32
    recs = _records(caplog)
    assert len(recs) == 1 and "'rms_norm'" in recs[0].getMessage()


@pytest.mark.parametrize("content, why", [
    (None, "cannot be read"),
    ("{not json", "cannot be read"),
    (json.dumps({"format": "other", "kernels": {}}), "expected format"),
    (json.dumps({"format": FORMAT, "kernels": [1]}), "'kernels' must be an object"),
    (json.dumps({"format": FORMAT, "kernels": {"linear": {}}}), "'linear'"),
    (json.dumps({"format": FORMAT, "kernels": {"linear": {"x8": {}}}}), "bucket 'x8'"),
])
def test_bad_files_fall_back_with_one_line(tmp_path, caplog, content, why):
    path = tmp_path / "k.json"
    if content is not None:
        path.write_text(content)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert load_kernel_configs(path) == {}
    recs = _records(caplog)
    assert len(recs) == 1 and why in recs[0].getMessage() and str(path) in recs[0].getMessage()
    assert kernel_config("linear", 8, {"BLOCK_M": 64}) == {"BLOCK_M": 64}


def test_env_var_read_once_at_first_lookup(tmp_path, monkeypatch):
    path = save_kernel_configs(tmp_path / "k.json", TABLE)
    monkeypatch.setenv(ENV, str(path))
    reset_kernel_configs()
    assert kernel_configs() == {}  # nothing read before the first lookup
    assert kernel_config("paged_decode", 16, {"num_stages": 3})["num_stages"] == 2
    save_kernel_configs(path, {"paged_decode": {132: {"num_stages": 4}}})
    assert kernel_config("paged_decode", 16, {"num_stages": 3})["num_stages"] == 2  # once
    set_kernel_configs({})  # an explicit table wins over the variable
    assert kernel_config("paged_decode", 16, {"num_stages": 3})["num_stages"] == 3


def test_save_validates_and_context_restores(tmp_path):
    with pytest.raises(ValueError, match="'linear' bucket 8.*BLOCK_K"):
        save_kernel_configs(tmp_path / "k.json", {"linear": {8: {"BLOCK_K": 64}}})
    with pytest.raises(ValueError, match="bucket 0"):
        save_kernel_configs(tmp_path / "k.json", {"linear": {0: {}}})
    assert check_config("some_new_kernel", {"BLOCK_Q": 16}) is None
    set_kernel_configs(TABLE)
    with using_kernel_configs({"linear": {8: {"BLOCK_M": 16}}}):
        assert kernel_configs() == {"linear": {8: {"BLOCK_M": 16}}}
    assert kernel_configs() == TABLE


def test_linear_uses_its_budget_bucket(tmp_path):
    from spaceserve.kernels.linear import CPU_CONFIGS, linear, ref_linear

    load_kernel_configs(save_kernel_configs(tmp_path / "k.json", TABLE))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 24, generator=gen), torch.randn(40, 24, generator=gen)
    ref = ref_linear(x.double(), w.double())
    outs = {}
    whole = TABLE["linear"][132]
    for budget, bucket in ((3, 4), (20, 132)):
        with record_launches() as rec:
            outs[budget] = linear(x, w, num_sms=budget)
        assert_within_budget(rec, budget)
        cfg = rec[0].config
        assert cfg["GROUP_M"] == TABLE["linear"][bucket]["GROUP_M"]  # tile order: per budget
        for key in ("BLOCK_M", "BLOCK_N", "num_warps"):  # instructions: whole device only
            assert cfg[key] == whole[key], (budget, key)
        assert cfg["BLOCK_K"] == CPU_CONFIGS["large"]["BLOCK_K"]  # never from the table
        assert_close(outs[budget], ref)
    assert torch.equal(outs[3], outs[20])


def test_whole_device_keys_keep_results_identical(tmp_path):
    """Norms read tile rows and warps at the whole-device bucket only; stages per budget."""
    from spaceserve.kernels.norms import ref_rms_norm, rms_norm

    table = {"rms_norm": {4: {"num_stages": 2}, 132: {"BLOCK_M": 2, "num_warps": 8}}}
    load_kernel_configs(save_kernel_configs(tmp_path / "k.json", table))
    gen = torch.Generator().manual_seed(1)
    x, wt = torch.randn(9, 40, generator=gen), torch.randn(40, generator=gen)
    outs = []
    for budget, stages in ((3, 2), (66, 1)):
        with record_launches() as rec:
            out = rms_norm(x, wt, 1e-6, num_sms=budget)
        assert_within_budget(rec, budget)
        assert (rec[0].config["BLOCK_M"], rec[0].config["num_warps"]) == (2, 8)
        assert rec[0].config["num_stages"] == stages
        outs.append(out)
    assert_close(outs[0], ref_rms_norm(x.double(), wt.double(), 1e-6).float())
    assert torch.equal(outs[0], outs[1])
