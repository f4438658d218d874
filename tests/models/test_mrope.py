"""M-RoPE positions and the decode-time delta against transformers' get_rope_index."""

import pytest
import torch

from spaceserve.models import mrope_positions, text_positions

from .conftest import BOS, IMAGE, VEND, VSTART, tiny_config


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2VLModel

    torch.manual_seed(0)
    return Qwen2VLModel(tiny_config("small")).eval()


def _prompt(grids, text_before=2, between=(3, 1), after=4):
    ids = [BOS] + list(range(5, 5 + text_before))
    for j, (t, h, w) in enumerate(grids):
        ids += [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND]
        ids += list(range(20 + j, 20 + j + between[j % len(between)]))
    return torch.tensor(ids + list(range(40, 40 + after)))


LAYOUTS = {
    "three_images": ([[1, 4, 4], [1, 4, 6], [1, 8, 4]], {}),
    "wide_and_tall": ([[1, 2, 10], [1, 12, 2]], {}),
    "image_first": ([[1, 6, 6]], {"text_before": 0}),
    "adjacent_images": ([[1, 4, 4], [1, 2, 2]], {"between": (0,)}),
    "ends_with_image": ([[1, 4, 2]], {"after": 0, "between": (0,)}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_positions_and_delta_match_transformers(hf_model, layout):
    grids, kw = LAYOUTS[layout]
    ids = _prompt(grids, **kw)
    grid = torch.tensor(grids)
    ref, ref_delta = hf_model.get_rope_index(ids[None], (ids[None] == IMAGE).int(),
                                             image_grid_thw=grid)
    pos, delta = mrope_positions(ids, grid, hf_model.config)
    assert pos.dtype == torch.long and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref[:, 0])
    assert delta == int(ref_delta)
    assert delta <= 0  # an image advances positions by at most its token count


def test_text_only_prompt_is_plain_rope(hf_model):
    ids = torch.arange(3, 20)
    pos, delta = mrope_positions(ids, None, hf_model.config)
    assert delta == 0
    assert torch.equal(pos, torch.arange(17).expand(3, 17))


def test_decode_positions_match_transformers(hf_model):
    """After the prompt, transformers places new tokens at cache index + delta on all rows."""
    from transformers import DynamicCache

    grids = [[1, 4, 6], [1, 8, 4]]
    ids = _prompt(grids)
    grid = torch.tensor(grids)
    _, hf_delta = hf_model.get_rope_index(ids[None], (ids[None] == IMAGE).int(),
                                          image_grid_thw=grid)
    hf_model.rope_deltas = hf_delta
    cfg = hf_model.config.text_config
    cache = DynamicCache(config=cfg)
    d = cfg.hidden_size // cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):
        kv = torch.zeros(1, cfg.num_key_value_heads, len(ids), d)
        cache.update(kv, kv, layer)
    # The cache goes in by position: transformers 5.17 names it `past_key_values`, 5.24 `cache`.
    ref = hf_model.compute_3d_position_ids(None, torch.zeros(1, 3, 64), None, None, None, cache)
    _, delta = mrope_positions(ids, grid, hf_model.config)
    assert torch.equal(text_positions(len(ids), 3, delta), ref[:, 0])


def test_mismatched_grids_raise(hf_model):
    cfg = hf_model.config
    ids = _prompt([[1, 4, 4]])
    with pytest.raises(ValueError, match="image_grid_thw"):
        mrope_positions(ids, [[1, 4, 6]], cfg)  # 6 tokens expected, 4 present
    with pytest.raises(ValueError, match="image_grid_thw"):
        mrope_positions(ids, [[1, 4, 4], [1, 2, 2]], cfg)  # a grid with no image run
    with pytest.raises(ValueError, match="image_grid_thw"):
        mrope_positions(ids, None, cfg)  # an image run with no grid
    with pytest.raises(ValueError, match="input_ids"):
        mrope_positions(ids[None], [[1, 4, 4]], cfg)
