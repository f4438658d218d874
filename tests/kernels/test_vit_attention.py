"""vit_attention: varlen bidirectional attention against a per-segment fp64 reference."""

import inspect

import pytest
import torch

from spaceserve.kernels.attention.vit import (
    NAME,
    _vit_attention_kernel,
    compile_specs,
    head_dim_split,
    plan_vit_attention,
    ref_vit_attention,
    vit_attention,
)
from spaceserve.kernels.budget import record_launches
from spaceserve.kernels.configs import clear_kernel_configs, set_kernel_configs
from spaceserve.kernels.testing import assert_close, assert_within_budget, poisoned_like


def _cu(lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _qkv(total: int, heads: int, dim: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=gen).to(dtype=dtype, device=device)
            for _ in range(3)]


def _ref(q, k, v, cu, **kw) -> torch.Tensor:
    kw = {n: t.double() for n, t in kw.items()}
    return ref_vit_attention(q.double(), k.double(), v.double(), cu, **kw)


def _attn(q, k, v, cu, max_seqlen, **kw) -> torch.Tensor:
    """vit_attention into a NaN-poisoned buffer, so an element it never writes fails the check."""
    out = poisoned_like(q)
    assert vit_attention(q, k, v, cu, max_seqlen, out=out, **kw) is out
    return out


def _run_tiles(lens: list[int], heads: int) -> int:
    return sum(-(-n // 32) for n in lens) * heads  # CPU default BLOCK_M = 32


@pytest.mark.parametrize(
    "dtype, heads, dim, lens, budgets",
    [
        (torch.float32, 3, 80, [1, 2, 17, 64, 75], [1, 2, 5, 132]),
        (torch.float16, 1, 128, [230, 1, 17, 2, 64], [3, 132]),
        (torch.float16, 16, 64, [17, 1, 2, 12], [7, 132]),
        (torch.float32, 2, 96, [50, 3], [1, 4]),
        (torch.float32, 1, 8, [5, 20], [2]),
        (torch.float16, 1, 200, [33, 4], [132]),
        (torch.float16, 2, 256, [19], [1]),
    ],
)
def test_matches_reference_and_budget_invariant(device, dtype, heads, dim, lens, budgets):
    cu = _cu(lens)
    q, k, v = _qkv(cu[-1].item(), heads, dim, dtype, device)
    ref = _ref(q, k, v, cu)
    outs = []
    for budget in budgets:
        with record_launches() as recs:
            outs.append(_attn(q, k, v, cu, max(lens), num_sms=budget))
        assert_within_budget(recs, budget)
        assert len(recs) == 1 and recs[0].name == NAME
        if device.type == "cpu":
            tiles = _run_tiles(lens, heads)
            assert recs[0].num_tiles == tiles
            assert recs[0].grid == (min(budget, tiles),)
        assert_close(outs[-1], ref, dtype)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_windows_and_one_long_segment(device):
    lens = [64] * 6 + [40]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), 2, 80, torch.float16, device, seed=1)
    assert_close(_attn(q, k, v, cu, 64, num_sms=5), _ref(q, k, v, cu), torch.float16)
    cu = _cu([300])
    q, k, v = _qkv(300, 1, 80, torch.float32, device, seed=2)
    assert_close(_attn(q, k, v, cu, 300, num_sms=3), _ref(q, k, v, cu), torch.float32)


def test_device_worklist_matches_host_worklist(device):
    lens = [17, 64, 1, 0, 70]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), 3, 80, torch.float16, device, seed=3)
    host = _attn(q, k, v, cu, 70, num_sms=4)
    with record_launches() as recs:
        dev = _attn(q, k, v, cu, 100, num_sms=1, device_worklist=True)
    assert_within_budget(recs, 1)
    # S * H * cdiv(max_seqlen, BLOCK_M) tiles, empty query blocks skipped inside the kernel.
    assert recs[0].num_tiles == 5 * 3 * 4
    assert_close(dev, _ref(q, k, v, cu), torch.float16)
    assert torch.equal(dev, host)
    assert torch.equal(dev, _attn(q, k, v, cu, 70, num_sms=132, device_worklist=True))


def test_plan_and_host_copy_paths_agree(device):
    lens = [2, 45, 17, 1]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), 2, 80, torch.float32, device, seed=4)
    plan = plan_vit_attention(cu, 2, 80, dtype=torch.float32, device=device)
    seg_len = plan.tiles[:, 1] - plan.tiles[:, 0]
    assert (seg_len[1:] <= seg_len[:-1]).all(), "work list is not longest-first"
    if device.type == "cpu":
        assert plan.num_tiles == _run_tiles(lens, 2)
    base = _attn(q, k, v, cu, 45)
    assert_close(base, _ref(q, k, v, cu), torch.float32)
    for _ in range(2):  # one plan, reused like the layers of a vision pass
        assert torch.equal(_attn(q, k, v, cu, 45, plan=plan, num_sms=3), base)
    assert torch.equal(_attn(q, k, v, cu, 45, cu_seqlens_cpu=cu.tolist()), base)


def test_strided_qkv_from_packed_projection(device):
    lens = [30, 9]
    qkv = torch.randn(39, 3, 2, 64, generator=torch.Generator().manual_seed(5))
    qkv = qkv.to(dtype=torch.float16, device=device)
    q, k, v = qkv.unbind(1)
    cu = _cu(lens)
    out = _attn(q, k, v, cu, 30, num_sms=2)
    assert torch.equal(out, vit_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, 30))
    assert_close(out, _ref(q, k, v, cu), torch.float16)


@pytest.mark.parametrize("dtype, heads, dim, lens, half_table",
                         [(torch.float32, 2, 80, [1, 17, 64, 30], False),
                          (torch.float16, 3, 64, [40, 5], True)])
def test_fused_rotary(device, dtype, heads, dim, lens, half_table):
    cu = _cu(lens)
    total = sum(lens)
    q, k, v = _qkv(total, heads, dim, dtype, device, seed=6)
    angles = torch.rand(total, dim // 2, generator=torch.Generator().manual_seed(7)) * 6.0
    if not half_table:
        angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    out = _attn(q, k, v, cu, max(lens), cos=cos, sin=sin, num_sms=3)
    ref = _ref(q, k, v, cu, cos=cos, sin=sin)
    assert_close(out, ref, dtype)
    # The rotation must matter: without it the result is far from the reference.
    assert (_attn(q, k, v, cu, max(lens)).double() - ref).norm() > 0.1 * ref.norm()
    assert torch.equal(out, _attn(q, k, v, cu, max(lens), cos=cos, sin=sin, num_sms=1))


def test_tuned_block_sizes_and_empty_input(device):
    lens = [1, 17, 40]
    cu = _cu(lens)
    q, k, v = _qkv(58, 2, 80, torch.float32, device, seed=8)
    set_kernel_configs({NAME: {132: {"BLOCK_M": 16, "BLOCK_N": 64}}})
    try:
        with record_launches() as recs:
            out = _attn(q, k, v, cu, 40, num_sms=6)
        dev = _attn(q, k, v, cu, 40, device_worklist=True)
    finally:
        clear_kernel_configs()
    if device.type == "cpu":
        assert recs[0].config["BLOCK_M"] == 16 and recs[0].num_tiles == (1 + 2 + 3) * 2
    assert_close(out, _ref(q, k, v, cu), torch.float32)
    assert torch.equal(out, dev)
    q0, k0, v0 = _qkv(0, 2, 80, torch.float32, device)
    with record_launches() as recs:
        assert vit_attention(q0, k0, v0, _cu([]), 0).shape == (0, 2, 80)
    assert recs == []


def test_head_dim_split_avoids_padding():
    assert head_dim_split(80) == (64, 16)
    assert head_dim_split(64) == (64, 0)
    assert head_dim_split(128) == (128, 0)
    assert head_dim_split(8) == (16, 0)
    assert head_dim_split(96) == (64, 32)
    for d in range(1, 257):
        d0, d1 = head_dim_split(d)
        assert d0 + d1 >= d and d0 >= 16 and (d1 == 0 or d1 >= 16)


def _bad_calls():
    q = torch.zeros(10, 2, 16)
    cu = _cu([4, 6])
    yield "q", lambda: vit_attention(q[0], q, q, cu, 6)
    yield "shapes", lambda: vit_attention(q, q[:, :1], q, cu, 6)
    yield "dtypes", lambda: vit_attention(q, q.half(), q, cu, 6)
    yield "dtype", lambda: vit_attention(q.double(), q.double(), q.double(), cu, 6)
    big = torch.zeros(10, 1, 257)
    yield "head dim", lambda: vit_attention(big, big, big, cu, 6)
    yield "int32", lambda: vit_attention(q, q, q, cu.long(), 6)
    yield "start at 0", lambda: vit_attention(q, q, q, cu + 1, 6)
    yield "end at T", lambda: vit_attention(q, q, q, _cu([4, 5]), 6)
    yield "non-decreasing", lambda: vit_attention(
        q, q, q, torch.tensor([0, 6, 4, 10], dtype=torch.int32), 6)
    yield "cu_seqlens_cpu", lambda: vit_attention(q, q, q, cu, 6, cu_seqlens_cpu=[0, 7, 6, 10])
    yield "cu_seqlens_cpu", lambda: vit_attention(q, q, q, cu, 6, cu_seqlens_cpu=[0, 10])
    yield "max_seqlen", lambda: vit_attention(q, q, q, cu, 5)
    yield "max_seqlen", lambda: vit_attention(q, q, q, cu, 6.0)
    yield "num_sms", lambda: vit_attention(q, q, q, cu, 6, num_sms=0)
    yield "num_sms", lambda: vit_attention(q, q, q, cu, 6, num_sms=10_000)
    yield "scale", lambda: vit_attention(q, q, q, cu, 6, scale=float("inf"))
    cs = torch.zeros(10, 16)
    yield "cos and sin", lambda: vit_attention(q, q, q, cu, 6, cos=cs)
    yield "cos", lambda: vit_attention(q, q, q, cu, 6, cos=cs.double(), sin=cs)
    yield "cos", lambda: vit_attention(q, q, q, cu, 6, cos=cs[:, :5], sin=cs[:, :5])
    yield "out", lambda: vit_attention(q, q, q, cu, 6, out=torch.zeros(10, 2, 8))
    yield "plan", lambda: vit_attention(
        q, q, q, cu, 6, plan=plan_vit_attention(cu, 3, 16, dtype=torch.float32))
    yield "num_heads", lambda: plan_vit_attention(cu, 0, 16)
    yield "head_dim", lambda: plan_vit_attention(cu, 2, 300)
    yield "non-decreasing", lambda: plan_vit_attention([0, 5, 3], 2, 16)


@pytest.mark.parametrize("match, call", list(_bad_calls()), ids=lambda x: str(x)[:20])
def test_invalid_arguments_raise(match, call):
    with record_launches() as recs, pytest.raises(ValueError, match=match):
        call()
    assert recs == []


def test_compile_specs_cover_launcher_configs():
    specs = compile_specs()
    kernel = getattr(_vit_attention_kernel, "fn", _vit_attention_kernel)  # interpreter wraps it
    params = inspect.signature(kernel).parameters
    names = list(params)
    const_names = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    assert {"BLOCK_M", "BLOCK_N", "HEAD_DIM", "ROTARY"} <= const_names
    assert len(specs) == len({s.name for s in specs}) == 2 * 3 * 2 * 2
    for spec in specs:
        assert list(spec.signature) == [n for n in names if n not in const_names]
        assert set(spec.constexprs) == const_names
        assert spec.expect_wgmma == (spec.constexprs["BLOCK_M"] >= 64)
        d0, d1 = head_dim_split(spec.constexprs["HEAD_DIM"])
        assert (spec.constexprs["BLOCK_D0"], spec.constexprs["BLOCK_D1"]) == (d0, d1)
        assert spec.signature["Q"] in ("*bf16", "*fp16") and spec.signature["TILES"] == "*i32"
    assert {s.constexprs["HEAD_DIM"] for s in specs} == {64, 80, 128}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(dtype):
    dev = torch.device("cuda")
    lens = [1, 2, 17, 64, 256, 1024, 700, 129]
    cu = _cu(lens, dev)
    total = sum(lens)
    q, k, v = _qkv(total, 16, 80, dtype, dev, seed=9)
    ref = _ref(q, k, v, cu)
    outs = []
    for budget in (8, 33, None):
        with record_launches() as recs:
            outs.append(_attn(q, k, v, cu, 1024, num_sms=budget,
                                      cu_seqlens_cpu=cu.cpu()))
        assert_within_budget(recs)
        assert_close(outs[-1], ref, dtype)
    dev_path = _attn(q, k, v, cu, 1024, num_sms=16)  # cu_seqlens only on the GPU
    plan = plan_vit_attention(cu.cpu(), 16, 80, dtype=dtype, device=dev)
    for out in outs[1:] + [dev_path, _attn(q, k, v, cu, 1024, plan=plan)]:
        assert torch.equal(out, outs[0])
    angles = torch.rand(total, 40, device=dev) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    fused = _attn(q, k, v, cu, 1024, cos=cos, sin=sin, plan=plan)
    assert_close(fused, _ref(q, k, v, cu, cos=cos, sin=sin), dtype)
