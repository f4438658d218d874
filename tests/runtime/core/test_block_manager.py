"""Paged KV block manager and memory plan."""

import pytest
import torch

from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.memory import (
    CPU_DEFAULT_BLOCKS,
    kv_block_bytes,
    max_sequence_len,
    plan_kv_cache,
)


def test_allocate_free_roundtrip() -> None:
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a) | set(b)) == 8 and bm.num_free == 0
    with pytest.raises(RuntimeError, match="1 KV blocks requested, 0 free"):
        bm.allocate(1)
    bm.free(a)
    assert a == [] and bm.num_free == 3
    bm.free(b)
    bm.check_all_free()


def test_ensure_grows_or_allocates_nothing() -> None:
    bm = BlockManager(4, 4)
    blocks: list[int] = []
    assert bm.ensure(blocks, 1) and len(blocks) == 1
    assert bm.ensure(blocks, 4) and len(blocks) == 1  # same block still has room
    assert bm.ensure(blocks, 5) and len(blocks) == 2
    other: list[int] = []
    assert not bm.ensure(other, 9)  # needs 3, only 2 free
    assert other == [] and bm.num_free == 2
    assert bm.ensure(other, 8) and bm.num_free == 0
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(8) == 2


def test_double_free_and_foreign_ids_raise() -> None:
    bm = BlockManager(4, 2)
    blocks = bm.allocate(2)
    copy = list(blocks)
    bm.free(blocks)
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        bm.free(copy)
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        bm.free([7])
    bm.check_all_free()


def test_leak_is_detected() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(1)
    with pytest.raises(AssertionError, match="1 KV blocks still held"):
        bm.check_all_free()


def test_freed_blocks_are_reused_and_never_shared() -> None:
    bm = BlockManager(16, 2)
    held: list[list[int]] = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        if held and (bm.num_free == 0 or torch.rand((), generator=gen) < 0.5):
            bm.free(held.pop(int(torch.randint(len(held), (), generator=gen))))
        else:
            n = int(torch.randint(1, bm.num_free + 1, (), generator=gen))
            held.append(bm.allocate(n))
        owned = [b for h in held for b in h]
        assert len(owned) == len(set(owned)) == bm.num_used
    for h in held:
        bm.free(h)
    bm.check_all_free()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (2.5, 4), (True, 4)])
def test_bad_construction_names_the_argument(num_blocks, block_size) -> None:
    name = "num_blocks" if num_blocks in (0, 2.5) or num_blocks is True else "block_size"
    with pytest.raises(ValueError, match=name):
        BlockManager(num_blocks, block_size)


def test_kv_block_bytes_qwen2_vl_7b() -> None:
    # 28 layers x 4 KV heads x 128 dims, bf16, K and V, 16 tokens a block.
    assert kv_block_bytes(28, 4, 128, 16, torch.bfloat16) == 2 * 28 * 16 * 4 * 128 * 2


def test_plan_configured_and_cpu_default() -> None:
    plan = plan_kv_cache(block_size=16, block_bytes=100, device="cpu", num_blocks=7)
    assert (plan.num_blocks, plan.source, plan.capacity_tokens) == (7, "configured", 112)
    plan = plan_kv_cache(block_size=16, block_bytes=100, device="cpu")
    assert plan.num_blocks == CPU_DEFAULT_BLOCKS


def test_plan_from_free_memory() -> None:
    gib = 1 << 30
    plan = plan_kv_cache(block_size=16, block_bytes=1 << 20, device="cuda",
                         gpu_memory_utilization=0.5, activation_bytes=gib, reserve_bytes=gib,
                         free_bytes=60 * gib, total_bytes=80 * gib)
    # 40 GiB allowed - 20 GiB in use - 1 GiB activations - 1 GiB graphs = 18 GiB of 1 MiB blocks.
    assert plan.source == "profiled" and plan.num_blocks == 18 * 1024
    assert plan.kv_bytes == 18 * gib


def test_plan_without_room_raises() -> None:
    gib = 1 << 30
    with pytest.raises(ValueError, match="no room for the KV cache"):
        plan_kv_cache(block_size=16, block_bytes=1 << 20, device="cuda", free_bytes=gib,
                      total_bytes=80 * gib)


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(gpu_memory_utilization=1.5, free_bytes=1, total_bytes=2), "gpu_memory_utilization"),
])
def test_plan_bad_arguments(kwargs, name) -> None:
    args = dict(block_size=16, block_bytes=64, device="cpu") | kwargs
    with pytest.raises(ValueError, match=name):
        plan_kv_cache(**args)


def test_max_sequence_len_is_capped_by_the_cache() -> None:
    plan = plan_kv_cache(block_size=4, block_bytes=8, device="cpu", num_blocks=10)
    assert max_sequence_len(1000, plan) == 40
    assert max_sequence_len(30, plan) == 30
    assert max_sequence_len(1000, plan, configured=20) == 20
