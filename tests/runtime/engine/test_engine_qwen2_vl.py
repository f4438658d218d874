"""The engine with the Qwen2-VL runner on a tiny checkpoint: greedy outputs equal transformers'
generate, also under chunked prefill, batching with images and preemption by recompute."""

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_within_budget

IDS = (120, 121, 122, 123, 2, 1)  # image, video, vision start, vision end, eos, bos
IMAGE, _, _, _, EOS, BOS = IDS
MAX_TOKENS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen2_vl):
    """(path, transformers model) of a tiny random Qwen2-VL saved with save_pretrained."""
    return tiny_qwen2_vl("qwen2vl_engine", IDS, seed=0, intermediate_size=128, depth=2,
                         num_heads=4)


@pytest.fixture(scope="module")
def prompts(qwen2_vl_image_prompt):
    rng = np.random.default_rng(0)
    out = [{"prompt_token_ids": [BOS, 17, 33, 8, 91]}]
    for sizes in ([(56, 56)], [(56, 84), (28, 56)]):
        out.append(qwen2_vl_image_prompt(rng, sizes, [BOS, 7], 10, IDS))
    out.append({"prompt_token_ids": [BOS, 5, 64, 27, 88, 3, 44, 45, 46, 47, 48]})
    return out


@pytest.fixture(scope="module")
def expected(checkpoint, prompts, hf_greedy):
    return [hf_greedy(checkpoint[1], p, MAX_TOKENS) for p in prompts]


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


def test_triton_backend_matches_under_stage_budgets(checkpoint, prompts, expected,
                                                   monkeypatch) -> None:
    monkeypatch.setenv("SPACESERVE_NUM_SMS", "28")  # the split 8 leaves the decoder 20 SMs
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="triton", device="cpu",
                                    num_kv_blocks=32, block_size=4, mode="spatial-static",
                                    encoder_sms=8)
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


def test_multi_turn_reuses_blocks_and_embeddings(checkpoint, prompts, expected, hf_greedy,
                                                  qwen2_vl_image_prompt) -> None:
    """The second turn of a two-image conversation (the first turn, its answer and a new
    question) runs no encoder job and prefills only what the prefix cache lacks, yet equals
    transformers' greedy tokens for the whole prompt: M-RoPE positions (the images' 3-D ones,
    then the text's shifted by the rope delta) are right past the reused blocks. A prompt with
    the first image and another second one encodes only the new image."""
    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=64, block_size=4)
    turn1 = prompts[2]
    (out1,) = engine.generate([turn1], GREEDY)
    assert out1.token_ids == expected[2]
    ids1 = turn1["prompt_token_ids"] + out1.token_ids
    turn2 = dict(turn1, prompt_token_ids=ids1 + [5, 64, 27])
    before = engine.counters()
    seen: dict[int, list[int]] = {}  # token index -> its M-RoPE position column, as run
    plan = engine.runner.planner.core.plan

    def spy(rows, cached, new, **kw):
        ctx = plan(rows, cached, new, **kw)
        cols = ctx.positions[:, :int(sum(new))].T.tolist()
        seen.update(zip(range(int(cached[0]), int(cached[0]) + int(new[0])), cols, strict=True))
        return ctx

    engine.runner.planner.core.plan = spy
    (out2,) = engine.generate([turn2], GREEDY)
    engine.runner.planner.core.plan = plan
    assert out2.token_ids == hf_greedy(checkpoint[1], turn2, MAX_TOKENS)
    full, delta = engine.runner.model.mrope_positions(turn2["prompt_token_ids"],
                                                      turn2["image_grid_thw"])
    want = {i: (full[:, i].tolist() if i < full.shape[1] else [i + delta] * 3) for i in seen}
    assert min(seen) > 0 and seen == want  # computed from mid-prompt, positions as if cold
    d = {k: v - before[k] for k, v in engine.counters().items()}
    hit = (len(ids1) - 1) // 4 * 4  # the last generated token was never computed
    assert d["prefix_cache_hit_tokens"] == hit and d["prefill_tokens"] == len(ids1) + 3 - hit
    assert d["encoder_jobs"] == 0 and d["encoder_cache_hits"] == d["encoder_cache_queries"] == 2
    # the first image again, another second one (same size): only that one is encoded
    other = qwen2_vl_image_prompt(np.random.default_rng(9), [(28, 56)], [], 0, IDS)
    n1 = int(turn1["image_grid_thw"][0].prod())
    mixed = dict(turn1, pixel_values=torch.cat([turn1["pixel_values"][:n1],
                                                other["pixel_values"]]))
    before = engine.counters()
    (out3,) = engine.generate([mixed], GREEDY)
    assert out3.token_ids == hf_greedy(checkpoint[1], mixed, MAX_TOKENS)
    d = {k: v - before[k] for k, v in engine.counters().items()}
    assert d["encoder_jobs"] == 1
    assert (d["encoder_cache_queries"], d["encoder_cache_hits"]) == (2, 1)
    assert d["prefix_cache_hit_tokens"] > 0
    engine.check_idle()


def test_decode_steps_take_the_narrowest_graph_bucket(checkpoint, prompts, expected) -> None:
    """Graphs are eager on CPU: a stand-in 'graph' runs the step it is handed, so the runner's
    bucket choice and the planner's padding run as on a GPU, and the tokens stay the same."""
    from spaceserve.models import DecodeGraphSet

    engine = Engine.from_pretrained(checkpoint[0], attention_backend="torch", device="cpu",
                                    num_kv_blocks=64, block_size=4,
                                    graph_context_lens=(16, 32, 10_000))
    runner = engine.runner
    assert runner.limits.max_blocks_per_seq == 64 and runner.graphs.widths == (4, 8, 64)
    seen = []

    class Replayed:
        def __init__(self, model, kv, batch_size, width, *, num_sms, planner, pool, out):
            self.batch_size, self.max_blocks_per_seq, self.memory_bytes = batch_size, width, 0
            self.model, self.kv, self.num_sms = model, kv, num_sms

        def replay(self, input_ids, ctx):
            need = -(-int(ctx.host.seq_lens.max()) // ctx.block_size)
            seen.append((tuple(ctx.block_tables.shape), need))
            assert ctx.num_seqs == self.batch_size
            logits = self.model.forward(input_ids, ctx, self.kv, num_sms=self.num_sms)
            return logits[:ctx.num_real_seqs]

    runner.graphs = DecodeGraphSet(runner.model, runner.kv, (1, 2, 4), runner.graphs.widths,
                                   planner=runner.planner.core, factory=Replayed)
    runner.graphs.capture(None)  # the whole device: the temporal mode's budget
    assert engine.generate(prompts[0], GREEDY)[0].token_ids == expected[0]  # 11 tokens
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert seen, "no decode step replayed a graph"
    for (_, width), need in seen:
        assert width == min(w for w in (4, 8, 64) if w >= need), (width, need)
    assert {w for (_, w), _ in seen} >= {4, 8}
