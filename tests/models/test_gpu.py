"""CUDA checks: bf16 parity of both stages and decode steps replayed from CUDA graphs."""

import pytest
import torch

from spaceserve.kernels.testing import assert_close
from spaceserve.models import DecodeGraph, from_state_dict

from .conftest import IMAGE, VEND, VSTART, tiny_config

pytestmark = pytest.mark.gpu


def test_bf16_stages_and_decode_graphs():
    from transformers import Qwen2VLForConditionalGeneration

    dev = torch.device("cuda")
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(tiny_config("wide")).to(dev).eval()
    model = from_state_dict(hf.config, hf.state_dict(), attention_backend="triton",
                            dtype=torch.bfloat16, device=dev)
    grid = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 1176, device=dev)
    with torch.no_grad():
        ref = hf.model.visual(pixel_values, grid_thw=grid.to(dev)).pooler_output
    embeds = model.encode_images(pixel_values.bfloat16(), grid, num_sms=16)
    assert_close(embeds, ref, rtol=2e-2)

    ids = [1, 7] + [VSTART] + [IMAGE] * 6 + [VEND, 9] + [VSTART] + [IMAGE] * 8 + [VEND, 4, 5]
    ids = torch.tensor(ids, device=dev)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids[None], pixel_values=pixel_values,
                       image_grid_thw=grid.to(dev),
                       mm_token_type_ids=(ids[None] == IMAGE).int()).logits[0, -1]
    positions, delta = model.mrope_positions(ids.cpu(), grid)
    bs, width = 16, 4
    cache = model.allocate_kv_cache(32, bs)
    tables = [[3, 9, 1, 4], [5, 0, 7, 2], [8, 6, 10, 11]]
    prompts = [ids, torch.tensor([1, 5, 9, 13, 17], device=dev),
               torch.tensor([1, 2, 3], device=dev)]
    ctx = model.plan_step([0, 0, 0], [len(p) for p in prompts], tables, block_size=bs,
                          mrope_positions=[positions, None, None], rope_deltas=[delta, 0, 0])
    logits = model.forward(torch.cat(prompts), ctx, cache, image_embeds=embeds, num_sms=24)
    assert_close(logits[0], hf_logits, rtol=3e-2)

    graph = DecodeGraph(model, cache, 4, width, num_sms=32)
    lens = [len(p) for p in prompts]
    for step in range(3):
        seqs = [0, 1, 2] if step != 1 else [2, 0]  # batch sizes 3 and 2 inside the bucket of 4
        gctx = graph.plan([lens[s] for s in seqs], [tables[s] for s in seqs],
                          rope_deltas=[delta if s == 0 else 0 for s in seqs])
        ectx = model.plan_step([lens[s] for s in seqs], [1] * len(seqs),
                               [tables[s] for s in seqs], block_size=bs,
                               rope_deltas=[delta if s == 0 else 0 for s in seqs])
        inp = torch.arange(len(seqs), device=dev) + 10 * step + 20
        eager = model.forward(inp, ectx, cache, num_sms=32)
        replayed = graph.replay(inp, gctx).clone()
        assert torch.equal(replayed, eager)
        for s in seqs:
            lens[s] += 1
