"""Model presets: the published shapes, one source for the analytic curves, the simulator,
autotune and the benchmarks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spaceserve.models.presets import PRESETS, get_preset
from spaceserve.runtime.policy.analytic.model import ModelShape, analytic_curves, qwen2_vl_7b_config

# (hidden, layers, q heads, kv heads, intermediate, vocab, tied embeddings) as published
TEXT = {
    "qwen2-vl-2b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2-vl-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen2-vl-72b": (8192, 80, 64, 8, 29568, 152064, False),
    "qwen2.5-vl-3b": (2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-vl-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-vl-72b": (8192, 80, 64, 8, 29568, 152064, False),
    "qwen3-vl-2b": (2048, 28, 16, 8, 6144, 151936, True),
    "qwen3-vl-4b": (2560, 36, 32, 8, 9728, 151936, True),
    "qwen3-vl-8b": (4096, 36, 32, 8, 12288, 151936, False),
    "qwen3-vl-32b": (5120, 64, 64, 8, 25600, 151936, False),
}
# Qwen3-VL's vision towers: (depth, width, MLP, DeepStack taps)
QWEN3_VISION = {"qwen3-vl-2b": (24, 1024, 4096, (5, 11, 17)),
                "qwen3-vl-4b": (24, 1024, 4096, (5, 11, 17)),
                "qwen3-vl-8b": (27, 1152, 4304, (8, 16, 24)),
                "qwen3-vl-32b": (27, 1152, 4304, (8, 16, 24))}


@pytest.mark.parametrize("key", sorted(TEXT))
def test_published_shapes(key: str) -> None:
    p = PRESETS[key]
    t, v = p.text, p.vision
    assert (t.hidden, t.layers, t.heads, t.kv_heads, t.intermediate, t.vocab,
            t.tied_embeddings) == TEXT[key]
    if p.family == "qwen3_vl":  # 128-wide heads whatever the width; 16-px patches; DeepStack
        assert (t.head_dim, t.mrope_section, t.mrope_interleaved) == (128, (24, 20, 20), True)
        assert (v.depth, v.embed, v.intermediate, v.deepstack) == QWEN3_VISION[key]
        assert (v.heads, v.patch_size, v.merge, v.out_hidden, v.gated, v.window_size) == \
            (16, 16, 2, t.hidden, False, 0)
        assert v.patch_dim == 3 * 2 * 16 * 16 and max(v.deepstack) < v.depth
        return
    assert t.head_dim == t.hidden // t.heads
    assert (v.depth, v.embed, v.heads, v.patch_size, v.merge, v.out_hidden) == \
        (32, 1280, 16, 14, 2, t.hidden)
    if p.family == "qwen2_vl":
        assert (v.mlp_ratio, v.gated, v.window_size) == (4, False, 0)
    else:
        assert (v.intermediate, v.gated, v.window_size, v.fullatt_blocks) == \
            (3420, True, 112, (7, 15, 23, 31))


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_shape_from_preset_is_the_shape_of_its_transformers_config(key: str) -> None:
    """The simulator reads a preset directly; the figures must be those of its config."""
    p = PRESETS[key]
    config = p.hf_config()
    assert ModelShape.from_preset(p) == ModelShape.from_config(config, p.name)
    assert config.tie_word_embeddings is p.text.tied_embeddings
    assert config.text_config.vocab_size == p.text.vocab


def test_qwen3_vl_costs_its_deepstack_mergers_and_qk_norm() -> None:
    """The 8B's shape from its config carries 3 DeepStack mergers, the position table and the
    q/k norm, and each adds cost: the same shape without them is cheaper."""
    import dataclasses

    from spaceserve.runtime.policy.analytic.model import PRESETS as DEVICES
    from spaceserve.runtime.policy.analytic.model import Roofline, qwen3_vl_8b_config

    shape = ModelShape.from_config(qwen3_vl_8b_config(), "Qwen3-VL-8B")
    assert (shape.vision_deepstack, shape.vision_pos_embed, shape.qk_norm) == (3, True, True)
    assert (shape.vision_gated, shape.vision_window, shape.head_dim) == (False, 0, 128)
    plain = dataclasses.replace(shape, vision_deepstack=0, vision_pos_embed=False, qk_norm=False)
    full, bare = Roofline(shape, DEVICES["H200"]), Roofline(plain, DEVICES["H200"])
    assert full.encoder_layer(4096, 132) > bare.encoder_layer(4096, 132)
    assert full.prefill(1024, 0, 132) > bare.prefill(1024, 0, 132)
    assert full.decode(32, 1024, 132) > bare.decode(32, 1024, 132)


def test_default_curves_are_the_7b_configs() -> None:
    assert analytic_curves().to_dict() == \
        analytic_curves(qwen2_vl_7b_config(), name="Qwen2-VL-7B").to_dict()


def test_unknown_preset_names_the_choices() -> None:
    assert get_preset("Qwen2-VL-7B") is PRESETS["qwen2-vl-7b"]
    with pytest.raises(ValueError, match="unknown 'qwen3-vl'.*qwen2-vl-2b"):
        get_preset("qwen3-vl")


def test_presets_import_neither_torch_nor_transformers() -> None:
    code = ("import sys, spaceserve.models.presets, spaceserve.runtime.sim.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_sim_models_are_the_presets() -> None:
    from spaceserve.runtime.sim.cli import build_parser

    action = next(a for a in build_parser()._actions if "--model" in a.option_strings)
    assert list(action.choices) == sorted(PRESETS)
