"""store_kv writes exactly the addressed slots, skips negative ones, under any budget."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.attention.kv_cache import ref_store_kv, store_kv
from spaceserve.kernels.testing import assert_within_budget


@pytest.mark.parametrize("slot_dtype,dtype,hkv,dim,bs", [
    (torch.int32, torch.float32, 2, 64, 16),
    (torch.int64, torch.float16, 3, 128, 32),
    (torch.int64, torch.float32, 1, 80, 16),
])
def test_store_kv_writes_exactly_the_addressed_slots(slot_dtype, dtype, hkv, dim, bs):
    gen = torch.Generator().manual_seed(0)
    num_blocks, t = 9, 37
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t].to(slot_dtype)
    slots[::5] = -1
    # k and v are views with a token stride wider than the row (a fused qkv projection).
    kv = torch.randn(t, 2 * hkv, dim, generator=gen).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]
    sentinel = torch.full((num_blocks, bs, hkv, dim), 7.0, dtype=dtype)
    want_k, want_v = sentinel.clone(), sentinel.clone() - 1
    ref_store_kv(k, v, want_k, want_v, slots)
    for budget in (1, 3, None):
        kc, vc = sentinel.clone(), sentinel.clone() - 1
        with record_launches() as recs:
            store_kv(k, v, kc, vc, slots, num_sms=budget)
        assert_within_budget(recs, budget)
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    written = (want_k != 7.0).any(-1).any(-1).sum().item()
    assert written == int((slots >= 0).sum())


def test_store_kv_with_no_tokens_is_a_no_op():
    kc = torch.zeros(2, 16, 1, 64)
    store_kv(torch.empty(0, 1, 64), torch.empty(0, 1, 64), kc, kc.clone(),
             torch.empty(0, dtype=torch.int32))
    assert torch.all(kc == 0)


def test_store_kv_rejects_bad_arguments():
    kc = torch.zeros(2, 16, 2, 64)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 31], dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, vc, torch.tensor([0, 5, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, vc, slots.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="k must be"):
        store_kv(k[:, :1], k[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.half(), k.half(), kc, vc, slots)
    with pytest.raises(ValueError, match="v_cache"):
        store_kv(k, k, kc, vc[:1], slots)
    with pytest.raises(ValueError, match="num_sms"):
        store_kv(k, k, kc, vc, slots, num_sms=10_000)
