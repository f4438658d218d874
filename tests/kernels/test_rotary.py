"""Rotary tables against transformers' Qwen2-VL code; the apply kernel against an fp64 reference."""

import pytest
import torch

from spaceserve.kernels import record_launches, rotary
from spaceserve.kernels.rotary import (
    apply_rotary,
    mrope_cos_sin,
    ref_apply_rotary,
    rope_cos_sin,
    vision_position_ids,
    vision_rotary_cos_sin,
)
from spaceserve.kernels.testing import assert_close, assert_within_budget

qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")

GRID = [[1, 4, 6], [2, 2, 4], [1, 6, 2]]  # (t, h, w) per image, in patches


def _tiny_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=100, video_token_id=101, vision_start_token_id=102,
        vision_end_token_id=103, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _hf_vision_cos_sin(cfg, grid):
    """cos/sin of the tiny vision tower, through whichever API this transformers has."""
    vcfg = cfg.vision_config
    grid_t = torch.tensor(grid)
    if hasattr(qwen2_vl, "Qwen2VLVisionRotaryEmbedding"):
        from transformers.vision_utils import get_vision_position_ids

        pos = get_vision_position_ids(grid_t, vcfg.spatial_merge_size)
        cos, sin = qwen2_vl.Qwen2VLVisionRotaryEmbedding(vcfg)(torch.zeros(1), pos)
        return cos, sin, pos
    model = qwen2_vl.Qwen2VisionTransformerPretrainedModel._from_config(vcfg)
    if not hasattr(model, "rot_pos_emb"):
        pytest.skip("this transformers exposes no vision rotary helper")
    emb = model.rot_pos_emb(grid_t)
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos(), emb.sin(), None


def test_vision_tables_match_transformers():
    cfg = _tiny_config()
    head_dim = cfg.vision_config.embed_dim // cfg.vision_config.num_heads
    cos_hf, sin_hf, pos_hf = _hf_vision_cos_sin(cfg, GRID)
    cos, sin = vision_rotary_cos_sin(GRID, head_dim, 10000.0, cfg.vision_config.spatial_merge_size)
    assert cos.dtype == torch.float32 and cos.shape == (24 + 16 + 12, head_dim)
    assert torch.equal(cos, cos_hf.float()) and torch.equal(sin, sin_hf.float())
    if pos_hf is not None:
        assert torch.equal(vision_position_ids(torch.tensor(GRID), 2), pos_hf)
    # The 2x2 merge order: the first four patches are one merge block.
    assert vision_position_ids([[1, 4, 6]], 2)[:5].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1],
                                                                 [0, 2]]


def test_mrope_tables_match_transformers():
    cfg = _tiny_config()
    tcfg = cfg.text_config
    head_dim, section = 16, [2, 3, 3]
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 200, (3, 1, 11), generator=g)
    x = torch.zeros(1, dtype=torch.float32)
    cos_hf, sin_hf = qwen2_vl.Qwen2VLRotaryEmbedding(tcfg)(x, pos)
    cos, sin = mrope_cos_sin(pos[:, 0], head_dim, 1e6, section)
    if cos_hf.dim() == 3:  # recomposed by the rotary module itself
        assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    else:  # older API: recomposed inside apply_multimodal_rotary_pos_emb
        q = torch.randn(1, 4, 11, head_dim, generator=g)
        k = torch.randn(1, 2, 11, head_dim, generator=g)
        q_hf, k_hf = qwen2_vl.apply_multimodal_rotary_pos_emb(q, k, cos_hf, sin_hf, section)
        q_ref, k_ref = ref_apply_rotary(q[0].transpose(0, 1), k[0].transpose(0, 1), cos, sin)
        assert_close(q_ref, q_hf[0].transpose(0, 1), rtol=1e-6)
        assert_close(k_ref, k_hf[0].transpose(0, 1), rtol=1e-6)
    # Text tokens carry three equal ids: M-RoPE is then plain 1D RoPE.
    same = pos[0, 0].expand(3, -1)
    assert torch.equal(mrope_cos_sin(same, head_dim, 1e6, section)[0],
                       rope_cos_sin(pos[0, 0], head_dim, 1e6)[0])
    # Each section follows its own axis: moving only the height ids changes only section 1.
    moved = pos[:, 0].clone()
    moved[1] += 7
    diff = (mrope_cos_sin(moved, head_dim, 1e6, section)[0] != cos).any(0)
    half = torch.zeros(head_dim // 2, dtype=torch.bool)
    half[2:5] = True
    assert torch.equal(diff, torch.cat((half, half)))


def test_rope_tables_match_transformers_qwen2():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    pos = torch.arange(0, 300, 7)
    cos_hf, sin_hf = Qwen2RotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    cos, sin = rope_cos_sin(pos, 32, 1e6)
    assert_close(cos, cos_hf[0], rtol=1e-6)
    assert_close(sin, sin_hf[0], rtol=1e-6)
    cos16, _ = rope_cos_sin(pos, 32, 1e6, dtype=torch.float16)
    assert cos16.dtype == torch.float16 and torch.equal(cos16, cos.half())


def _qk(T, hq, hk, D, dtype, device, seed=0):
    """q and k as strided views of one fused [T, hq + 2 hk, D] buffer (v last, untouched)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, hq + 2 * hk, D, generator=g).to(dtype).to(device)
    return qkv, qkv[:, :hq], qkv[:, hq:hq + hk]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,hq,hk", [(64, 4, 2), (80, 3, 3), (128, 7, 1), (128, 20, 4)])
@pytest.mark.parametrize("T", [1, 37])
def test_apply_rotary_matches_reference(dtype, D, hq, hk, T, device):
    qkv, q, k = _qk(T, hq, hk, D, dtype, device)
    before = qkv.clone()
    pos = torch.randint(0, 4000, (3, T), generator=torch.Generator().manual_seed(1)).to(device)
    cos, sin = mrope_cos_sin(pos, D, 1e6, [D // 8, D // 8 + D // 16, D // 4 - D // 16])
    q_ref, k_ref = ref_apply_rotary(before[:, :hq].double(), before[:, hq:hq + hk].double(),
                                    cos.double(), sin.double())
    q_out, k_out = apply_rotary(q, k, cos, sin, num_sms=3)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, hq + hk:], before[:, hq + hk:]), "v was modified"


def test_apply_rotary_matches_transformers_vision(device):
    """Vision tower: 2D tables + apply_rotary == transformers' apply_rotary_pos_emb_vision."""
    head_dim = 80
    cos, sin = vision_rotary_cos_sin(GRID, head_dim, device=device)
    T = cos.shape[0]
    _, q, k = _qk(T, 2, 2, head_dim, torch.float16, device, seed=3)
    q_hf, k_hf = qwen2_vl.apply_rotary_pos_emb_vision(q.clone(), k.clone(), cos, sin)
    apply_rotary(q, k, cos, sin)
    assert_close(q, q_hf.double(), rtol=1e-3)
    assert_close(k, k_hf.double(), rtol=1e-3)


def test_apply_rotary_bitwise_across_budgets_and_within_budget(device):
    T, hq, hk, D = 100, 4, 2, 80
    cos, sin = vision_rotary_cos_sin([[1, 2, 18], [1, 4, 16]], D, device=device)
    assert cos.shape[0] == T
    tiles = -(-T // rotary.rotary_config(D, hq)["BLOCK_T"])
    assert tiles > 7
    results = []
    for budget in (1, 3, 7, 132):
        _, q, k = _qk(T, hq, hk, D, torch.float16, device)
        with record_launches() as recs:
            apply_rotary(q, k, cos, sin, num_sms=budget)
        assert_within_budget(recs, budget)
        assert len(recs) == 1 and recs[0].grid == (min(budget, tiles),)
        results.append((q.clone(), k.clone()))
    for q, k in results[1:]:
        assert torch.equal(q, results[0][0]) and torch.equal(k, results[0][1])


def test_apply_rotary_invalid_inputs_raise(device):
    _, q, k = _qk(5, 4, 2, 64, torch.float32, device)
    cos, sin = rope_cos_sin(torch.arange(5, device=device), 64, 1e4)
    bad = [
        (lambda: apply_rotary(q[0], k, cos, sin), "q"),
        (lambda: apply_rotary(q, k[:4], cos, sin), "k"),
        (lambda: apply_rotary(q, k.half(), cos, sin), "k"),
        (lambda: apply_rotary(q, q, cos, sin), "k"),
        (lambda: apply_rotary(q[..., :63], k[..., :63], cos[:, :63], sin[:, :63]), "q"),
        (lambda: apply_rotary(q, k, cos[:4], sin), "cos"),
        (lambda: apply_rotary(q, k, cos, sin.half()), "sin"),
        (lambda: apply_rotary(q.transpose(1, 2), k, cos, sin), "q"),
        (lambda: apply_rotary(q, k, cos, sin, num_sms=0), "num_sms"),
        (lambda: rope_cos_sin(torch.arange(5.0), 64, 1e4), "positions"),
        (lambda: rope_cos_sin(torch.arange(5), 63, 1e4), "head_dim"),
        (lambda: rope_cos_sin(torch.arange(5), 64, -1.0), "theta"),
        (lambda: mrope_cos_sin(torch.zeros(2, 5, dtype=torch.long), 16, 1e6, [2, 3, 3]),
         "positions_3d"),
        (lambda: mrope_cos_sin(torch.zeros(3, 5, dtype=torch.long), 16, 1e6, [2, 3, 4]),
         "mrope_section"),
        (lambda: vision_rotary_cos_sin([[1, 3, 4]], 80), "grid_thw"),
        (lambda: vision_rotary_cos_sin([[1, 4]], 80), "grid_thw"),
        (lambda: vision_rotary_cos_sin([[1, 4, 4]], 78), "head_dim"),
        (lambda: vision_rotary_cos_sin([[1, 4, 4]], 80, spatial_merge_size=0),
         "spatial_merge_size"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
    with record_launches() as recs:  # zero tokens: nothing to launch
        apply_rotary(q[:0], k[:0], cos[:0], sin[:0])
    assert recs == []


def test_compile_specs_cover_every_kernel_argument():
    specs = rotary.compile_specs()
    assert {s.constexprs["HALF"] for s in specs} >= {40, 64}
    for s in specs:
        assert list(s.signature) + list(s.constexprs) == list(s.kernel.arg_names), s.name
        assert not s.expect_wgmma


@pytest.mark.gpu
@pytest.mark.parametrize("D,hq,hk,T", [(80, 16, 16, 1000), (128, 28, 4, 300), (128, 28, 4, 1)])
def test_bf16_on_gpu(D, hq, hk, T):
    dtype = torch.bfloat16
    pos = torch.randint(0, 30000, (3, T), device="cuda")
    cos, sin = mrope_cos_sin(pos, D, 1e6, [D // 8, D // 8 + D // 16, D // 4 - D // 16])
    qkv, q, k = _qk(T, hq, hk, D, dtype, "cuda")
    q_ref, k_ref = ref_apply_rotary(q.double(), k.double(), cos.double(), sin.double())
    results = []
    for budget in (1, 7, 66, None):
        _, q, k = _qk(T, hq, hk, D, dtype, "cuda")
        with record_launches() as recs:
            apply_rotary(q, k, cos, sin, num_sms=budget)
        assert_within_budget(recs)
        results.append((q.clone(), k.clone()))
    for q, k in results[1:]:
        assert torch.equal(q, results[0][0]) and torch.equal(k, results[0][1])
    assert_close(results[0][0], q_ref, dtype)
    assert_close(results[0][1], k_ref, dtype)
