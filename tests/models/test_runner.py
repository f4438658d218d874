"""The engine driving Qwen2VLRunner: chunked prefill, continuous batching, images, greedy
tokens against transformers' generate."""

import pytest
import torch
from conftest import hf_inputs

from spaceserve.models.runner import Qwen2VLRunner
from spaceserve.runtime.engine import Engine, EngineConfig
from spaceserve.runtime.request import SamplingParams

TEXTS = [[1, 17, 33, 8, 91, 4, 56, 70, 12], [1, 5, 64, 27, 88, 3]]


@pytest.mark.parametrize("backend, steps", [("torch", 6), ("triton", 3)])
def test_engine_generates_what_transformers_generates(checkpoints, load, images, backend,
                                                      steps):
    hf = checkpoints["small"][1]
    hf.generation_config.eos_token_id = None
    pixel_values, grid, ids = images
    refs = []
    with torch.no_grad():
        refs.append(hf.generate(**hf_inputs(ids, pixel_values, grid), max_new_tokens=steps,
                                do_sample=False)[0, len(ids):].tolist())
        for t in TEXTS:
            x = torch.tensor([t])
            refs.append(hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                    max_new_tokens=steps, do_sample=False)[0, len(t):].tolist())
    runner = Qwen2VLRunner(load("small", backend), max_model_len=128)
    engine = Engine(runner, EngineConfig(num_kv_blocks=48, block_size=4, max_num_seqs=3,
                                         max_num_batched_tokens=16, max_model_len=128))
    prompts = [{"prompt_token_ids": ids.tolist(), "pixel_values": pixel_values,
                "image_grid_thw": grid}] + [{"prompt_token_ids": t} for t in TEXTS]
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" for o in outs)
    engine.check_idle()


def test_runner_rejects_mismatched_images(load, images):
    from spaceserve.runtime.request import MultiModalData, Request

    runner = Qwen2VLRunner(load("small", "torch"))
    pixel_values, grid, ids = images
    mm = MultiModalData(pixel_values, grid[:2], positions=(ids == 120).nonzero()[:, 0].numpy())
    req = Request("r", 0, ids.tolist(), SamplingParams(), 0, mm)
    with pytest.raises(ValueError, match="image_grid_thw"):
        runner.prepare_request(req)
