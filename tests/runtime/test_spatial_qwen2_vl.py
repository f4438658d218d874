"""Every engine mode on a tiny Qwen2-VL checkpoint: each request's greedy tokens equal
transformers' generate for that request alone, whatever the arrivals, the driver, the prefill
placement, preemptions and the SM splits SIS moves between (Triton kernels are budget-invariant).
"""

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_within_budget
from spaceserve.runtime.engine import MODES
from spaceserve.runtime.sis import Split

IDS = (120, 121, 122, 123, 2, 1)  # image, video, vision start, vision end, eos, bos
BOS = IDS[5]
STEPS = 5
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
FAST = dict(device="cpu", block_size=4, encoder_window_s=1e-9,  # a vision layer per grant
            encoder_launch_budget_s=0.0)  # and per step: deterministic on any machine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_vl):
    """(checkpoint path, transformers model): a random Qwen2-VL saved with save_pretrained."""
    return tiny_qwen2_vl("qwen2vl_spatial", IDS, seed=11, intermediate_size=96, depth=3,
                         num_heads=2)


@pytest.fixture(scope="module")
def prompts(qwen2_vl_image_prompt):
    """A large-image prompt, a text prompt, a two-image prompt and a small-image prompt."""
    rng = np.random.default_rng(3)
    out = []
    for sizes in ([(112, 84)], None, [(56, 56), (28, 84)], [(28, 28)]):
        if sizes is None:
            out.append({"prompt_token_ids": [BOS, 9, 40, 41, 77, 5, 6]})
            continue
        out.append(qwen2_vl_image_prompt(rng, sizes, [BOS, 8], 12, IDS))
    return out


@pytest.fixture(scope="module")
def expected(tiny, prompts, hf_greedy):
    return [hf_greedy(tiny[1], p, STEPS) for p in prompts]


def staggered(engine: Engine, prompts, params, gap: int = 2) -> list[list[int]]:
    """Add one prompt every `gap` steps, run to the end; tokens in prompt order."""
    got: dict[str, list[int]] = {}

    def sink(o):
        if o.finished:
            got[o.request_id] = o.token_ids

    rids = []
    for p in prompts:
        rids.append(engine.add_request(p, params, sink=sink))
        for _ in range(gap):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return [got[r] for r in rids]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_transformers(tiny, prompts, expected, mode) -> None:
    engine = Engine.from_pretrained(tiny[0], mode=mode, attention_backend="torch",
                                    num_kv_blocks=64, **FAST)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert staggered(engine, prompts[::-1], GREEDY) == expected[::-1]
    engine.check_idle()


@pytest.mark.parametrize("mode, extra", [
    ("spatial", dict(max_num_batched_tokens=8)),  # chunked prefill, SIS placing it
    ("spatial-static", dict(prefill_on="compute", encoder_driver="thread")),
    ("shared", dict(prefill_on="decode")),
])
def test_preemption_chunks_and_drivers_keep_the_tokens(tiny, prompts, expected, mode,
                                                       extra) -> None:
    engine = Engine.from_pretrained(tiny[0], mode=mode, attention_backend="torch",
                                    num_kv_blocks=8, **FAST, **extra)
    try:
        outs = engine.generate(prompts[::-1], GREEDY)
        assert [o.token_ids for o in outs] == expected[::-1]
        if extra.get("encoder_driver") != "thread":  # the worker's timing decides there
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
        engine.check_idle()
    finally:
        engine.close()


def test_triton_kernels_across_moving_splits(tiny, prompts, expected) -> None:
    engine = Engine.from_pretrained(tiny[0], mode="spatial", attention_backend="triton",
                                    num_kv_blocks=32, encoder_splits=(8, 24), **FAST)
    pset = engine.spatial.partitions
    plan = iter([8, 24, 0, 24, 8, 0] * 50)
    engine.spatial.sis.decide = lambda state: (
        lambda e: Split(e, pset.total - e, "compute" if e == 8 else "decode", 0, 0, 1, True))(
        next(plan))
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with record_launches() as launches:
        got = staggered(engine, [prompts[3], prompts[1]], short, gap=1)
    assert got == [expected[3][:3], expected[1][:3]]
    budgets = {p.encoder_sms for p in pset.splits.values()} | \
        {p.decoder_sms for p in pset.partitions()}
    assert {r.num_sms for r in launches} <= budgets
    assert {r.num_sms for r in launches if r.name == "vit_attention"} <= {8, 24}
    assert len({r.num_sms for r in launches if r.name.startswith("paged")}) >= 2
    assert_within_budget(launches, pset.total)
    assert {e for _, e in engine.spatial.switches} == {0, 8, 24}


def test_modes_and_backends(tiny) -> None:
    with pytest.raises(ValueError, match="spatial-static") as err:
        Engine.from_pretrained(tiny[0], mode="epd", device="cpu")
    assert all(m in str(err.value) for m in MODES)
    shared = Engine.from_pretrained(tiny[0], mode="shared", device="cpu", num_kv_blocks=8)
    assert shared.runner.model.attention_backend == "torch"
    assert shared.spatial.partitions.shared


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["shared", "spatial-static", "spatial"])
def test_cuda_modes_with_partitions_and_decode_graphs(tiny, prompts, expected, mode) -> None:
    engine = Engine.from_pretrained(tiny[0], mode=mode, device="cuda", dtype=torch.float32,
                                    block_size=16, max_num_seqs=8, gpu_memory_utilization=0.05,
                                    graph_reserve_bytes=1 << 28, max_encoder_tokens_per_step=256,
                                    encoder_splits=(32, 64), encoder_sms=32)
    try:
        assert engine.graph_batch_sizes == (1, 2, 4, 8)
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
        assert staggered(engine, prompts[::-1], GREEDY) == expected[::-1]
        engine.check_idle()
        pset = engine.spatial.partitions
        budgets = {sms for _, _, sms in engine.runner.graphs}
        assert budgets == {p.decoder_sms for p in
                           (pset.partitions() if mode == "spatial" else [pset.current])}
    finally:
        engine.close()
