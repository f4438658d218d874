"""Qwen2.5-VL in the cost model: its shape, window blocks costed per window, and the curves
TWSRFT and SIS read."""

import dataclasses

import pytest

from spaceserve.runtime.policy.analytic.model import (
    PRESETS,
    ModelShape,
    Roofline,
    analytic_curves,
    qwen2_5_vl_7b_config,
    qwen2_vl_7b_config,
)
from spaceserve.runtime.policy.twsrft import curve_cost

P1080 = 4 * 2691  # ViT patches of a 1920x1080 image


@pytest.fixture(scope="module")
def shapes():
    return (ModelShape.from_config(qwen2_vl_7b_config()),
            ModelShape.from_config(qwen2_5_vl_7b_config(), "Qwen2.5-VL-7B"))


def test_qwen2_5_vl_7b_shape(shapes):
    old, s = shapes
    assert (s.vision_depth, s.vision_embed, s.vision_heads, s.vision_mlp) == (32, 1280, 16, 3420)
    assert (s.vision_out, s.merge, s.patch_dim, s.vision_gated) == (3584, 2, 1176, True)
    # 112 px windows = 4x4 merged tokens = 64 patches; blocks 7, 15, 23, 31 attend fully
    assert (s.vision_window, s.vision_window_layers) == (64, 28)
    assert (s.text_layers, s.hidden, s.heads, s.kv_heads, s.head_dim) == (28, 3584, 28, 4, 128)
    assert (old.vision_window, old.vision_window_layers) == (0, 0)


def test_window_blocks_cost_per_window(shapes):
    _, s = shapes
    dev = PRESETS["H200"]
    mixed = Roofline(s, dev)
    full = Roofline(dataclasses.replace(s, vision_window_layers=0), dev)
    # a window as large as the image is full attention
    whole = Roofline(dataclasses.replace(s, vision_window=10 ** 7), dev)
    for p in (64, 1024, P1080, 42196):
        for sms in (16, 66, 132):
            assert whole.encoder_layer(p, sms) == pytest.approx(full.encoder_layer(p, sms))
            assert mixed.encoder_layer(p, sms) <= full.encoder_layer(p, sms)
    # full attention is quadratic in the patches; 28 of 32 blocks are not, so quadrupling the
    # image roughly quadruples the Qwen2.5-VL pass but grows the all-full pass far more
    grow_mixed = mixed.encoder_layer(4 * P1080, 132) / mixed.encoder_layer(P1080, 132)
    grow_full = full.encoder_layer(4 * P1080, 132) / full.encoder_layer(P1080, 132)
    assert grow_mixed < 0.75 * grow_full
    assert mixed.encoder_layer(P1080, 132) < 0.7 * full.encoder_layer(P1080, 132)
    # fewer window blocks never cost less
    fewer = Roofline(dataclasses.replace(s, vision_window_layers=16), dev)
    assert mixed.encoder_layer(P1080, 66) < fewer.encoder_layer(P1080, 66) < \
        full.encoder_layer(P1080, 66)


def test_curves_and_twsrft_cost_know_the_mix():
    old = analytic_curves(device="H200")
    new = analytic_curves(qwen2_5_vl_7b_config(), "H200", name="Qwen2.5-VL-7B")
    assert new.encoder_depth == 32
    cost_old, cost_new = curve_cost(old, 66), curve_cost(new, 66)
    # a 1080p pass: tens of ms either way, Qwen2.5-VL's clearly cheaper (window attention)
    assert 0.01 < cost_new(P1080, 32) < 0.7 * cost_old(P1080, 32) < 0.2
    # remaining work is per layer and grows with the image
    assert cost_new(P1080, 16) == pytest.approx(cost_new(P1080, 32) / 2)
    assert cost_new(1024, 32) < cost_new(P1080, 32) < cost_new(4 * P1080, 32)
