"""Loading: checkpoint layouts, random weights from a config, backend selection, bad input."""

import json
import os

import pytest
import torch

from spaceserve.models import (
    available_backends,
    from_config,
    from_pretrained,
    from_state_dict,
    known_backends,
    weight_shapes,
)
from spaceserve.models.loading.loader import canonical_name

from .conftest import tiny_config


def test_weight_shapes_cover_the_transformers_model(checkpoints):
    """Every tensor transformers has is named and shaped as `weight_shapes` says, both in the
    saved (hub) layout and in the in-memory (5.x) layout."""
    from safetensors import safe_open

    path, hf = checkpoints["wide"]
    shapes = weight_shapes(hf.config)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert saved == shapes
    live = {canonical_name(k): tuple(v.shape) for k, v in hf.state_dict().items()}
    assert live == {canonical_name(k): v for k, v in shapes.items()}


def test_state_dict_layouts_agree(checkpoints, load, images):
    """transformers' in-memory keys (model.language_model.*, model.visual.*) load the same."""
    path, hf = checkpoints["small"]
    pixel_values, grid, _ = images
    ours = from_state_dict(hf.config, hf.state_dict(), attention_backend="torch")
    ref = load("small", "torch")
    assert torch.equal(ours.encode_images(pixel_values, grid), ref.encode_images(pixel_values,
                                                                                 grid))


def test_from_config_random_weights(images):
    cfg = tiny_config("small")
    a = from_config(cfg, attention_backend="torch", seed=3)
    b = from_config(cfg.to_dict(), attention_backend="torch", seed=3)
    pixel_values, grid, _ = images
    ea, eb = a.encode_images(pixel_values, grid), b.encode_images(pixel_values, grid)
    assert torch.isfinite(ea).all() and torch.equal(ea, eb)
    assert a.dtype == torch.float32 and a.language.lm_head.shape == (128, 64)
    c = from_config(cfg, attention_backend="torch", seed=4, dtype=torch.float16)
    assert c.language.embed.dtype == torch.float16


def test_dtype_and_tied_embeddings(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    cfg = tiny_config("small")
    cfg.tie_word_embeddings = True
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, attention_backend="torch", dtype=torch.float16)
    assert model.dtype == torch.float16 and model.language.embed.dtype == torch.float16
    assert torch.equal(model.language.lm_head, model.language.embed)


def test_available_and_unknown_backends(checkpoints):
    assert {"triton", "torch"} <= set(available_backends()) <= set(known_backends())
    assert {"flash_attn", "flashinfer"} <= set(known_backends())
    with pytest.raises(ValueError, match="known backends: triton, torch"):
        from_pretrained(checkpoints["small"][0], attention_backend="xformers")


def _write_config(path, **fields):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fields, f)


def test_unsupported_architecture_raises(tmp_path):
    _write_config(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="llama.*LlamaForCausalLM.*not supported"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        from_config({"model_type": "glm4v"})


def test_missing_files_and_tensors_raise(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "nowhere")
    src = checkpoints["small"][0]
    with open(os.path.join(src, "config.json")) as f:
        _write_config(tmp_path, **json.load(f))
    with pytest.raises(ValueError, match="safetensors"):
        from_pretrained(tmp_path, attention_backend="torch")
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["visual.blocks.1.mlp.fc2.bias"]
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match="visual.blocks.1.mlp.fc2.bias"):
        from_pretrained(tmp_path, attention_backend="torch")


def test_image_processor_feeds_the_encoder(load):
    import numpy as np

    model = load("small", "torch")
    batch = model.image_processor()(images=[np.zeros((70, 100, 3), dtype=np.uint8)],
                                    return_tensors="pt")
    grid = batch["image_grid_thw"]
    out = model.encode_images(batch["pixel_values"], grid)
    assert out.shape == (int(grid.prod()) // 4, model.config.text_config.hidden_size)


def test_only_graph_capturable_backends_get_decode_graphs():
    """A backend that plans in Python per step (flashinfer) is never captured in a graph."""
    from spaceserve.models.attention.backends import AttentionBackend, TritonBackend
    from spaceserve.models.attention.library import FlashAttnBackend, FlashInferBackend
    from spaceserve.models.step.cuda_graph import DecodeGraph

    assert AttentionBackend.graph_capturable and TritonBackend.graph_capturable
    assert FlashAttnBackend.graph_capturable and not FlashInferBackend.graph_capturable

    class Model:  # just what DecodeGraph checks before anything else
        device = torch.device("cuda")
        backend = FlashInferBackend.__new__(FlashInferBackend)

    with pytest.raises(ValueError, match="flashinfer.*CUDA graph"):
        DecodeGraph(Model(), None, 1, 1)
