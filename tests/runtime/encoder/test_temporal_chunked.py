"""The ``temporal-chunked`` mode: the encoder runs in layer chunks of one time window between
decode steps (TWSRFT order), and every request gets ``temporal``'s tokens - on the null model
(many arrivals, aborts, bad images) and on a tiny Qwen2-VL with the torch backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.encoder.chunked import ChunkedEncoderStage
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.worker.null import NullModelRunner
from tests.runtime.engine.test_engine_null import (
    CFG,
    image_prompt,
    mixed_workload,
    reference,
    text_prompt,
    tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make(mode: str, runner: NullModelRunner | None = None, **cfg) -> Engine:
    return Engine(runner or NullModelRunner(), EngineConfig(mode=mode, **(CFG | cfg)))


def test_same_tokens_as_temporal_on_the_null_model() -> None:
    prompts, params = mixed_workload(seed=4, n=15)
    base = tokens(make("temporal").generate(prompts, params))
    for window in (1e-9, 0.02):
        eng = make("temporal-chunked", encoder_window_s=window)
        assert isinstance(eng.encoder, ChunkedEncoderStage)
        outs = eng.generate(prompts, params)
        assert tokens(outs) == base
        for prompt, sp, out in zip(prompts, params, outs, strict=True):
            assert (out.token_ids, out.finish_reason) == reference(eng, prompt, sp)
        eng.check_idle()
    tight = make("temporal-chunked", encoder_window_s=1e-9, num_kv_blocks=14,
                 max_num_batched_tokens=16)  # preemption by recompute keeps the embeddings
    outs = tight.generate(prompts, params)
    assert tokens(outs) == base and sum(o.metrics.num_preemptions for o in outs) > 0
    tight.check_idle()


def test_decode_steps_run_between_encoder_chunks() -> None:
    """One layer per step (a window shorter than a layer): a request already decoding gets a
    token in every step while an image is encoded over the runner's four layers (counted when
    drawn: pipelined, the step in flight is read back by the next one; while the encoder has
    work left, at once)."""
    gen = torch.Generator().manual_seed(1)
    runner = NullModelRunner(encoder_layers=4)
    eng = make("temporal-chunked", runner, encoder_window_s=1e-9)
    text = eng.add_request(text_prompt(gen, 5), GREEDY)
    eng.step()
    eng.step()
    got = {}
    eng.add_request(image_prompt(gen, 3), GREEDY, sink=lambda o: got.setdefault(
        o.request_id, o) if o.finished else None)
    layers, decoded = [], []
    for _ in range(4):
        before = runner.num_encoder_layers_run
        outs = eng.step()
        layers.append(runner.num_encoder_layers_run - before)
        req, flight = eng._active[text], eng._inflight
        decoded.append(req.num_output_tokens + (flight is not None
                                                and req in flight.batch.drawn_reqs))
    assert layers == [1, 1, 1, 1]  # one chunk per step, the pass spread over four steps
    assert decoded == sorted(decoded) and decoded[-1] - decoded[0] == 3  # a token each step
    assert eng.encoder.num_held == 1 and eng.encoder.num_chunks == 4 and outs is not None
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


def test_window_sizes_the_chunk_in_predicted_time() -> None:
    """A window of 2.5 predicted layers runs three layers (the one crossing it included);
    TWSRFT puts the smaller of two images first, and the window that finishes it (its last two
    layers) goes on with the larger one."""
    gen = torch.Generator().manual_seed(2)
    probe = make("temporal-chunked", NullModelRunner(encoder_layers=8))
    layer = probe.encoder.layer_cost(16)  # one null layer of a 1x4x4 grid, predicted
    runner = NullModelRunner(encoder_layers=8)
    eng = make("temporal-chunked", runner, encoder_window_s=2.5 * layer)
    big = eng.add_request(image_prompt(gen, 2, grids=((1, 16, 16),)), GREEDY)
    small = eng.add_request(image_prompt(gen, 2), GREEDY)
    assert probe.encoder.layer_cost(256) > layer
    per_step, ready = [], []
    while not per_step or eng.encoder.num_pending:
        before = runner.num_encoder_layers_run
        eng.step()
        per_step.append(runner.num_encoder_layers_run - before)
        ready.append({r for r in (big, small) if eng.encoder.ready(eng._active[r])})
    assert per_step[:3] == [3, 3, 3]  # the small image's 8 layers: 3 + 3 + 2, then 1 big
    assert ready[1] == set() and ready[2] == {small}
    big_layer = probe.encoder.layer_cost(256)
    assert per_step[3] == max(1, -(-2.5 * layer // big_layer))
    assert sum(per_step) == 16
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


def test_bad_image_and_abort_leave_the_others_running() -> None:
    gen = torch.Generator().manual_seed(3)
    eng = make("temporal-chunked", encoder_window_s=1e-9)
    bad = image_prompt(gen, 2)
    bad["pixel_values"][0, 0] = float("nan")
    good = image_prompt(gen, 2)
    outs = {}
    sink = lambda o: outs.__setitem__(o.request_id, o) if o.finished else None  # noqa: E731
    rb = eng.add_request(bad, GREEDY, sink=sink)
    rg = eng.add_request(good, GREEDY, sink=sink)
    ra = eng.add_request(image_prompt(gen, 2), GREEDY, sink=sink)
    eng.step()
    eng.abort(ra)
    while eng.has_unfinished():
        eng.step()
    assert outs[rb].finish_reason == "error" and "non-finite" in outs[rb].error
    assert outs[ra].finish_reason == "abort"
    assert (outs[rg].token_ids, outs[rg].finish_reason) == reference(eng, good, GREEDY)
    eng.check_idle()


def test_config_validation() -> None:
    assert EngineConfig(mode="temporal-chunked").encoder_window_s == 0.02
    with pytest.raises(ValueError, match="encoder_window_s"):
        EngineConfig(mode="temporal-chunked", encoder_window_s=0)
    assert str(EngineConfig().slo) == "ttft:2000,tpot:50"
    assert EngineConfig(slo="ttft:500,itl:21").slo.itl == 21.0
    with pytest.raises(ValueError, match="slo='ttft:fast'"):
        EngineConfig(slo="ttft:fast")
    assert EngineConfig().encoder_policy == "twsrft"
    with pytest.raises(ValueError, match="encoder_policy='lifo'"):
        EngineConfig(mode="temporal-chunked", encoder_policy="lifo")


IDS = (120, 121, 122, 123, 2, 1)  # image, video, vision start, vision end, eos, bos


def test_tiny_qwen2_vl_same_tokens_as_temporal(tiny_qwen2_vl, qwen2_vl_image_prompt) -> None:
    """Staggered image and text prompts on a tiny Qwen2-VL (torch backend): temporal-chunked,
    one vision layer per step, gives temporal's tokens."""
    path, _ = tiny_qwen2_vl("qwen2vl_chunked", IDS, seed=5, intermediate_size=96, depth=3,
                            num_heads=2)
    rng = np.random.default_rng(7)
    prompts = [qwen2_vl_image_prompt(rng, [(112, 84)], [1, 8], 12, IDS),
               {"prompt_token_ids": [1, 9, 40, 41, 77, 5, 6]},
               qwen2_vl_image_prompt(rng, [(56, 56), (28, 84)], [1, 8], 12, IDS)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = {}
    for mode in ("temporal", "temporal-chunked"):
        eng = Engine.from_pretrained(str(path), mode=mode, attention_backend="torch",
                                     device="cpu", num_kv_blocks=64, block_size=4,
                                     encoder_window_s=1e-9)
        done: dict[str, list[int]] = {}
        rids = []
        for p in prompts:
            rids.append(eng.add_request(p, params, sink=lambda o, d=done: d.__setitem__(
                o.request_id, o.token_ids) if o.finished else None))
            eng.step()
        while eng.has_unfinished():
            eng.step()
        got[mode] = [done[r] for r in rids]
        if mode == "temporal-chunked":
            assert eng.encoder.num_layers_run == 3 * 2 and eng.encoder.num_chunks == 6
        eng.check_idle()
    assert got["temporal-chunked"] == got["temporal"]


def test_the_stage_orders_jobs_by_the_policy_it_is_given() -> None:
    """FIFO (a configuration the simulator's best-temporal may choose) serves the older, larger
    image first; TWSRFT the smaller one."""

    gen = torch.Generator().manual_seed(5)
    first = {}
    for policy in ("twsrft", "fifo"):
        runner = NullModelRunner(encoder_layers=4)
        eng = make("temporal-chunked", runner, encoder_window_s=1e-9, num_kv_blocks=1024,
                   encoder_policy=policy)  # EngineConfig.encoder_policy reaches the stage
        stage = eng.encoder
        assert isinstance(stage, ChunkedEncoderStage)
        big = eng.add_request(image_prompt(gen, 3, grids=((1, 64, 64),)), GREEDY)
        small = eng.add_request(image_prompt(gen, 3), GREEDY)
        while not stage.num_held:
            eng.step()
        first[policy] = big if eng._active[big].seq_no in stage._held else small
        while eng.has_unfinished():
            eng.step()
    assert first == {"twsrft": small, "fifo": big}
