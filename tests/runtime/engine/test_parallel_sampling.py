"""Parallel sampling (``n`` > 1) on the null model, whose logits hash every cached K/V value
through the block table: a forked sequence reading a block holding anything but its own history
(a missed copy on write, a copy applied after the write, a block freed too early) changes its
tokens. Each sequence i is checked against the request run alone with seed + i, in the
pipelined temporal mode and the unpipelined co-located one."""

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3
CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(mode: str = "temporal", **cfg) -> Engine:
    return Engine(NullModelRunner(), EngineConfig(mode=mode, **(CFG | cfg)))


def record_copies(engine: Engine) -> list:
    copies: list = []
    execute = engine.runner.execute

    def recording(batch, **kw):
        copies.extend(batch.block_copies)
        return execute(batch, **kw)

    engine.runner.execute = recording
    return copies


def check(engine: Engine, prompt: dict, params: SamplingParams) -> list:
    outs = engine.generate([prompt], params)
    assert [o.index for o in outs] == list(range(params.n))
    ids, mm = process_prompt(prompt, engine.runner.info, context_len=10**6, capacity=10**6,
                             max_images=9)
    for out in outs:
        assert out.error is None and out.request_id == outs[0].request_id
        ref = engine.runner.reference_generate(ids, mm, params, params.seed + out.index,
                                               engine.max_model_len)
        assert (out.token_ids, out.finish_reason) == ref, out.index
    return outs


@pytest.mark.parametrize("mode", ["temporal", "spatial"])
@pytest.mark.parametrize("prompt_len", [9, 12])  # a partial last block (copied), a full one
def test_n_sequences_share_one_prefill(mode: str, prompt_len: int) -> None:
    engine = make_engine(mode)
    try:
        copies = record_copies(engine)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
        before = engine.counters()
        outs = check(engine, {"prompt_token_ids": list(range(5, 5 + prompt_len))}, params)
        assert len({tuple(o.token_ids) for o in outs}) == 3  # three different draws
        after = engine.counters()
        assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len
        assert after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"] \
            == prompt_len
        # the first two writers into a shared partial block copy it; the last one owns it
        assert len(copies) == (2 if prompt_len % 4 else 0)
        engine.check_idle()
    finally:
        engine.close()


def test_forks_among_other_requests_and_a_prefix_hit() -> None:
    """Forks joining a running batch (their first decodes take pending inputs from the
    device), a second n-request whose prompt is all in the prefix cache (its last prompt token
    is a decode: the fork happens there), greedy and random choices, and min_tokens,
    logprobs and penalties per choice."""
    engine = make_engine()
    prompt = {"prompt_token_ids": list(range(20, 31))}
    others = [{"prompt_token_ids": list(range(40, 40 + k))} for k in (3, 7)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, seed=2, n=2, ignore_eos=True)
    rand = SamplingParams(max_tokens=7, temperature=0.9, seed=4, n=3, ignore_eos=True,
                          min_tokens=3, logprobs=2, repetition_penalty=1.5,
                          frequency_penalty=0.5)
    ids, _ = process_prompt(prompt, engine.runner.info, context_len=10**6, capacity=10**6,
                            max_images=9)
    for params in (rand, greedy):
        outs = engine.generate([others[0], prompt, others[1]],
                               [SamplingParams(max_tokens=9, seed=1, ignore_eos=True), params,
                                SamplingParams(max_tokens=4, seed=3, ignore_eos=True)])
        assert [o.index for o in outs] == [0, *range(params.n), 0]
        for out in outs[1:-1]:
            ref = engine.runner.reference_generate(ids, None, params, params.seed + out.index,
                                                   engine.max_model_len)
            assert (out.token_ids, out.finish_reason) == ref, out.index
            if params.logprobs is not None:
                assert [lp.token_id for lp in out.logprobs] == out.token_ids
    # the greedy choices agree; the second request found its prompt cached
    assert outs[1].token_ids == outs[2].token_ids
    assert engine.counters()["prefix_cache_hit_tokens"] >= 8
    engine.check_idle()


def test_n_with_an_image_runs_one_encoder_job() -> None:
    engine = make_engine()
    gen = torch.Generator().manual_seed(0)
    prompt = {"prompt_token_ids": [7, 8] + [IMG] * 4 + [1, 9, 10],
              "pixel_values": torch.randn(16, 8, generator=gen),
              "image_grid_thw": torch.tensor([[1, 4, 4]])}
    check(engine, prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=3, n=2,
                                         ignore_eos=True))
    assert engine.counters()["encoder_jobs"] == 1
    engine.check_idle()


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_forks_recompute_their_own_history(caching: bool) -> None:
    # 7 blocks for three sequences of up to 6 + 12 tokens: forks are preempted and come back
    engine = make_engine(num_kv_blocks=7, enable_prefix_caching=caching)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]},
               {"prompt_token_ids": [7, IMG, IMG, 1, 9],
                "pixel_values": torch.randn(8, 8, generator=gen),
                "image_grid_thw": torch.tensor([[1, 2, 4]])}]
    for prompt in prompts:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
        outs = check(engine, prompt, params)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    engine.check_idle()


@pytest.mark.parametrize("mode", ["temporal", "spatial-static"])  # prefills on the compute
@pytest.mark.parametrize("when", [0, 1, 3])  # before admission, mid-prefill, decoding
def test_abort_ends_every_sequence_once_and_frees_their_blocks(mode: str, when: int) -> None:
    # on the compute partition an abort of a request whose prefill is in flight waits for it
    extra = {"prefill_on": "compute"} if mode != "temporal" else {}
    engine = make_engine(mode, max_num_batched_tokens=4, **extra)
    outs: list = []
    rid = engine.add_request({"prompt_token_ids": list(range(5, 15))},
                             SamplingParams(max_tokens=50, n=3, seed=1, ignore_eos=True),
                             sink=lambda o: o.finished and outs.append(o))
    for _ in range(when):
        engine.step()
    assert engine.abort(rid)
    engine.step()
    engine.step()  # a pipelined step in flight is read back
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort"),
                                                                 (2, "abort")]
    assert not engine.has_unfinished()
    engine.step()
    assert len(outs) == 3
    engine.check_idle()
    engine.close()


def test_a_bad_prompt_ends_every_choice_and_n_beyond_the_slots_is_refused() -> None:
    engine = make_engine(max_num_seqs=2)
    with pytest.raises(ValueError, match="n=3: more sequences than the engine's max_num_seqs=2"):
        engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(n=3))
    outs: list = []
    engine.add_request({"prompt_token_ids": []}, SamplingParams(n=2), sink=outs.append)
    assert [(o.index, o.finished, o.finish_reason) for o in outs] == [(0, True, "error"),
                                                                      (1, True, "error")]
    assert not engine.has_unfinished()
    engine.check_idle()


def test_n_is_validated() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^n"):
            SamplingParams(n=bad)
    assert SamplingParams().n == 1


def test_a_group_waits_for_slots_for_all_its_sequences() -> None:
    engine = make_engine(max_num_seqs=3)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(8, 17))}]
    params = [SamplingParams(max_tokens=8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    assert [o.index for o in outs] == [0, 0, 1, 2]
    expect = [(prompts[0], params[0])] + [(prompts[1], params[1])] * 3
    for out, (p, sp) in zip(outs, expect, strict=True):
        ref = engine.runner.reference_generate(p["prompt_token_ids"], None, sp,
                                               sp.seed + out.index, engine.max_model_len)
        assert (out.token_ids, out.finish_reason) == ref
    engine.check_idle()
