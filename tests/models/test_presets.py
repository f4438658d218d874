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
}


@pytest.mark.parametrize("key", sorted(TEXT))
def test_published_shapes(key: str) -> None:
    p = PRESETS[key]
    t, v = p.text, p.vision
    assert (t.hidden, t.layers, t.heads, t.kv_heads, t.intermediate, t.vocab,
            t.tied_embeddings) == TEXT[key]
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
