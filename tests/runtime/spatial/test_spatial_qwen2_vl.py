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
from spaceserve.runtime.engine.engine import MODES
from spaceserve.runtime.policy.sis import Split

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
    runner, steps = engine.runner, []
    execute = runner.execute

    def execute_recorded(batch, *, stage="decoder"):
        """Each step's own launches, beside the partition it ran on."""
        part = pset.current
        with record_launches() as mine:
            logits = execute(batch, stage=stage)
        steps.append((stage, part.encoder_sms if stage == "encoder" else part.decoder_sms,
                      {r.num_sms for r in mine}))
        return logits

    runner.execute = execute_recorded
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with record_launches() as launches:
        got = staggered(engine, [prompts[3], prompts[1]], short, gap=1)
    assert got == [expected[3][:3], expected[1][:3]]
    # a step launches under its stage's budget of the partition it ran on, and no other
    assert all(sms == {budget} for _, budget, sms in steps), steps
    assert len({budget for stage, budget, _ in steps if stage == "decoder"}) >= 2
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


def _paced_curves(path) -> str:
    """Curves that make the tiny model's work take serving-scale time on a 132-SM device: a
    vision layer costs 0.2 ms per ViT patch at full width (linear in SMs: a 48-patch image
    ~0.3 s), decode is memory-bound (5 ms, saturating at 60 SMs), prefill 0.1 ms per token;
    10% co-running slowdown."""
    from spaceserve.runtime.policy.curves import Curve, CurveSet

    sms = list(range(4, 133, 4))

    def grid(fn, *axes):
        def rec(prefix, rest):
            return fn(*prefix) if not rest else [rec((*prefix, x), rest[1:]) for x in rest[0]]
        return [rec((n,), list(axes)) for n in sms]

    def enc(n, p):
        return p * 2e-4 * 132 / n

    def pre(n, t, c):
        return 1e-3 + t * 1e-4 * 132 / n

    def dec(n, b, c):
        return 5e-3 * max(1.0, 60 / n) + 1e-5 * b

    p, t, tc, b, dc = [16, 256, 4096], [16, 256, 4096], [0, 4096], [1, 32, 128], [0, 4096]
    curves = CurveSet(
        "H200", 132, {"name": "paced-tiny", "vision_depth": 32}, "bfloat16", "measured",
        Curve(("patches",), {"patches": p}, sms, grid(enc, p),
              grid(lambda *a: 1.1 * enc(*a), p)),
        Curve(("tokens", "context"), {"tokens": t, "context": tc}, sms, grid(pre, t, tc),
              grid(lambda *a: 1.1 * pre(*a), t, tc)),
        Curve(("batch", "context"), {"batch": b, "context": dc}, sms, grid(dec, b, dc),
              grid(lambda *a: 1.1 * dec(*a), b, dc)))
    return str(curves.save(path / "paced.json"))


class CurveClock:
    """The engine's injected clock, advanced after every step by what the curves say the step
    took on the device: the decode lane and the compute lane (encoder layers, compute
    prefills) run side by side, so a step lasts the longer of the two."""

    def __init__(self, engine: Engine) -> None:
        self.t, self.lanes, eng = 0.0, {"decode": 0.0, "compute": 0.0}, engine
        runner = eng.runner
        self.curves = eng.spatial.sis.curves
        depth = self.curves.encoder_depth / runner.encoder_layers
        execute, advance, step = runner.execute, runner.advance_encode, eng.step

        def timed_execute(batch, *, stage="decoder"):
            sms = batch.num_sms(stage)
            lane = "compute" if stage == "encoder" else "decode"
            if batch.num_decodes == batch.num_seqs:
                secs = self.curves.decode(batch.num_seqs, 64, sms, True)
            else:
                secs = self.curves.prefill(batch.num_tokens, 0, sms, True)
            self.lanes[lane] += secs
            return execute(batch, stage=stage)

        def timed_advance(job, layers, *, num_sms=None):
            ran = advance(job, layers, num_sms=num_sms)
            self.lanes["compute"] += self.curves.encoder(job.num_patches, ran * depth, num_sms,
                                                         True)
            return ran

        def timed_step():
            self.lanes = {"decode": 0.0, "compute": 0.0}
            out = step()
            self.t += max(max(self.lanes.values()), 1e-4)
            return out

        runner.execute, runner.advance_encode, eng.step = timed_execute, timed_advance, \
            timed_step

    def __call__(self) -> float:
        return self.t


def test_sis_widens_the_encoder_for_a_burst_and_gives_it_back(tiny, prompts, expected,
                                                              tmp_path) -> None:
    from spaceserve.runtime.engine.engine import EngineConfig
    from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner

    runner = Qwen2VLRunner.from_pretrained(tiny[0], attention_backend="torch", device="cpu")
    holder: list = []
    # the burst repeats images: both caches off, so each is encoder work (cached ones are not)
    eng = Engine(runner, EngineConfig(mode="spatial", num_kv_blocks=96, block_size=4,
                                      encoder_launch_budget_s=0.0, encoder_window_s=1e-9,
                                      curves=_paced_curves(tmp_path), encoder_cache_bytes=0,
                                      enable_prefix_caching=False),
                 clock=lambda: holder[0]() if holder else 0.0)
    clock = CurveClock(eng)
    holder.append(clock)
    policy = eng.spatial.policy
    calm_cap, slo_cap = policy.splits[-2], policy.splits[-1]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}

    def sink(o):
        if o.finished:
            assert o.error is None, o.error
            got[o.request_id] = o.token_ids

    order = [eng.add_request(prompts[1], long, sink=sink)]  # text keeps decoding throughout
    for _ in range(3):
        eng.step()
    order.append(eng.add_request(prompts[3], GREEDY, sink=sink))  # one small image: calm
    eng.step()
    calm = set()
    while eng.spatial.stage.num_pending:
        calm.add(eng.spatial.partitions.current.requested)
        eng.step()
    burst = [0, 2, 3, 0, 2, 3]
    for i in burst:  # a burst: six images at once
        order.append(eng.add_request(prompts[i], GREEDY, sink=sink))
    widest, t_burst = 0, clock.t
    while eng.has_unfinished():
        eng.step()
        if eng.spatial.stage.num_pending:
            widest = max(widest, eng.spatial.partitions.current.requested)
    switches = eng.spatial.switches
    assert 0 < max(calm) <= calm_cap  # a lone image: the calm split, decode near unloaded
    assert widest == slo_cap > max(calm)  # the burst: the most the decode SLO allows
    assert [e for t, e in switches if t >= t_burst][-1] == 0  # drained: all back to decode
    assert got[order[0]] == reference_tokens(tiny, prompts[1], 40)
    assert [got[r] for r in order[1:]] == [expected[3]] + [expected[i] for i in burst]
    eng.check_idle()


def reference_tokens(tiny, prompt, n: int) -> list[int]:
    """Greedy tokens of a temporal-mode engine for `prompt` alone."""
    engine = Engine.from_pretrained(tiny[0], mode="temporal", attention_backend="torch",
                                    num_kv_blocks=64, **FAST)
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0,
                                                    ignore_eos=True))[0].token_ids
