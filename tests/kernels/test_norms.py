"""RMSNorm / LayerNorm kernels against fp64 references, across budgets, shapes and bad inputs."""

import pytest
import torch

from spaceserve.kernels import norms, record_launches
from spaceserve.kernels.configs import clear_kernel_configs, set_kernel_configs
from spaceserve.kernels.norms import layer_norm, ref_layer_norm, ref_rms_norm, rms_norm
from spaceserve.kernels.testing import assert_close, assert_within_budget, poisoned_like

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output buffer the launchers allocate starts as NaN: unwritten elements fail."""
    def poisoned(shape, like):
        return poisoned_like(torch.empty(shape, dtype=like.dtype, device=like.device))
    monkeypatch.setattr(norms, "_new_output", poisoned)


def _inputs(M, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2 + 0.5).to(dtype).to(device)
    r = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.rand(K, generator=g) + 0.5).to(dtype).to(device)
    b = torch.randn(K, generator=g).to(dtype).to(device)
    return x, r, w, b


def _d(t):
    return t.to(torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(1, 72), (37, 72), (300, 72), (1, 1000), (37, 1000), (5, 1)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, M, K, with_residual, device):
    x, r, w, _ = _inputs(M, K, dtype, device)
    if with_residual:
        y, s = rms_norm(x, w, 1e-6, residual=r, num_sms=7)
        y_ref, s_ref = ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))
        assert s.dtype == dtype and y.dtype == dtype
        assert_close(s, s_ref, dtype)
    else:
        y = rms_norm(x, w, 1e-6, num_sms=7)
        y_ref = ref_rms_norm(_d(x), _d(w), 1e-6)
    assert_close(y, y_ref, dtype)
    assert torch.equal(x, _inputs(M, K, dtype, device)[0]), "x was modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(1, 72), (37, 72), (300, 72), (1, 1000), (37, 1000), (5, 1)])
def test_layer_norm_matches_reference(dtype, M, K, device):
    x, _, w, b = _inputs(M, K, dtype, device)
    y = layer_norm(x, w, b, 1e-5, num_sms=7)
    assert y.dtype == dtype
    assert_close(y, ref_layer_norm(_d(x), _d(w), _d(b), 1e-5), dtype)
    y = layer_norm(x, w, None, 1e-5, num_sms=7)
    assert_close(y, ref_layer_norm(_d(x), _d(w), None, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_take_the_chunked_path(dtype, device):
    """K > MAX_BLOCK_K: rows reduced chunk by chunk (the last chunk partial)."""
    M, K = 3, norms.MAX_BLOCK_K + 8
    assert not norms.norm_config(K)["SINGLE_PASS"]
    x, r, w, b = _inputs(M, K, dtype, device)
    y, s = rms_norm(x, w, 1e-6, residual=r)
    y_ref, s_ref = ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))
    assert_close(y, y_ref, dtype)
    assert_close(s, s_ref, dtype)
    assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(_d(x), _d(w), 1e-6), dtype)
    assert_close(layer_norm(x, w, b, 1e-5), ref_layer_norm(_d(x), _d(w), _d(b), 1e-5), dtype)


def test_chunked_path_with_many_chunks(monkeypatch, device):
    """Small chunks (monkeypatched) so rows of 300 span three chunks, the last one partial."""
    monkeypatch.setattr(norms, "MAX_BLOCK_K", 64)
    monkeypatch.setattr(norms, "CHUNK_K", 128)
    M, K = 37, 300
    x, r, w, b = _inputs(M, K, torch.float32, device)
    y, s = rms_norm(x, w, 1e-6, residual=r, num_sms=3)
    y_ref, s_ref = ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))
    assert_close(y, y_ref)
    assert_close(s, s_ref)
    assert_close(layer_norm(x, w, b, 1e-5), ref_layer_norm(_d(x), _d(w), _d(b), 1e-5))


@pytest.mark.parametrize("kind", ["rms", "rms_residual", "layer"])
def test_bitwise_equal_and_within_budget(kind, device):
    M, K = 300, 72  # 10 tiles of 32 rows
    x, r, w, b = _inputs(M, K, torch.float16, device)
    tiles = -(-M // norms.norm_config(K)["BLOCK_M"])
    outs = []
    for budget in (1, 3, 7, 132):
        with record_launches() as recs:
            if kind == "rms":
                out = (rms_norm(x, w, 1e-6, num_sms=budget),)
            elif kind == "rms_residual":
                out = rms_norm(x, w, 1e-6, residual=r, num_sms=budget)
            else:
                out = (layer_norm(x, w, b, 1e-5, num_sms=budget),)
        assert_within_budget(recs, budget)
        assert len(recs) == 1 and recs[0].grid == (min(budget, tiles),)
        assert recs[0].num_tiles == tiles
        outs.append(out)
    for out in outs[1:]:
        for a, ref in zip(out, outs[0], strict=True):
            assert torch.equal(a, ref)


def test_tuned_configs_keep_results_budget_independent(device):
    """A table whose buckets disagree on the block shape must not make results budget-dependent:
    the shape comes from the full-device bucket; only num_stages follows the budget."""
    x, r, w, _ = _inputs(37, 72, torch.float32, device)
    try:
        set_kernel_configs({"rms_norm": {8: {"BLOCK_M": 1, "num_stages": 2},
                                         1024: {"BLOCK_M": 4, "num_stages": 3}}})
        with record_launches() as recs:
            a = rms_norm(x, w, 1e-6, residual=r, num_sms=3)
            b = rms_norm(x, w, 1e-6, residual=r, num_sms=100)
    finally:
        clear_kernel_configs()
    assert [rec.config["BLOCK_M"] for rec in recs] == [4, 4]
    assert [rec.config["num_stages"] for rec in recs] == [2, 3]
    assert recs[0].num_tiles == 10
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert_close(a[0], ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))[0])


def test_strided_rows_and_empty(device):
    base, rbase, w, b = _inputs(37, 100, torch.float32, device)
    x, r = base[:, 10:82], rbase[:, 3:75]  # row stride 100, K = 72
    w, b = w[:72], b[:72]
    y, s = rms_norm(x, w, 1e-6, residual=r)
    y_ref, s_ref = ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))
    assert_close(y, y_ref)
    assert_close(s, s_ref)
    assert_close(layer_norm(x, w, b, 1e-5), ref_layer_norm(_d(x), _d(w), _d(b), 1e-5))
    xt = _inputs(72, 37, torch.float32, device)[0].t()  # column-major input: copied
    assert_close(rms_norm(xt, w, 1e-6), ref_rms_norm(_d(xt), _d(w), 1e-6))
    with record_launches() as recs:
        assert rms_norm(x[:0], w, 1e-6).shape == (0, 72)
    assert recs == []


def test_matches_transformers_qwen2_rmsnorm_and_torch_layernorm(device):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    x, r, w, b = _inputs(37, 1000, torch.float16, device)
    mod = Qwen2RMSNorm(1000, eps=1e-6).to(device=device, dtype=torch.float16)
    with torch.no_grad():
        mod.weight.copy_(w)
        hf = mod(x)
        hf_sum = x + r
        hf_res = mod(hf_sum)
    assert_close(rms_norm(x, w, 1e-6), hf, rtol=2e-3)
    y, s = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(s, hf_sum)  # the residual add rounds like the unfused model
    assert_close(y, hf_res, rtol=2e-3)
    tl_ref = torch.nn.functional.layer_norm(x.float(), (1000,), w.float(), b.float(), 1e-5)
    assert_close(layer_norm(x, w, b, 1e-5), tl_ref, rtol=2e-3)


def test_invalid_inputs_raise(device):
    x, r, w, b = _inputs(4, 8, torch.float32, device)
    bad = [
        (lambda: rms_norm(x[0], w, 1e-6), "x"),
        (lambda: rms_norm(x.to(torch.int32), w.to(torch.int32), 1e-6), "x"),
        (lambda: rms_norm(x, w[:7], 1e-6), "weight"),
        (lambda: rms_norm(x, w.half(), 1e-6), "weight"),
        (lambda: rms_norm(x, w, -1.0), "eps"),
        (lambda: rms_norm(x, w, float("nan")), "eps"),
        (lambda: rms_norm(x, w, 1e-6, residual=r[:3]), "residual"),
        (lambda: rms_norm(x, w, 1e-6, residual=r.half()), "residual"),
        (lambda: rms_norm(x, w, 1e-6, num_sms=0), "num_sms"),
        (lambda: rms_norm(x, w, 1e-6, num_sms=10_000), "num_sms"),
        (lambda: layer_norm(x, w, b[:7], 1e-5), "bias"),
        (lambda: layer_norm(x, w, b.half(), 1e-5), "bias"),
        (lambda: layer_norm(x, w[:7], b, 1e-5), "weight"),
        (lambda: layer_norm(x[None], w, b, 1e-5), "x"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()


def test_compile_specs_cover_every_kernel_argument():
    specs = norms.compile_specs()
    assert {s.kernel for s in specs} == {norms._rms_norm_kernel, norms._layer_norm_kernel}
    for s in specs:
        assert list(s.signature) + list(s.constexprs) == list(s.kernel.arg_names), s.name
        assert not s.expect_wgmma
    assert any(s.constexprs["SINGLE_PASS"] is False for s in specs)
    assert {s.signature["x_ptr"] for s in specs} == {"*bf16", "*fp16"}


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 3584), (300, 1280), (37, 1000), (5, norms.MAX_BLOCK_K + 8)])
def test_bf16_on_gpu(M, K):
    dtype = torch.bfloat16
    x, r, w, b = _inputs(M, K, dtype, "cuda")
    outs = []
    for budget in (1, 7, 66, None):
        with record_launches() as recs:
            y, s = rms_norm(x, w, 1e-6, residual=r, num_sms=budget)
            ln = layer_norm(x, w, b, 1e-6, num_sms=budget)
        assert_within_budget(recs)
        outs.append((y, s, ln))
    for out in outs[1:]:
        assert all(torch.equal(a, ref) for a, ref in zip(out, outs[0], strict=True))
    y, s, ln = outs[0]
    y_ref, s_ref = ref_rms_norm(_d(x), _d(w), 1e-6, residual=_d(r))
    assert_close(y, y_ref, dtype)
    assert torch.equal(s, x + r)
    assert_close(ln, ref_layer_norm(_d(x), _d(w), _d(b), 1e-6), dtype)
