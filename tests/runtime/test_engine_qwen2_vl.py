"""The engine with the Qwen2-VL runner on a tiny checkpoint: greedy outputs equal transformers'
generate, also under chunked prefill, batching with images and preemption by recompute."""

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_within_budget

IMAGE, VIDEO, VSTART, VEND, EOS, BOS = 120, 121, 122, 123, 2, 1
MAX_TOKENS = 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, transformers model) of a tiny random Qwen2-VL saved with save_pretrained."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=EOS, bos_token_id=BOS,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)
    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("qwen2vl_engine")
    hf.save_pretrained(path)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # always MAX_TOKENS, as ignore_eos does
    return path, hf


@pytest.fixture(scope="module")
def prompts():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(0)
    proc = Qwen2VLImageProcessorPil()
    out = [{"prompt_token_ids": [BOS, 17, 33, 8, 91]}]
    for sizes in ([(56, 56)], [(56, 84), (28, 56)]):
        pics = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        batch = proc(images=pics, return_tensors="pt")
        ids = [BOS, 7]
        for j, (t, h, w) in enumerate(batch["image_grid_thw"].tolist()):
            ids += [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND, 10 + j]
        out.append({"prompt_token_ids": ids, "pixel_values": batch["pixel_values"],
                    "image_grid_thw": batch["image_grid_thw"]})
    out.append({"prompt_token_ids": [BOS, 5, 64, 27, 88, 3, 44, 45, 46, 47, 48]})
    return out


def reference(hf, prompt) -> list[int]:
    ids = torch.tensor([prompt["prompt_token_ids"]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
              mm_token_type_ids=(ids == IMAGE).int())
    if "pixel_values" in prompt:
        kw.update(pixel_values=prompt["pixel_values"], image_grid_thw=prompt["image_grid_thw"])
    with torch.no_grad():
        out = hf.generate(**kw, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    return [reference(checkpoint[1], p) for p in prompts]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_generate_matches_transformers(checkpoint, prompts, expected) -> None:
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=64, block_size=4)
    assert engine.runner.info.eos_token_ids == (EOS,)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    engine.check_idle()


def test_chunks_batching_and_preemption_keep_the_tokens(checkpoint, prompts, expected) -> None:
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=14, block_size=4, max_num_batched_tokens=8)
    outs = engine.generate(prompts[::-1], GREEDY)
    assert [o.token_ids for o in outs] == expected[::-1]
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
    engine.check_idle()


def test_triton_backend_matches_under_stage_budgets(checkpoint, prompts, expected) -> None:
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="triton", device="cpu",
                                    num_kv_blocks=32, block_size=4)
    engine.runner.encoder_num_sms, engine.runner.decoder_num_sms = 8, 20
    with record_launches() as launches:
        outs = engine.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0.0,
                                                           ignore_eos=True))
    assert [o.token_ids for o in outs] == [e[:3] for e in expected[:2]]
    assert_within_budget(launches, 20)
    assert {r.num_sms for r in launches} == {8, 20}
    assert {r.name for r in launches if r.num_sms == 8} & {"vit_attention"}


def test_bad_image_input_fails_alone(checkpoint, prompts, expected) -> None:
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=64, block_size=4)
    bad = dict(prompts[1])
    bad["pixel_values"] = bad["pixel_values"][:, :100]  # wrong patch width
    outs = engine.generate([prompts[0], bad], GREEDY)
    assert outs[0].token_ids == expected[0]
    assert outs[1].finish_reason == "error" and "1176" in outs[1].error


def test_generated_image_token_beside_an_image_chunk(checkpoint, prompts, expected) -> None:
    # prompts[1] emits the image token id first; with a 10-token budget its decode of that
    # token shares a step with the image tokens of prompts[2]'s second prefill chunk.
    assert expected[1][0] == IMAGE
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=64, block_size=4, max_num_batched_tokens=10)
    outs = engine.generate(prompts[1:3], GREEDY)
    assert [o.token_ids for o in outs] == expected[1:3]


@pytest.mark.gpu
def test_cuda_engine_with_decode_graphs_matches_transformers(checkpoint, prompts,
                                                              expected) -> None:
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="triton", device="cuda",
                                    dtype=torch.float32, block_size=16, max_num_seqs=8,
                                    gpu_memory_utilization=0.05, graph_reserve_bytes=1 << 28,
                                    max_encoder_tokens_per_step=256)
    assert engine.memory.source == "profiled" and engine.memory.num_blocks > 64
    assert engine.graph_batch_sizes == (1, 2, 4, 8)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    engine.check_idle()
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7,
                             ignore_eos=True)
    alone = [engine.generate(p, sampled)[0].token_ids for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, sampled)] == alone
