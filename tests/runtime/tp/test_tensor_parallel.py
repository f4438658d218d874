"""Tensor parallelism through the engine: real worker processes, gloo on CPU, the torch attention
backend. At TP 2 the `--model tiny` checkpoint and a 6-query / 2-KV-head Qwen2-VL give, for text,
image and video prompts through `Engine.generate`, the greedy tokens of TP 1 and of transformers,
in the temporal (pipelined), temporal-chunked and co-located modes, and TP 1's seeded draws
with penalties and logprobs in temporal mode, with the images encoded on different
ranks (data-parallel encoder) or on every rank (replicated), the workers holding the encoder
cache's entries so that cached images reach no rank and no step ships embeddings; TP 4
replicates the tiny model's
2 KV heads; a worker killed mid-generate ends `generate` with an error naming it within 30 s;
no worker outlives its engine. Every rank's launch record shows its collectives, bounded by
NCCL_MAX_CTAS, inside the budget of the stage that issues them, beside that stage's Triton
kernels. A spatial engine's split set is the engine policy's (curves and SLO) on every rank,
chosen before the workers start, with the collectives' bound following it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_within_budget
from spaceserve.runtime.engine.config import EngineConfig
from spaceserve.runtime.policy.model_curves import load_curves
from spaceserve.runtime.spatial.partition import default_splits
from spaceserve.runtime.spatial.split_set import engine_policy
from spaceserve.runtime.tp import PartitionSpec, TensorParallelError
from spaceserve.runtime.tp.runner import collective_sms_for

IDS = (120, 121, 122, 123, 2, 1)  # image, video, vision start, vision end, eos, bos (six)
STEPS = 5
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=STEPS, temperature=0.9, seed=11, top_k=50, logprobs=2,
                        presence_penalty=0.5, repetition_penalty=1.2, ignore_eos=True)
FAST = dict(device="cpu", attention_backend="torch", block_size=4, num_kv_blocks=64,
            encoder_window_s=1e-9, encoder_launch_budget_s=0.0)

pytestmark = pytest.mark.usefixtures("one_thread")  # the workers take the same thread count


@contextlib.contextmanager
def engine(path, size: int, **kw):
    """An engine at tensor_parallel_size `size`, closed (and its workers gone) however the test
    ends."""
    eng = Engine.from_pretrained(str(path), tensor_parallel_size=size, **{**FAST, **kw})
    try:
        yield eng
    finally:
        eng.close()
        if size > 1:
            assert eng.runner.group.alive() == [], "a worker outlived its engine"


def tokens(outs) -> list[list[int]]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_path, hf_greedy):
    """(path, prompts, transformers' tokens): a text prompt, a one-image and a two-image prompt
    through the checkpoint's own tokenizer and processor."""
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    from spaceserve.runtime.inputs import load_processor

    _, processor = load_processor(str(tiny_path))
    rng = np.random.default_rng(5)
    pics = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            for h, w in ((56, 84), (60, 60), (28, 56))]
    tag = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [{"prompt": "The encoder looks at the image"},
               {"prompt": f"Describe {tag} this image.", "images": pics[:1]},
               {"prompt": f"Two {tag} and {tag} pictures", "images": pics[1:]}]
    hf = Qwen2VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        enc = processor(text=[p["prompt"]], images=p.get("images"), return_tensors="pt")
        ref = {"prompt_token_ids": enc["input_ids"][0].tolist()}
        if "images" in p:
            ref.update(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
        expected.append(hf_greedy(hf, ref, STEPS))
    return tiny_path, prompts, expected


@pytest.fixture(scope="module")
def six(tmp_path_factory, qwen2_vl_image_prompt, hf_greedy):
    """(path, prompts, transformers' tokens) of a random Qwen2-VL with 6 query / 2 KV heads."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    image, video, vstart, vend, eos, bos = IDS
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=96, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         eos_token_id=eos, bos_token_id=bos,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=96, num_heads=2, mlp_ratio=2),
        image_token_id=image, video_token_id=video, vision_start_token_id=vstart,
        vision_end_token_id=vend)
    torch.manual_seed(6)
    hf = Qwen2VLForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("qwen2vl_six")
    hf.save_pretrained(path)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    rng = np.random.default_rng(8)
    g = torch.Generator().manual_seed(9)
    grid = torch.tensor([[2, 2, 4]])  # two temporal patches of a 2x4 grid: 4 video tokens
    clip = {"prompt_token_ids": [bos, 5, vstart] + [video] * 4 + [vend, 19],
            "pixel_values_videos": torch.randn(16, 3 * 2 * 14 * 14, generator=g),
            "video_grid_thw": grid}
    prompts = [{"prompt_token_ids": [bos, 17, 33, 8, 91, 4]},
               qwen2_vl_image_prompt(rng, [(56, 84)], [bos, 7], 10, IDS),
               qwen2_vl_image_prompt(rng, [(28, 56), (56, 56)], [bos, 9], 12, IDS), clip]
    return path, prompts, [hf_greedy(hf, p, STEPS) for p in prompts]


@pytest.mark.parametrize("model, mode, extra", [
    ("tiny", "temporal", {}),
    ("tiny", "spatial", dict(max_num_batched_tokens=8)),  # chunked prefill, SIS placing it
    ("six", "temporal", dict(num_kv_blocks=9, max_num_batched_tokens=8)),  # + preemption
    # the prefix cache off: the later generates take every image from the encoder cache
    ("six", "spatial-static", dict(prefill_on="compute", encoder_driver="thread",
                                   enable_prefix_caching=False)),
    # every rank encodes every image, in layer chunks (the data-parallel chunked stage runs
    # on the null model in test_encoder_dp.py)
    ("tiny", "temporal-chunked", dict(mm_encoder_tp_mode="replicate")),
])
def test_tp2_matches_tp1_and_transformers(request, model, mode, extra):
    path, prompts, expected = request.getfixturevalue(model)
    pipelined = mode == "temporal"  # steps run one ahead: decode inputs broadcast from rank 0
    with engine(path, 1, mode=mode, **extra) as one:
        assert tokens(one.generate(prompts, GREEDY)) == expected
        if pipelined:
            drawn = one.generate(prompts, SEEDED)
    with engine(path, 2, mode=mode, **extra) as two:
        if pipelined:  # rank 0's sampler: seeded draws, penalties and logprobs as at TP 1
            assert two.config.async_scheduling
            got = two.generate(prompts, SEEDED)
            assert tokens(got) == tokens(drawn)
            for a, b in zip(got, drawn, strict=True):
                assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
                np.testing.assert_allclose([t.logprob for t in a.logprobs],
                                           [t.logprob for t in b.logprobs], atol=1e-4)
        lm = two.runner.model.language
        assert (lm.num_heads, lm.num_kv_heads) == (lm.total_heads // 2, lm.total_kv_heads // 2)
        assert tokens(two.generate(prompts, GREEDY)) == expected
        assert tokens(two.generate(prompts[::-1], GREEDY)) == expected[::-1]
        if mode in ("temporal", "spatial"):
            # n = 2: each prompt prefilled once and forked; the copy on write of a shared
            # block reaches every rank's KV shard
            par = two.generate(prompts, dataclasses.replace(GREEDY, n=2))
            assert tokens(par) == [e for e in expected for _ in range(2)]
        if "num_kv_blocks" in extra:
            outs = two.generate(prompts, GREEDY)
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
        two.check_idle()
        stats = two.runner.worker_stats()
        assert stats[0]["steps"] > 0
        if mode == "spatial":  # every rank: the split set chosen from the curves and the SLO
            curves = load_curves(None, two.runner)  # one rank's, as the simulator's at TP 2
            assert (curves.model["tp"], curves.model["mm_encoder_tp_mode"]) == (2, "data")
            chosen = engine_policy(curves, two.config, 132).splits
            assert chosen != default_splits(132)
            assert tuple(sorted(two.spatial.partitions.splits)) == chosen
            assert two.runner.partition_spec.encoder_splits == chosen
            assert stats[0]["splits"] == chosen
            assert two.runner.collective_sms == 132 - chosen[-1]  # its decoder's 12 SMs
        # workers mirror rank 0's encoder cache: one set of rows per cached media item ...
        assert (stats[0]["embeds"], stats[0]["jobs"]) == (two.encoder_cache.num_live, 0)
        items = sum(len(p.get(k, ())) for p in prompts
                    for k in ("images", "image_grid_thw", "video_grid_thw"))
        assert two.encoder_cache.num_live == items  # every image and video, once
        media = sum(1 for p in prompts if {"images", "image_grid_thw", "video_grid_thw"} & set(p))
        assert two.counters()["encoder_jobs"] == media  # the first generate's, never again
        two.encoder_cache.clear()  # ... and drop them with it
        stats = two.runner.worker_stats()
        assert (stats[0]["embeds"], stats[0]["jobs"]) == (0, 0), "a worker kept image state"
        # requests with media: one encoder job each, all in the first generate
        if extra.get("mm_encoder_tp_mode") == "replicate":
            assert stats[0]["encoded"] == media, "rank 1 skipped images"
        else:  # data-parallel: each job on one rank, both ranks used, cached items on none
            assert two.runner.assigned[0] > 0 and two.runner.assigned[1] > 0
            assert sum(two.runner.assigned) == media
            assert stats[0]["encoded"] == two.runner.assigned[1]
        # every step found its media rows on the workers (the owner's broadcast, split into
        # the cache's entries): none went through the pipe
        assert two.runner.num_shipped == 0


def test_tp4_replicates_kv_heads_and_a_killed_worker_ends_generate(tiny):
    """4 query / 2 KV heads over 4 ranks: one query head each, each KV head on two ranks.
    Then rank 2 is killed mid-generate: `generate` raises within 30 s, naming it, and
    closing the engine leaves no process behind."""
    path, prompts, expected = tiny
    with engine(path, 4) as eng:
        lm = eng.runner.model.language
        assert (lm.num_heads, lm.num_kv_heads, lm.total_kv_heads) == (1, 1, 2)
        assert eng.runner.kv_block_bytes(4) == 2 * lm.num_layers * 4 * 1 * lm.head_dim * 4, \
            "a rank's KV cache holds its one KV head"
        assert tokens(eng.generate(prompts, GREEDY)) == expected

        victim = eng.runner.worker_pids()[1]  # rank 2
        execute, calls, killed = eng.runner.execute, [0], []

        def kill_on_third_step(batch, **kw):
            calls[0] += 1
            if calls[0] == 3:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())
            return execute(batch, **kw)

        eng.runner.execute = kill_on_third_step
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+\) was killed by "
                                                      r"signal SIGKILL"):
            eng.generate(prompts, long)
        assert killed and time.monotonic() - killed[0] < 30.0
        with pytest.raises(TensorParallelError):  # the engine stays failed, it does not hang
            eng.generate(prompts[:1], GREEDY)


def broken_worker(rank, spec, source, conn, parent) -> None:
    """A worker that fails while loading its shard (module level: spawn pickles it by name)."""
    import traceback

    conn.send(("hello", rank, os.getpid()))
    try:
        raise ValueError("shard 1 of the checkpoint is unreadable")
    except ValueError:
        conn.send(("error", rank, traceback.format_exc()))
    os._exit(1)


def test_a_worker_failing_at_start_is_named_at_once(tmp_path):
    from spaceserve.runtime.tp.group import WorkerGroup
    from spaceserve.runtime.tp.protocol import ModelSource

    group = WorkerGroup(2, ModelSource(path=str(tmp_path)), timeout_s=60.0, stages=("decoder",),
                        partitions=None, num_threads=1, target=broken_worker)
    try:
        group.expect("hello")
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 1 "
                                                      r"\(ValueError: shard 1 of the checkpoint "
                                                      r"is unreadable\)"):
            group.expect("ready")
        assert time.monotonic() - t0 < 10.0
    finally:
        group.close()
    assert group.alive() == []


def test_splits_that_cannot_work_are_refused_before_any_process_starts(six):
    path = six[0]  # 6 query / 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by "
                                         "tensor_parallel_size=4"):
        Engine.from_pretrained(str(path), tensor_parallel_size=4, **FAST)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be an int >= 1"):
        Engine.from_pretrained(str(path), tensor_parallel_size=0, **FAST)


def test_collectives_are_recorded_inside_each_stage_budget(tiny):
    """A 64 / 68-SM split at TP 2 with the Triton kernels: on each rank every collective is in
    the launch record with NCCL_MAX_CTAS thread blocks (16, read from the environment the
    group gave that process) inside the budget of the stage issuing it - the decode step's and
    the embeddings' broadcast in the decoder's 68 SMs, the compute-partition prefill's in the
    encoder's 64 - stream-ordered with that stage's kernels, which run under the same budgets.
    """
    path, prompts, expected = tiny
    two_tokens = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with engine(path, 2, mode="spatial-static", encoder_sms=64, prefill_on="compute",
                attention_backend="triton") as eng:
        assert eng.runner.collective_sms == 16
        eng.runner.worker_stats(record=True)
        with record_launches() as mine:
            outs = eng.generate(prompts[1:2], two_tokens)  # one image prompt
        theirs = eng.runner.worker_stats(record=False)[0]["launches"]
    assert tokens(outs) == [expected[1][:2]]
    for recs in (mine, theirs):
        coll = [r for r in recs if r.kind == "collective"]
        kernels = [r for r in recs if r.kind == "kernel"]
        assert {(r.config["group"], r.num_sms) for r in coll} == {("decoder", 68),
                                                                  ("encoder", 64)}
        assert {r.name for r in coll if r.config["group"] == "decoder"} == \
            {"all_reduce", "all_gather", "broadcast"}
        assert all(r.grid == (16,) and r.config["backend"] == "gloo" and
                   r.config["overlap"] is False and r.config["bytes"] > 0 for r in coll)
        assert kernels and {r.num_sms for r in kernels} == {64, 68}
        assert_within_budget(recs)


def test_collective_bounds_and_encoder_modes_are_checked():
    cpu = torch.device("cpu")
    spatial = PartitionSpec("spatial", None, (8, 96), False, 1)
    assert collective_sms_for(cpu, None, None) == 16
    assert collective_sms_for(cpu, spatial, None) == 8  # the 8-SM encoder side
    with pytest.raises(ValueError, match="collective_sms=20 exceeds the smallest partition a "
                                         "collective runs in \\(8 SMs\\)"):
        collective_sms_for(cpu, spatial, 20)
    with pytest.raises(ValueError, match="collective_sms=0 must be an int >= 1"):
        EngineConfig(collective_sms=0)
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='weights'.*use 'data'"):
        EngineConfig(mm_encoder_tp_mode="weights")
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='tensor' is not one of"):
        EngineConfig(mm_encoder_tp_mode="tensor")


def test_spatial_splits_are_chosen_before_any_process_starts(tiny_path):
    """The split set a TP ``spatial`` engine gives its workers is the engine policy's for its
    config (one rank's curves of the model, the SLO, `sis_load`): what ``spaceserve sim --tp``
    simulates. An explicit `encoder_splits` wins, and the collectives' bound follows the set: a
    `collective_sms` that does not fit its smallest side is refused, naming the split, before
    any worker starts."""
    import multiprocessing

    from spaceserve.runtime.policy.analytic.model import qwen2_vl_72b_config
    from spaceserve.runtime.policy.analytic.tp import tensor_parallel_curves
    from spaceserve.runtime.sim import SimConfig
    from spaceserve.runtime.sim.config import sim_policy
    from spaceserve.runtime.spatial.split_set import chosen_splits
    from spaceserve.runtime.tp import ModelSource
    from spaceserve.runtime.tp.runner import source_config

    cpu = torch.device("cpu")
    big, rank = qwen2_vl_72b_config(), tensor_parallel_curves(qwen2_vl_72b_config(), tp=8)
    for slo, expected in (("ttft:2000,tpot:50", (32, 56, 80, 96, 112, 120)),
                          ("ttft:2000,itl:21", (32, 48, 64, 72, 88, 104))):
        cfg = EngineConfig(mode="spatial", slo=slo, tensor_parallel_size=8)
        assert chosen_splits(cfg, big, cpu) == expected == \
            sim_policy(rank, SimConfig(mode="spatial", slo=cfg.slo)).splits
    hf = source_config(ModelSource(path=str(tiny_path)))
    cfg = EngineConfig(mode="spatial", tensor_parallel_size=2)
    chosen = chosen_splits(cfg, hf, cpu)
    assert chosen == engine_policy(tensor_parallel_curves(hf, tp=2), cfg, 132).splits
    assert chosen != default_splits(132)
    assert chosen[-1] == 120  # the decoder's 12 SMs bound the collectives
    assert chosen_splits(dataclasses.replace(cfg, encoder_splits=(40, 80)), hf, cpu) == (40, 80)
    with pytest.raises(ValueError, match=r"collective_sms=16 exceeds the smallest partition a "
                                         r"collective runs in \(12 SMs\): the decoder side of "
                                         r"the 120 / 12 split"):
        Engine.from_pretrained(str(tiny_path), tensor_parallel_size=2, mode="spatial",
                               collective_sms=16, **FAST)
    with pytest.raises(ValueError, match=r"collective_sms=60 exceeds .* \(40 SMs\): the encoder "
                                         r"side of the 40 / 92 split of encoder splits "
                                         r"\(40, 80\)"):
        Engine.from_pretrained(str(tiny_path), tensor_parallel_size=2, mode="spatial",
                               encoder_splits=(40, 80), collective_sms=60, **FAST)
    assert not multiprocessing.active_children()


def test_rank_0_refuses_partitions_its_workers_did_not_build():
    """Rank 0 builds its partitions from the engine policy; workers built theirs from the
    runner's spec: an engine over a runner whose spec differs (the default set, or none) fails
    at start-up, naming both sets, instead of a worker meeting budgets it has no partition for."""
    from spaceserve.runtime.worker.null import NullModelRunner

    cfg = EngineConfig(mode="spatial", num_kv_blocks=16, block_size=4, max_num_seqs=4,
                       tensor_parallel_size=2)
    for spec, built in ((PartitionSpec("spatial", None, default_splits(132), False, 1),
                         r"spatial splits \(32, 64, 96\)"), (None, "none")):
        runner = NullModelRunner()
        runner.tp_size, runner.partition_spec = 2, spec
        with pytest.raises(ValueError, match=rf"the tensor-parallel workers built partitions "
                                             rf"for {built}, rank 0 for spatial splits \(32, "):
            Engine(runner, cfg)
    runner = NullModelRunner()  # the spec of the engine policy's set: the engine starts
    runner.tp_size = 2
    chosen = engine_policy(load_curves(None, runner), cfg, 132).splits
    runner.partition_spec = PartitionSpec("spatial", None, chosen, False, 1)
    eng = Engine(runner, cfg)
    assert tuple(sorted(eng.spatial.partitions.splits)) == chosen
    eng.close()
