"""`linear`: persistent GEMM with fused bias/activation and a fixed split-K for skinny M."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.configs import clear_kernel_configs, set_kernel_configs
from spaceserve.kernels.linear import (
    ACTIVATIONS,
    CPU_CONFIGS,
    choose_split_k,
    compile_specs,
    default_config,
    linear,
    ref_linear,
)
from spaceserve.kernels.testing import assert_close, assert_within_budget

BUDGETS = (1, 3, 7, 132)


def make(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def ref64(x, w, b, act):
    return ref_linear(x.double(), w.double(), None if b is None else b.double(), act)


CASES = [  # (M, N, K, dtype, activation, bias): skinny/split, mid, large/unsplit, N=1, K=1
    (1, 40, 72, torch.float32, None, True),
    (1, 40, 72, torch.float16, "gelu_tanh", False),
    (37, 40, 72, torch.float16, "gelu", True),
    (37, 1, 72, torch.float32, "gelu_tanh", True),
    (300, 40, 72, torch.float32, "quick_gelu", False),
    (300, 40, 72, torch.float16, "silu", True),
    (300, 33, 45, torch.float32, "gelu", True),
    (5, 40, 1, torch.float32, "silu", True),
    (37, 40, 72, torch.bfloat16, "silu", True),  # interpreter runs bf16 dots in fp32
]


@pytest.mark.parametrize("m,n,k,dtype,act,bias", CASES)
def test_matches_fp64_reference(poisoned_alloc, m, n, k, dtype, act, bias) -> None:
    x, w, b = make(m, n, k, dtype, bias)
    out = linear(x, w, b, activation=act, num_sms=7)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref64(x, w, b, act), dtype)


@pytest.mark.parametrize("act", sorted(a for a in ACTIVATIONS if a))
def test_each_activation_both_paths(poisoned_alloc, act: str) -> None:
    """Every activation, fused in the GEMM epilogue (M=300) and in the split-K reduce (M=2)."""
    for m in (2, 300):
        x, w, b = make(m, 24, 40, torch.float32, True, seed=m)
        with record_launches() as rec:
            out = linear(x, w, b, activation=act)
        assert ("linear.reduce" in [r.name for r in rec]) == (m == 2)
        assert_close(out, ref64(x, w, b, act))


def test_split_policy_covers_both_paths() -> None:
    """Skinny M is split along K, large M is not; the split never depends on the budget."""
    cpu = torch.device("cpu")
    assert choose_split_k(1, 40, 72, default_config(1, cpu), cpu) == 3
    assert choose_split_k(300, 40, 72, default_config(300, cpu), cpu) == 1
    gpu = torch.device("cuda")
    # Decode on the H200: 3584 x 3584 weights, 56 N tiles -> several K splits.
    assert choose_split_k(1, 3584, 3584, default_config(1, gpu), gpu) > 1
    # A ViT-sized GEMM has tiles enough.
    assert choose_split_k(4096, 1280, 1280, default_config(4096, gpu), gpu) == 1


@pytest.mark.parametrize("m,act", [(1, "gelu"), (37, None), (300, "silu")])
def test_bitwise_identical_across_budgets(poisoned_alloc, m: int, act: str | None) -> None:
    x, w, b = make(m, 40, 72, torch.float16, True, seed=1)
    outs, tiles = [], set()
    for budget in BUDGETS:
        with record_launches() as rec:
            outs.append(linear(x, w, b, activation=act, num_sms=budget))
        assert_within_budget(rec, budget)
        names = [r.name for r in rec]
        assert names == (["linear"] if m == 300 else ["linear", "linear.reduce"])
        for r in rec:
            assert r.grid == (min(budget, r.num_tiles),)
        tiles.add(tuple(r.num_tiles for r in rec))
    assert len(tiles) == 1, f"work split changed with the budget: {tiles}"
    assert max(t for t in next(iter(tiles))) > 1
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], ref64(x, w, b, act), torch.float16)


def test_strided_inputs(poisoned_alloc) -> None:
    """Rows not a multiple of 16 bytes apart and a transposed (K-strided) weight."""
    x, w, b = make(37, 40, 45, torch.float32, True, seed=2)
    wide = torch.zeros(37, 48)
    wide[:, 1:46] = x
    xv = wide[:, 1:46]  # row stride 48, base offset 4 bytes
    wt = w.t().contiguous().t()  # stride (1, 40)
    out = linear(xv, wt, b, activation="gelu")
    assert_close(out, ref64(x, w, b, "gelu"))


def test_tuned_config_keeps_block_k() -> None:
    """A per-budget table may change tile shapes; BLOCK_K (reduction order) stays the default."""
    x, w, b = make(300, 40, 72, torch.float32, True, seed=3)
    tuned = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
    set_kernel_configs({"linear": {3: tuned}})
    try:
        with record_launches() as rec:
            out = linear(x, w, b, num_sms=3)
    finally:
        clear_kernel_configs()
    cfg = rec[0].config
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["GROUP_M"]) == (16, 16, 2)
    assert cfg["BLOCK_K"] == CPU_CONFIGS["large"]["BLOCK_K"]
    assert_close(out, ref64(x, w, b, None))


def test_empty_m() -> None:
    x, w, b = make(0, 40, 72, torch.float32, True)
    with record_launches() as rec:
        out = linear(x, w, b)
    assert out.shape == (0, 40) and not rec


@pytest.mark.parametrize("budget", [0, 133, -1])
def test_invalid_budget_raises(budget: int) -> None:
    x, w, b = make(4, 40, 72, torch.float32, True)
    with record_launches() as rec, pytest.raises(ValueError, match="num_sms"):
        linear(x, w, b, num_sms=budget)
    assert not rec


def test_invalid_inputs_raise() -> None:
    x, w, b = make(4, 40, 72, torch.float32, True)
    bad = [
        (dict(x=x[0]), "x"),
        (dict(x=x.to(torch.int32)), "x dtype"),
        (dict(weight=w[:, :71]), "weight"),
        (dict(weight=w[0]), "weight"),
        (dict(weight=w.half()), "weight dtype"),
        (dict(weight=torch.empty(40, 72, device="meta")), "weight is on meta"),
        (dict(bias=b[:39]), "bias"),
        (dict(bias=b.half()), "bias dtype"),
        (dict(activation="relu"), "activation"),
    ]
    for change, match in bad:
        args = dict(x=x, weight=w, bias=b) | change
        act = args.pop("activation", None)
        with pytest.raises(ValueError, match=match):
            linear(args["x"], args["weight"], args["bias"], activation=act)


def test_compile_specs_cover_the_launcher() -> None:
    specs = compile_specs()
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert list(s.signature) + list(s.constexprs) == s.kernel.arg_names, s.name
        assert all(v.startswith("*") or v == "i32" for v in s.signature.values()), s.name
        if "BLOCK_M" in s.constexprs:
            assert min(s.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) >= 16
            assert s.expect_wgmma == (s.constexprs["BLOCK_M"] >= 64), s.name
    for dt in ("bf16", "fp16"):
        gemm = [s for s in specs if "BLOCK_M" in s.constexprs and s.signature["x_ptr"] == f"*{dt}"]
        assert {s.constexprs["SPLIT"] for s in gemm} == {True, False}
        assert {s.constexprs["BLOCK_M"] for s in gemm} == {16, 64, 128}
        fused = {s.constexprs["ACT"] for s in gemm if not s.constexprs["SPLIT"]}
        reduced = {s.constexprs["ACT"] for s in specs
                   if "BLOCK" in s.constexprs and s.signature["out_ptr"] == f"*{dt}"}
        assert fused == reduced == set(ACTIVATIONS.values())
    assert len(compile_specs(full=True)) > len(specs)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4, 3584, 3584), (300, 3420, 1280), (1024, 1280, 3420)])
def test_bf16_gpu(poisoned_alloc, m: int, n: int, k: int) -> None:
    """bf16 on the GPU: decode (split-K), prefill-sized, and 6840-byte rows (I=3420)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, device=dev, generator=g).bfloat16()
    ref = ref64(x, w, b, "gelu_tanh")
    outs = []
    for budget in (8, 66, 132):
        with record_launches() as rec:
            out = linear(x, w, b, activation="gelu_tanh", num_sms=budget)
        assert_within_budget(rec, budget)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], ref, torch.bfloat16)
