"""Causal paged prefill against an fp64 reference; chunked prefill equals one-shot prefill."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.attention.kv_cache import store_kv
from spaceserve.kernels.attention.paged_plan import (
    StagedWorkList,
    build_prefill_work,
    prefill_work_host,
)
from spaceserve.kernels.attention.paged_prefill import (
    PrefillPlan,
    paged_prefill_attention,
    ref_paged_prefill_attention,
)
from spaceserve.kernels.testing import assert_close, assert_within_budget, poisoned_like

from .paged_cases import as64, cdiv, random_cache, random_tables

# (dtype, head_dim, block_size, Hq, Hkv, [(cached length, new tokens), ...])
CASES = [
    (torch.float32, 64, 16, 4, 4, [(40, 40), (1, 1), (100, 17), (32, 0), (16, 16)]),
    (torch.float16, 128, 32, 8, 2, [(64, 64), (70, 3)]),
    (torch.float32, 64, 16, 7, 1, [(33, 20), (5, 5)]),
]


def _problem(dtype, dim, bs, hq, hkv, seqs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in seqs]
    num_blocks = sum(cdiv(n, bs) for n in lens) + 5
    kc, vc = random_cache(num_blocks, bs, hkv, dim, dtype, gen)
    bt = random_tables(lens, bs, cdiv(max(lens), bs) + 1, num_blocks, gen)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([m for _, m in seqs]), 0)
    q = torch.randn(int(cu[-1]), hq, dim, generator=gen).to(dtype)
    return q, kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype,dim,bs,hq,hkv,seqs", CASES)
def test_prefill_matches_reference_for_every_budget(dtype, dim, bs, hq, hkv, seqs):
    q, kc, vc, bt, cu, sl = _problem(dtype, dim, bs, hq, hkv, seqs)
    ref = ref_paged_prefill_attention(*as64(q, kc, vc), bt, cu, sl)
    outs = []
    for budget in (None, 1, 3):
        with record_launches() as recs:
            outs.append(paged_prefill_attention(q, kc, vc, bt, cu, sl, num_sms=budget))
        assert_within_budget(recs, budget)
    assert_close(outs[0], ref, dtype)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_chunked_prefill_equals_one_shot():
    hq, hkv, dim, bs, length = 8, 2, 64, 16, 75
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(length, hq, dim, generator=gen)
    k = torch.randn(length, hkv, dim, generator=gen)
    v = torch.randn(length, hkv, dim, generator=gen)
    bt = random_tables([length], bs, 6, 12, gen)
    slots = (bt[0, torch.arange(length) // bs].long() * bs + torch.arange(length) % bs)
    results = []
    for cuts in ([length], [40, length], [1, 33, length]):
        # Unwritten slots are NaN: reading a position beyond the causal frontier would show.
        kc = torch.full((12, bs, hkv, dim), float("nan"))
        vc = torch.full_like(kc, float("nan"))
        parts, start = [], 0
        for end in cuts:
            store_kv(k[start:end], v[start:end], kc, vc, slots[start:end])
            cu = torch.tensor([0, end - start], dtype=torch.int32)
            sl = torch.tensor([end], dtype=torch.int32)
            parts.append(paged_prefill_attention(q[start:end], kc, vc, bt, cu, sl, num_sms=2))
            start = end
        results.append(torch.cat(parts))
    kc = torch.zeros(12, bs, hkv, dim, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    store_kv(k.double(), v.double(), kc, vc, slots)
    cu = torch.tensor([0, length], dtype=torch.int32)
    ref = ref_paged_prefill_attention(q.double(), kc, vc, bt, cu,
                                      torch.tensor([length], dtype=torch.int32))
    for r in results:
        assert_close(r, ref)
        torch.testing.assert_close(r, results[0], rtol=1e-6, atol=1e-6)


def test_prefill_plan_reuses_buffers_across_compositions():
    hq, hkv, dim, bs = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(2)
    kc, vc = random_cache(24, bs, hkv, dim, torch.float32, gen)
    plan = PrefillPlan(48, 3, hq, hkv, dim, device="cpu")
    ptr = plan.work.buffer.data_ptr()
    for seqs in ([(40, 30), (9, 9)], [(100, 1), (20, 0), (64, 17)]):
        lens = [n for n, _ in seqs]
        bt = random_tables(lens, bs, 8, 24, gen)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor([m for _, m in seqs]), 0)
        sl = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(int(cu[-1]), hq, dim, generator=gen)
        plan.plan(cu, lens)
        out = poisoned_like(q)
        with record_launches() as recs:
            plan.run(q, kc, vc, bt, cu, sl, out=out, num_sms=3)
        assert_within_budget(recs, 3)
        assert recs[0].grid == (3,)
        assert_close(out, ref_paged_prefill_attention(*as64(q, kc, vc), bt, cu, sl))
        assert torch.equal(out, paged_prefill_attention(q, kc, vc, bt, cu, sl))
        assert plan.work.buffer.data_ptr() == ptr


def test_prefill_work_list_is_complete_and_longest_first():
    cu = torch.tensor([0, 20, 20, 21, 50], dtype=torch.int32)
    lens = torch.tensor([20, 7, 100, 29], dtype=torch.int32)
    block_q, hkv, cap_q = 8, 2, cdiv(50, 8) + 4
    dst = torch.empty(1 + cap_q * hkv * 3, dtype=torch.int32)
    build_prefill_work(cu, lens, hkv, block_q, cap_q, dst)
    count = int(dst[0])
    items = dst[1:].view(-1, 3)
    nqb = [3, 0, 1, 4]
    assert count == sum(nqb) * hkv
    assert torch.all(items[count:] == -1)
    live = items[:count].tolist()
    assert sorted(map(tuple, live)) == sorted((s, b, h) for s in range(4) for b in range(nqb[s])
                                              for h in range(hkv))
    n = (cu[1:] - cu[:-1]).tolist()
    cost = [int(lens[s]) - n[s] + min((b + 1) * block_q, n[s]) for s, b, _ in live]
    assert cost == sorted(cost, reverse=True)
    staged = StagedWorkList(cap_q * hkv, "cpu")
    staged.stage(prefill_work_host(torch.tensor([0, 24, 48, 72, 88]).numpy(),
                                   torch.tensor([30, 30, 30, 20]).numpy(), hkv, block_q))
    assert int(staged.buffer[0]) == cap_q * hkv > count  # longer, then shrinks below
    staged.stage(prefill_work_host(cu.numpy(), lens.numpy(), hkv, block_q))
    assert torch.equal(staged.buffer, dst)


def test_prefill_rejects_bad_arguments():
    q, kc, vc, bt, cu, sl = _problem(torch.float32, 64, 16, 4, 2, [(20, 5), (9, 9)])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kc, vc, bt, cu.long(), sl)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q[:-1], kc, vc, bt, cu, sl)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_prefill_attention(q, kc, vc, bt, cu, torch.tensor([4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        paged_prefill_attention(q, kc, vc, bt, cu, torch.tensor([20, 16 * bt.shape[1] + 1],
                                                                 dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill_attention(q, kc, vc, bt[:1], cu, sl)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        paged_prefill_attention(q[:, :3].contiguous(), kc, vc, bt, cu, sl)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(q[..., :32].contiguous(), kc, vc, bt, cu, sl)
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill_attention(q.half(), kc, vc, bt, cu, sl)
    plan = PrefillPlan(16, 2, 4, 2, 64, device="cpu")
    with pytest.raises(ValueError, match="max_tokens"):
        plan.plan([0, 10, 20], [10, 10])
    plan.plan([0, 5, 14], [20, 9])
    with pytest.raises(ValueError, match="tokens"):
        plan.run(q[:-1], kc, vc, bt, torch.tensor([0, 5, 13], dtype=torch.int32), sl)
