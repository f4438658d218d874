"""Paged decode attention against an fp64 page-gathering reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.attention.paged_decode import (
    DECODE_CHUNK,
    DecodePlan,
    paged_decode_attention,
    ref_paged_decode_attention,
)
from spaceserve.kernels.attention.paged_plan import (
    StagedWorkList,
    build_decode_work,
    decode_work_host,
)
from spaceserve.kernels.testing import assert_close, assert_within_budget, poisoned_like

from .paged_cases import as64, cdiv, random_cache, random_tables

# (dtype, head_dim, block_size, Hq, Hkv, lengths): GQA 1 / 4 / 7, D 64 / 128, pages 16 / 32;
# lengths mix 1, exact page multiples, padding (0) and sequences spanning several chunks.
CASES = [
    (torch.float32, 64, 16, 4, 4, [1, 16, 700, 0, 33]),
    (torch.float16, 128, 32, 8, 2, [64, 5, 1100, 512]),
    (torch.float32, 128, 16, 7, 1, [513, 1, 32, 0]),
    (torch.float16, 64, 32, 14, 2, [1024, 3]),
]


def _problem(dtype, dim, bs, hq, hkv, lens, seed=0, max_blocks=None):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max_blocks or cdiv(max(lens), bs) + 2
    num_blocks = sum(cdiv(n, bs) for n in lens) + 7
    k_cache, v_cache = random_cache(num_blocks, bs, hkv, dim, dtype, gen)
    tables = random_tables(lens, bs, max_blocks, num_blocks, gen)
    q = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype,dim,bs,hq,hkv,lens", CASES)
def test_decode_matches_reference_for_every_budget(dtype, dim, bs, hq, hkv, lens):
    q, kc, vc, bt, sl = _problem(dtype, dim, bs, hq, hkv, lens)
    ref = ref_paged_decode_attention(*as64(q, kc, vc), bt, sl)
    outs = []
    for budget in (None, 1, 3):
        with record_launches() as recs:
            outs.append(paged_decode_attention(q, kc, vc, bt, sl, num_sms=budget))
        assert_within_budget(recs, budget)
        assert [r.name for r in recs][0] == "paged_decode"
        assert ("paged_decode_merge" in [r.name for r in recs]) == (max(lens) > DECODE_CHUNK)
    assert_close(outs[0], ref, dtype)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    pad = [i for i, n in enumerate(lens) if n == 0]
    assert torch.all(outs[0][pad] == 0)


def test_decode_writes_every_row_of_a_poisoned_output_and_scale():
    lens = [600, 0, 17, 1]
    q, kc, vc, bt, sl = _problem(torch.float32, 64, 16, 8, 2, lens, seed=3)
    plan = DecodePlan(4, bt.shape[1], 8, 2, 64, 16, device="cpu")
    plan.plan(lens)
    out = poisoned_like(q)
    plan.run(q, kc, vc, bt, sl, out=out, scale=0.3, num_sms=2)
    assert_close(out, ref_paged_decode_attention(*as64(q, kc, vc), bt, sl, scale=0.3))
    assert torch.equal(out, paged_decode_attention(q, kc, vc, bt, sl, scale=0.3))


def test_plan_once_run_twice_without_reallocation():
    hq, hkv, dim, bs, max_blocks = 8, 2, 64, 16, 48  # 768 tokens -> two chunks per sequence
    gen = torch.Generator().manual_seed(5)
    kc, vc = random_cache(64, bs, hkv, dim, torch.float32, gen)
    plan = DecodePlan(4, max_blocks, hq, hkv, dim, bs, device="cpu")
    ptrs = (plan.work.buffer.data_ptr(), plan.partial_o.data_ptr(), plan.partial_lse.data_ptr())
    for lens in ([700, 3, 0, 64], [5, 760], [1, 2, 513, 0]):
        bt = random_tables(lens, bs, max_blocks, 64, gen)
        kc.normal_(generator=gen)
        vc.normal_(generator=gen)
        q = torch.randn(len(lens), hq, dim, generator=gen)
        sl = torch.tensor(lens, dtype=torch.int32)
        plan.plan(lens)
        out = poisoned_like(q)
        with record_launches() as recs:
            plan.run(q, kc, vc, bt, sl, out=out, num_sms=3)
        assert_within_budget(recs, 3)
        assert all(r.grid == (3,) for r in recs), "grid must not depend on the contents"
        assert_close(out, ref_paged_decode_attention(*as64(q, kc, vc), bt, sl))
        assert (plan.work.buffer.data_ptr(), plan.partial_o.data_ptr(),
                plan.partial_lse.data_ptr()) == ptrs


def test_decode_work_list_is_complete_and_longest_first():
    lens = torch.tensor([0, 1500, 3, 512, 513], dtype=torch.int32)
    hkv, max_chunks, cap = 3, 4, 5 * 3 * 4
    dst = torch.empty(1 + cap * 3, dtype=torch.int32)
    build_decode_work(lens, hkv, max_chunks, DECODE_CHUNK, dst)
    count = int(dst[0])
    items = dst[1:].view(cap, 3)
    chunks = [max(1, cdiv(int(n), DECODE_CHUNK)) for n in lens]
    assert count == sum(chunks) * hkv
    assert torch.all(items[count:] == -1)
    live = {tuple(r) for r in items[:count].tolist()}
    assert live == {(s, c, h) for s, n in enumerate(chunks) for c in range(n) for h in range(hkv)}
    tokens = [min(DECODE_CHUNK, int(lens[s]) - c * DECODE_CHUNK) for s, c, _ in
              items[:count].tolist()]
    assert tokens == sorted(tokens, reverse=True)
    # The host (numpy) twin stages the same list, also after a longer list was live.
    staged = StagedWorkList(cap, "cpu")
    staged.stage(decode_work_host(torch.full((5,), 1500).numpy(), hkv, max_chunks,
                                  DECODE_CHUNK))
    staged.stage(decode_work_host(lens.numpy(), hkv, max_chunks, DECODE_CHUNK))
    assert torch.equal(staged.buffer, dst)


def test_decode_rejects_bad_arguments():
    q, kc, vc, bt, sl = _problem(torch.float32, 64, 16, 8, 2, [20, 7])
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kc, vc, bt.long(), sl)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, kc, vc, bt, sl.long())
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, kc, vc, bt, torch.tensor([20, 16 * bt.shape[1] + 1],
                                                             dtype=torch.int32))
    with pytest.raises(ValueError, match="Hq % Hkv"):
        paged_decode_attention(q[:, :7].contiguous(), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :32].contiguous(), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="block_tables"):
        bad = bt.clone()
        bad[0, 0] = kc.shape[0]
        paged_decode_attention(q, kc, vc, bad, sl)
    with pytest.raises(ValueError, match="num_sms"):
        paged_decode_attention(q, kc, vc, bt, sl, num_sms=0)
    plan = DecodePlan(2, bt.shape[1], 8, 2, 64, 16, device="cpu")
    with pytest.raises(ValueError, match="seq_lens_host"):
        plan.plan([20, 16 * bt.shape[1] + 1])
    with pytest.raises(ValueError, match="seq_lens_host"):
        plan.plan([1, 2, 3])
    plan.plan([20])
    with pytest.raises(ValueError, match="batch"):
        plan.run(q, kc, vc, bt, sl)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        DecodePlan(2, 4, 6, 4, 64, 16, device="cpu")
