"""Vision encoder: parity with transformers, preemption, SM budgets, invalid input.

The one-shot whole-device embeddings of the test images come from the session's `encoded`
fixture (one interpreted pass per model, shared with the language tests): checked against
transformers here, and the reference the preempted and budgeted passes must equal bitwise."""

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_close, assert_within_budget

CASES = [("small", "torch"), ("wide", "torch"), ("small", "triton"), ("wide", "triton")]


@pytest.fixture(scope="module")
def references(checkpoints, images):
    """fp64 vision tower outputs of transformers for the three images."""
    pixel_values, grid, _ = images
    out = {}
    for name, (_, hf) in checkpoints.items():
        visual = hf.model.visual.double()
        with torch.no_grad():
            out[name] = visual(pixel_values.double(), grid_thw=grid).pooler_output
        visual.float()
    return out


@pytest.mark.parametrize("name, backend", CASES)
def test_encode_images_matches_transformers(load, encoded, images, references, name, backend):
    model = load(name, backend)
    pixel_values, grid, _ = images
    out = encoded(name, backend)
    assert out.shape == (int(grid.prod(-1).sum()) // 4, model.config.text_config.hidden_size)
    assert_close(out, references[name], rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_preempted_jobs_equal_full_runs(load, encoded, images, backend):
    """Two jobs, chunked differently and interleaved, give bitwise the one-shot embeddings."""
    model = load("small", backend)
    pixel_values, grid, _ = images
    full = encoded("small", backend)
    vis = model.vision
    a = vis.start(pixel_values, grid)
    b = vis.start(pixel_values, grid)
    assert (a.layers_done, a.remaining_layers, a.done) == (0, 2, False)
    assert a.num_patches == pixel_values.shape[0] and a.num_tokens == full.shape[0]
    assert a.tokens_per_image == [int(g.prod()) // 4 for g in grid]
    assert vis.advance(a, 1) == 1
    with pytest.raises(ValueError, match="advance"):
        vis.finish(a)
    assert vis.advance(b, 5) == 2 and b.done
    assert vis.advance(a, 0) == 0 and a.remaining_layers == 1
    assert vis.advance(a, 1) == 1 and a.done
    assert vis.advance(a, 1) == 0
    assert torch.equal(vis.finish(b), full)
    assert torch.equal(vis.finish(a), full)


def test_vision_pass_stays_under_encoder_budget(load, encoded, images):
    model = load("small", "triton")
    pixel_values, grid, _ = images
    with record_launches() as rec:
        small = model.encode_images(pixel_values, grid, num_sms=3)
    assert_within_budget(rec, 3)
    assert all(r.num_sms == 3 for r in rec)
    names = {r.name for r in rec}
    assert {"linear", "layer_norm", "rotary", "vit_attention"} <= names
    assert max(r.programs for r in rec) == 3  # the budget is really used, not just respected
    assert torch.equal(small, encoded("small", "triton"))  # any budget, same bits


def test_triton_ops_are_all_kernels(load):
    from spaceserve.models.attention.backends import TritonBackend
    from spaceserve.models.ops import TritonOps

    model = load("small", "triton")
    assert isinstance(model.ops, TritonOps) and isinstance(model.backend, TritonBackend)


@pytest.mark.parametrize("mutate, match", [
    (lambda pv, g: (pv[:-1], g), "pixel_values"),
    (lambda pv, g: (pv[:, :-2], g), "pixel_values"),
    (lambda pv, g: (pv, g[:, :2]), "image_grid_thw"),
    (lambda pv, g: (pv, torch.tensor([[1, 3, 4]] * 3)), "image_grid_thw"),
    (lambda pv, g: (pv, g[:0]), "image_grid_thw"),
    (lambda pv, g: (pv[None], g), "pixel_values"),
])
def test_bad_inputs_raise(load, images, mutate, match):
    model = load("small", "torch")
    pixel_values, grid, _ = images
    pv, g = mutate(pixel_values, grid)
    with pytest.raises(ValueError, match=match):
        model.encode_images(pv, g)


def test_bad_budget_raises(load, images):
    model = load("small", "torch")
    pixel_values, grid, _ = images
    with pytest.raises(ValueError, match="num_sms"):
        model.encode_images(pixel_values, grid, num_sms=0)
