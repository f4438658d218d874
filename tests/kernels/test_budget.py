"""Unit tests of the SM-budget contract: device SMs, budget validation, launch recorder, configs."""

from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl

from spaceserve.kernels import budget as budget_mod
from spaceserve.kernels.budget import (
    CPU_NUM_SMS,
    NUM_SMS_ENV,
    LaunchRecord,
    device_num_sms,
    is_recording,
    record_launches,
    resolve_num_sms,
)
from spaceserve.kernels.configs import (
    budget_bucket,
    clear_kernel_configs,
    kernel_config,
    set_kernel_configs,
)
from spaceserve.kernels.persistent import launch_persistent, persistent_grid
from spaceserve.kernels.testing import assert_within_budget

CPU = torch.device("cpu")
# Kernels run where the tensors live: the interpreter on CPU, the GPU when there is one.
DEV = torch.device("cuda") if torch.cuda.is_available() else CPU


@triton.jit
def _mark_tiles(count_ptr, owner_ptr, num_tiles, BLOCK: tl.constexpr):
    """Each program adds 1 to every element of its tiles and writes its id as the tile's owner."""
    pid = tl.program_id(0)
    for tile in tl.range(pid, num_tiles, tl.num_programs(0)):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        tl.store(count_ptr + offs, tl.load(count_ptr + offs) + 1)
        tl.store(owner_ptr + tile, pid)


def _mark(num_tiles: int, num_sms: int, block: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    count = torch.zeros(num_tiles * block, dtype=torch.int32, device=DEV)
    owner = torch.full((num_tiles,), -1, dtype=torch.int32, device=DEV)
    launch_persistent(_mark_tiles, "mark_tiles", num_tiles, num_sms, (count, owner, num_tiles),
                      config={"BLOCK": block})
    return count, owner


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NUM_SMS_ENV, raising=False)


def test_cpu_device_counts_as_h200() -> None:
    assert device_num_sms(CPU) == CPU_NUM_SMS == 132
    assert device_num_sms("cpu") == 132
    assert resolve_num_sms(None, CPU) == 132
    if not torch.cuda.is_available():
        assert device_num_sms() == 132


def test_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NUM_SMS_ENV, "66")
    assert device_num_sms(CPU) == 66
    assert resolve_num_sms(None, CPU) == 66
    assert resolve_num_sms(66, CPU) == 66
    with pytest.raises(ValueError, match="num_sms"):
        resolve_num_sms(67, CPU)
    for bad in ("abc", "0", "-3"):
        monkeypatch.setenv(NUM_SMS_ENV, bad)
        with pytest.raises(ValueError, match=NUM_SMS_ENV):
            device_num_sms(CPU)


@pytest.mark.parametrize("bad", [0, -1, 133, 2.5, True, "8"])
def test_resolve_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="num_sms"):
        resolve_num_sms(bad, CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize("good", [1, 8, 66, 132])
def test_resolve_accepts(good: int) -> None:
    assert resolve_num_sms(good, CPU) == good


def test_persistent_grid() -> None:
    assert persistent_grid(10, 3) == (3,)
    assert persistent_grid(2, 8) == (2,)
    assert persistent_grid(0, 8) == (1,)
    assert persistent_grid(100, 8, programs_per_sm=2) == (16,)


@pytest.mark.parametrize("num_sms", [1, 3, 7, 132])
def test_every_tile_written_once(num_sms: int) -> None:
    num_tiles = 7
    with record_launches() as recs:
        count, owner = _mark(num_tiles, num_sms)
    assert torch.equal(count, torch.ones_like(count)), count
    programs = min(num_sms, num_tiles)
    # Tile t belongs to program t % grid: the loop strides by the grid, whatever the budget.
    expect = torch.arange(num_tiles, dtype=torch.int32, device=DEV) % programs
    assert torch.equal(owner, expect), owner
    assert len(recs) == 1
    rec = recs[0]
    assert rec.name == "mark_tiles" and rec.grid == (programs,) and rec.num_sms == num_sms
    assert rec.num_tiles == num_tiles and rec.config == {"BLOCK": 4}
    assert rec.programs == programs and rec.within_budget
    assert_within_budget(recs, num_sms)


def test_programs_per_sm_must_be_positive() -> None:
    with pytest.raises(ValueError, match="programs_per_sm"):
        launch_persistent(_mark_tiles, "mark_tiles", 4, 2, (), programs_per_sm=0)


def test_record_nesting() -> None:
    with record_launches() as outer:
        _mark(3, 2)
        with record_launches() as inner:
            _mark(5, 4)
        _mark(2, 1)
    assert [r.grid for r in outer] == [(2,), (4,), (1,)]
    assert [r.grid for r in inner] == [(4,)]


def test_records_launches_from_other_threads() -> None:
    with record_launches() as recs:
        t = threading.Thread(target=_mark, args=(4, 2))
        t.start()
        t.join()
    assert [r.grid for r in recs] == [(2,)]


def test_recording_off_outside_block() -> None:
    assert not is_recording()
    with record_launches() as recs:
        assert is_recording()
    _mark(3, 3)
    assert recs == [] and not is_recording() and budget_mod._recorders == []
    with pytest.raises(RuntimeError), record_launches():
        raise RuntimeError("boom")
    assert budget_mod._recorders == []


def test_budget_check_catches_excess() -> None:
    over = LaunchRecord("k", (9,), num_sms=8)
    assert over.programs == 9 and not over.within_budget
    with pytest.raises(AssertionError, match="exceeds"):
        assert_within_budget([over])
    with pytest.raises(AssertionError, match="no launch"):
        assert_within_budget([])
    ok = LaunchRecord("k", (16,), num_sms=8, programs_per_sm=2)
    assert ok.within_budget
    with pytest.raises(AssertionError):
        assert_within_budget([LaunchRecord("k", (8,), num_sms=8)], num_sms=4)


@pytest.fixture
def _tables():
    clear_kernel_configs()
    yield
    clear_kernel_configs()


def test_kernel_config_fallback(_tables: None) -> None:
    default = {"BLOCK_M": 64, "num_warps": 4}
    assert kernel_config("linear", 66, default) == default


def test_kernel_config_buckets(_tables: None) -> None:
    assert budget_bucket(5, [32, 8, 132]) == 8
    assert budget_bucket(8, [32, 8, 132]) == 8
    assert budget_bucket(9, [32, 8, 132]) == 32
    assert budget_bucket(200, [32, 8, 132]) == 132
    set_kernel_configs({"linear": {8: {"BLOCK_M": 16}, 32: {"BLOCK_M": 32, "num_warps": 8},
                                   132: {"BLOCK_M": 128}}})
    default = {"BLOCK_M": 64, "num_warps": 4}
    assert kernel_config("linear", 1, default) == {"BLOCK_M": 16, "num_warps": 4}
    assert kernel_config("linear", 20, default) == {"BLOCK_M": 32, "num_warps": 8}
    assert kernel_config("linear", 132, default) == {"BLOCK_M": 128, "num_warps": 4}
    assert kernel_config("norms", 20, default) == default
    assert default == {"BLOCK_M": 64, "num_warps": 4}
    clear_kernel_configs()
    assert kernel_config("linear", 20, default) == default
