"""Parallel sampling (n > 1) on the null model, whose logits hash every cached K/V value through
the block table: a forked sequence reading a block holding anything but its own history (a
missed copy on write, a block freed too early) changes its tokens. Each sequence i is checked
against the request run alone with seed + i."""

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.runner import NullModelRunner

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


@pytest.mark.parametrize("mode, prompt_len", [
    ("temporal", 9), ("temporal", 12), ("spatial", 9)])  # 9: a partial last block (copied)
def test_n_sequences_share_one_prefill(mode: str, prompt_len: int) -> None:
    engine = make_engine(mode)
    copies = record_copies(engine)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    before = engine.counters()
    outs = check(engine, {"prompt_token_ids": list(range(5, 5 + prompt_len))}, params)
    assert len({tuple(o.token_ids) for o in outs}) == 3  # three different draws
    assert engine.counters()["prefill_tokens"] - before["prefill_tokens"] == prompt_len
    # the first two writers into a shared partial block copy it; the last one owns it
    assert len(copies) == (2 if prompt_len % 4 else 0)
    engine.check_idle()
    engine.close()


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


def test_preempted_forks_recompute_their_own_history() -> None:
    # 7 blocks for three sequences of up to 6 + 12 tokens: forks are preempted and come back
    engine = make_engine(num_kv_blocks=7, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    outs = check(engine, {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    engine.check_idle()


def test_abort_ends_every_sequence_and_frees_their_blocks() -> None:
    engine = make_engine()
    outs: list = []
    rid = engine.add_request({"prompt_token_ids": list(range(5, 15))},
                             SamplingParams(max_tokens=50, n=3, seed=1, ignore_eos=True),
                             sink=lambda o: o.finished and outs.append(o))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort(rid)
    engine.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort"),
                                                                 (2, "abort")]
    assert not engine.has_unfinished()
    engine.check_idle()


def test_n_beyond_the_sequence_slots_is_refused() -> None:
    engine = make_engine(max_num_seqs=2)
    with pytest.raises(ValueError, match="n=3"):
        engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(n=3))
    with pytest.raises(ValueError, match="n="):
        SamplingParams(n=0)
