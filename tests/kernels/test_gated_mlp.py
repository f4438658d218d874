"""`gated_mlp`: SwiGLU down(silu(gate) * up) with the gate and up GEMMs fused in one launch."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.gated_mlp import compile_specs, gated_mlp, ref_gated_mlp
from spaceserve.kernels.testing import assert_close, assert_within_budget

BUDGETS = (1, 3, 7, 132)


def make(m: int, k: int, inter: int, dtype: torch.dtype, bias: bool, seed: int = 0,
         device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = rnd(m, k)
    w_gate_up = rnd(2 * inter, k, scale=k**-0.5)
    w_down = rnd(k, inter, scale=inter**-0.5)
    b_gate_up = rnd(2 * inter) if bias else None
    b_down = rnd(k) if bias else None
    return x, w_gate_up, w_down, b_gate_up, b_down


def ref64(x, w_gate_up, w_down, b_gate_up, b_down):
    def d(t):
        return None if t is None else t.double()

    return ref_gated_mlp(d(x), d(w_gate_up), d(w_down), d(b_gate_up), d(b_down))


def run(args, budget=None):
    x, w_gate_up, w_down, b_gate_up, b_down = args
    return gated_mlp(x, w_gate_up, w_down, b_gate_up=b_gate_up, b_down=b_down, num_sms=budget)


CASES = [  # (M, K, I, dtype, bias): split-K in both GEMMs, in one, in none; size-1 dims
    (1, 40, 36, torch.float32, True),
    (1, 40, 36, torch.float16, False),
    (37, 72, 40, torch.float16, True),
    (300, 40, 36, torch.float32, True),
    (300, 40, 36, torch.float16, False),
    (3, 1, 1, torch.float32, True),
    (37, 40, 36, torch.bfloat16, True),  # interpreter runs bf16 dots in fp32
]


@pytest.mark.parametrize("m,k,inter,dtype,bias", CASES)
def test_matches_fp64_reference(poisoned_alloc, m, k, inter, dtype, bias) -> None:
    args = make(m, k, inter, dtype, bias)
    out = run(args, 7)
    assert out.dtype == dtype and out.shape == (m, k)
    assert_close(out, ref64(*args), dtype)


def test_gate_rows_come_first() -> None:
    """Swapping the gate and up halves changes the result: the kernel must read gate first."""
    x, w_gate_up, w_down, b_gate_up, b_down = make(37, 40, 36, torch.float32, True, seed=4)
    swapped = torch.cat(w_gate_up.chunk(2)[::-1])
    ref = ref64(x, w_gate_up, w_down, b_gate_up, b_down)
    assert (ref - ref64(x, swapped, w_down, b_gate_up, b_down)).abs().max() > 1e-2
    assert_close(run((x, w_gate_up, w_down, b_gate_up, b_down)), ref)


@pytest.mark.parametrize("m", [1, 300])
def test_bitwise_identical_across_budgets(poisoned_alloc, m: int) -> None:
    args = make(m, 72, 40, torch.float16, True, seed=1)
    outs, work = [], set()
    for budget in BUDGETS:
        with record_launches() as rec:
            outs.append(run(args, budget))
        assert_within_budget(rec, budget)
        for r in rec:
            assert r.grid == (min(budget, r.num_tiles),)
        names = [r.name for r in rec]
        expected = ["gated_mlp.gate_up", "gated_mlp.down"] if m == 300 else [
            "gated_mlp.gate_up", "gated_mlp.gate_up.reduce", "gated_mlp.down",
            "gated_mlp.down.reduce"]
        assert names == expected
        work.add(tuple(r.num_tiles for r in rec))
    assert len(work) == 1, f"work split changed with the budget: {work}"
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], ref64(*args), torch.float16)


def test_strided_inputs(poisoned_alloc) -> None:
    x, w_gate_up, w_down, b_gate_up, b_down = make(37, 40, 36, torch.float32, True, seed=2)
    wide = torch.zeros(37, 43)
    wide[:, 3:] = x
    out = run((wide[:, 3:], w_gate_up.t().contiguous().t(), w_down, b_gate_up, b_down))
    assert_close(out, ref64(x, w_gate_up, w_down, b_gate_up, b_down))


@pytest.mark.parametrize("budget", [0, 133, -1])
def test_invalid_budget_raises(budget: int) -> None:
    args = make(4, 40, 36, torch.float32, True)
    with record_launches() as rec, pytest.raises(ValueError, match="num_sms"):
        run(args, budget)
    assert not rec


def test_invalid_inputs_raise() -> None:
    x, w_gate_up, w_down, b_gate_up, b_down = make(4, 40, 36, torch.float32, True)
    good = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, b_gate_up=b_gate_up, b_down=b_down)
    bad = [
        (dict(x=x[0]), "x"),
        (dict(x=x.to(torch.int64)), "x dtype"),
        (dict(w_gate_up=w_gate_up[:71]), "w_gate_up"),
        (dict(w_gate_up=w_gate_up[:, :39]), "w_gate_up"),
        (dict(w_gate_up=w_gate_up.half()), "w_gate_up dtype"),
        (dict(w_down=w_down[:, :35]), "w_down"),
        (dict(w_down=w_down.t()), "w_down"),
        (dict(w_down=torch.empty(40, 36, device="meta")), "w_down is on meta"),
        (dict(b_gate_up=b_gate_up[:36]), "b_gate_up"),
        (dict(b_down=b_down.half()), "b_down dtype"),
        (dict(b_down=b_down[:36]), "b_down"),
    ]
    for change, match in bad:
        a = good | change
        with pytest.raises(ValueError, match=match):
            gated_mlp(a["x"], a["w_gate_up"], a["w_down"], b_gate_up=a["b_gate_up"],
                      b_down=a["b_down"])


def test_compile_specs_cover_the_launcher() -> None:
    specs = compile_specs()
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert list(s.signature) + list(s.constexprs) == s.kernel.arg_names, s.name
        if "BLOCK_M" in s.constexprs:
            assert min(s.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) >= 16
            assert s.expect_wgmma == (s.constexprs["BLOCK_M"] >= 64), s.name
    for dt in ("bf16", "fp16"):
        mine = [s for s in specs if s.signature["out_ptr"] == f"*{dt}"]
        gemm = [s for s in mine if "BLOCK_M" in s.constexprs]
        assert {(s.constexprs["BLOCK_M"], s.constexprs["SPLIT"]) for s in gemm} == {
            (bm, split) for bm in (16, 64, 128) for split in (False, True)}
        assert {s.constexprs["HAS_BIAS"] for s in mine if "GATED" in s.constexprs} == {
            True, False}
        assert all(s.constexprs["GATED"] for s in mine if "GATED" in s.constexprs)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,inter,bias", [(4, 3584, 18944, False), (1024, 1280, 3420, True)])
def test_bf16_gpu(poisoned_alloc, m: int, k: int, inter: int, bias: bool) -> None:
    """bf16 on the GPU: Qwen2-VL LLM decode (split-K) and the Qwen2.5-VL vision MLP (I=3420)."""
    args = make(m, k, inter, torch.bfloat16, bias, device="cuda")
    outs = []
    for budget in (8, 66, 132):
        with record_launches() as rec:
            outs.append(run(args, budget))
        assert_within_budget(rec, budget)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], ref64(*args), torch.bfloat16)
