"""Qwen3-VL through the engine: greedy tokens equal transformers' for text, one image, two
images of different sizes and a timestamped video, in temporal, temporal-chunked and spatial
modes, with chunked prefill cutting through the media tokens, under preemption, and with a
prefix-cache hit on the second turn (the cached prefix's KV already holds the DeepStack adds)."""

from __future__ import annotations

import pytest
import torch

from spaceserve import Engine, SamplingParams

from . import qwen3_ref as ref

GREEDY = SamplingParams(max_tokens=ref.STEPS, temperature=0.0, ignore_eos=True)
FAST = dict(device="cpu", attention_backend="torch", block_size=4, num_kv_blocks=64,
            encoder_window_s=1e-9)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.set_num_threads(1)
    path, hf = ref.build(tmp_path_factory.mktemp("qwen3vl_engine"), tied=False)
    prompts = ref.prompts(hf.config)
    return path, hf, prompts, [ref.hf_greedy(hf, p) for p in prompts]


def _tokens(outs) -> list[list[int]]:
    assert [o.error for o in outs] == [None] * len(outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode, extra", [
    ("temporal", {}),
    ("temporal-chunked", {}),
    ("spatial", {}),
    ("spatial", dict(max_num_batched_tokens=8)),  # prefill chunks cut through media tokens
    ("temporal", dict(max_num_batched_tokens=8, num_kv_blocks=14)),  # + preemption
])
def test_engine_greedy_equals_transformers(case, mode, extra):
    path, _, prompts, expected = case
    engine = Engine.from_pretrained(path, mode=mode, **{**FAST, **extra})
    outs = engine.generate(prompts, GREEDY)
    assert _tokens(outs) == expected
    if "num_kv_blocks" in extra:
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
    engine.check_idle()


def test_second_turn_hits_the_prefix_cache(case):
    path, hf, prompts, expected = case
    engine = Engine.from_pretrained(path, **FAST)
    for first, out in zip(prompts[1:], expected[1:], strict=True):  # image, images, video
        assert _tokens(engine.generate([first], GREEDY)) == [out]
        second = dict(first, prompt_token_ids=first["prompt_token_ids"] + out + [60, 61])
        before = engine.counters()["prefix_cache_hit_tokens"]
        got = _tokens(engine.generate([second], GREEDY))
        hit = engine.counters()["prefix_cache_hit_tokens"] - before
        media = [i for i, t in enumerate(first["prompt_token_ids"])
                 if t in (hf.config.image_token_id, hf.config.video_token_id)]
        assert hit > media[-1], "the cached prefix does not cover the media tokens"
        assert got == [ref.hf_greedy(hf, second)]
    engine.check_idle()


def test_encoder_cache_entries_hold_every_feature(case):
    """With the prefix cache off, a repeated image or video takes its rows - embeddings and
    DeepStack features - from the encoder cache alone, and the tokens stay transformers'."""
    path, hf, prompts, expected = case
    engine = Engine.from_pretrained(path, enable_prefix_caching=False, **FAST)
    assert _tokens(engine.generate(prompts, GREEDY)) == expected
    jobs = engine.counters()["encoder_jobs"]
    tokens = (6) + (6 + 8) + 12  # one image, two images, a 3-patch 4x4 video
    row = 3 * hf.config.text_config.hidden_size * 4  # embeddings + 2 taps, fp32
    assert engine.encoder_cache.bytes_cached == tokens * row
    hits = engine.counters()["encoder_cache_hits"]
    assert _tokens(engine.generate(prompts[::-1], GREEDY)) == expected[::-1]
    assert engine.counters()["encoder_jobs"] == jobs  # no encoder pass the second time
    assert engine.counters()["encoder_cache_hits"] - hits == 4  # 1 + 2 images, 1 video
    engine.check_idle()
