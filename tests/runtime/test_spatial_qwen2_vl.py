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

IMAGE, VIDEO, VSTART, VEND, EOS, BOS = 120, 121, 122, 123, 2, 1
STEPS = 5
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
FAST = dict(device="cpu", block_size=4, encoder_window_s=1e-9,  # a vision layer per grant
            encoder_launch_budget_s=0.0)  # and per step: deterministic on any machine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint path, transformers model): a random Qwen2-VL saved with save_pretrained."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=EOS, bos_token_id=BOS,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)
    torch.manual_seed(11)
    hf = Qwen2VLForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("qwen2vl_spatial")
    hf.save_pretrained(path)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, hf


@pytest.fixture(scope="module")
def prompts():
    """A large-image prompt, a text prompt, a two-image prompt and a small-image prompt."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(3)
    proc = Qwen2VLImageProcessorPil()
    out = []
    for sizes in ([(112, 84)], None, [(56, 56), (28, 84)], [(28, 28)]):
        if sizes is None:
            out.append({"prompt_token_ids": [BOS, 9, 40, 41, 77, 5, 6]})
            continue
        pics = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        batch = proc(images=pics, return_tensors="pt")
        ids = [BOS, 8]
        for j, (t, h, w) in enumerate(batch["image_grid_thw"].tolist()):
            ids += [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND, 12 + j]
        out.append({"prompt_token_ids": ids, "pixel_values": batch["pixel_values"],
                    "image_grid_thw": batch["image_grid_thw"]})
    return out


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    hf = tiny[1]
    out = []
    for p in prompts:
        ids = torch.tensor([p["prompt_token_ids"]])
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == IMAGE).int())
        if "pixel_values" in p:
            kw.update(pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"])
        with torch.no_grad():
            out.append(hf.generate(**kw, max_new_tokens=STEPS, do_sample=False)[0, ids.shape[1]:]
                       .tolist())
    return out


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
        budgets = {sms for _, sms in engine.runner.graphs}
        assert budgets == {p.decoder_sms for p in
                           (pset.partitions() if mode == "spatial" else [pset.current])}
    finally:
        engine.close()
