"""Paged attention as a whole: compile specs, budget-independent configs, bf16 + CUDA graphs."""

from __future__ import annotations

import inspect

import pytest
import torch

from spaceserve.kernels.attention.paged import (
    DecodePlan,
    compile_specs,
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_store_kv,
    store_kv,
)
from spaceserve.kernels.configs import clear_kernel_configs, set_kernel_configs
from spaceserve.kernels.testing import assert_close, poisoned_like

from .paged_cases import as64, cdiv, random_cache, random_tables


def test_compile_specs_name_every_argument_in_order():
    specs = compile_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    kinds = {n.split("_bf16")[0].split("_fp16")[0] for n in names}
    assert kinds == {"paged_decode", "paged_decode_merge", "paged_prefill", "store_kv"}
    for s in specs:
        params = list(inspect.signature(s.kernel.fn).parameters)
        runtime = [p for p in params if p not in s.constexprs]
        assert list(s.signature) == runtime, s.name
        assert set(s.constexprs) | set(s.signature) == set(params), s.name
        assert all(t in {"*bf16", "*fp16", "*fp32", "*i32", "*i64", "i32", "i32:16", "fp32"}
                   for t in s.signature.values()), s.name
        assert s.expect_wgmma == s.name.startswith("paged_prefill"), s.name
        if s.name.startswith("paged_decode_b") or s.name.startswith("paged_decode_f"):
            assert s.constexprs["GROUP_PAD"] >= 16  # tl.dot needs M >= 16 on sm_90


def test_tuned_tables_cannot_make_results_depend_on_the_budget():
    """A table with other block sizes for small budgets still gives bitwise-equal outputs."""
    gen = torch.Generator().manual_seed(4)
    lens = [600, 9, 0]
    kc, vc = random_cache(48, 16, 2, 64, torch.float32, gen)
    bt = random_tables(lens, 16, 40, 48, gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 8, 64, generator=gen)
    plain = paged_decode_attention(q, kc, vc, bt, sl, num_sms=2)
    small = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 1}
    try:
        set_kernel_configs({"paged_decode": {8: small, 132: {"BLOCK_N": 64}},
                            "paged_prefill": {8: {"BLOCK_M": 32, "BLOCK_N": 16}}})
        tuned = [paged_decode_attention(q, kc, vc, bt, sl, num_sms=b) for b in (2, 132)]
    finally:
        clear_kernel_configs()
    assert torch.equal(tuned[0], tuned[1])
    assert not torch.equal(tuned[0], plain)  # the table did change the block size
    assert_close(tuned[0], ref_paged_decode_attention(*as64(q, kc, vc), bt, sl))


@pytest.mark.gpu
def test_bf16_on_gpu_with_a_captured_decode_step():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim, bs, max_blocks, num_blocks = 28, 4, 128, 16, 300, 900
    kc, vc = random_cache(num_blocks, bs, hkv, dim, torch.bfloat16, gen, dev)
    # store_kv in bf16 writes exactly what the reference writes.
    k_new = torch.randn(50, hkv, dim, generator=gen).to(torch.bfloat16).to(dev)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:50].to(dev)
    want_k, want_v = kc.clone(), vc.clone()
    ref_store_kv(k_new, k_new, want_k, want_v, slots)
    store_kv(k_new, k_new, kc, vc, slots, num_sms=16)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)

    batch = 5
    plan = DecodePlan(batch, max_blocks, hq, hkv, dim, bs, device=dev)
    q = torch.empty(batch, hq, dim, dtype=torch.bfloat16, device=dev)
    bt = torch.empty(batch, max_blocks, dtype=torch.int32, device=dev)
    sl = torch.empty(batch, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    graph = None
    for step, lens in enumerate(([1, 700, 4096, 0, 33], [2000, 16, 0, 513, 4800])):
        q.copy_(torch.randn(batch, hq, dim, generator=gen).to(torch.bfloat16))
        bt.copy_(random_tables(lens, bs, max_blocks, num_blocks, gen).clamp(min=0))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        plan.plan(lens)
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                plan.run(q, kc, vc, bt, sl, out=out, num_sms=66)  # compile outside capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plan.run(q, kc, vc, bt, sl, out=out, num_sms=66)
        out.copy_(poisoned_like(out))
        graph.replay()
        torch.cuda.synchronize()
        ref = ref_paged_decode_attention(*as64(q, kc, vc), bt.cpu(), sl.cpu())
        assert_close(out, ref, torch.bfloat16)
        eager = paged_decode_attention(q, kc, vc, bt, sl, num_sms=7)
        assert torch.equal(out, eager), f"step {step}: graph replay differs from eager"

    seqs = [(300, 300), (1000, 37), (64, 1)]
    lens = [n for n, _ in seqs]
    bt = random_tables(lens, bs, cdiv(1000, bs), num_blocks, gen).to(dev)
    cu = torch.tensor([0, 300, 337, 338], dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    qp = torch.randn(338, hq, dim, generator=gen).to(torch.bfloat16).to(dev)
    outs = [paged_prefill_attention(qp, kc, vc, bt, cu, sl, num_sms=b) for b in (None, 8)]
    ref = ref_paged_prefill_attention(*as64(qp, kc, vc), bt.cpu(), cu.cpu(), sl.cpu())
    assert_close(outs[0], ref, torch.bfloat16)
    assert torch.equal(outs[0], outs[1])
