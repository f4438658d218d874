"""The fair share (`EngineConfig.fair_share`, core/fair_share.py) on the null model, whose
logits hash every cached K/V value through the block table: a newcomer behind a request that
holds every slot and block is served within a few steps (and, with the fair share off, is not:
the test fails without it), per user behind a key, and every sequence of the preempted
parallel-sampling groups still draws exactly the tokens of its seed run alone."""

import pytest

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.core.fair_share import water_fill
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.worker.null import NullModelRunner
from tests.runtime.engine.test_parallel_sampling import record_copies

pytestmark = pytest.mark.usefixtures("one_thread")

# 8 slots, 24 blocks of 4 tokens: one n=8 request of 40 tokens each needs 8 x 11 blocks
CFG = dict(num_kv_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
BIG = SamplingParams(n=8, max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
HI = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def make_engine(**cfg) -> Engine:
    return Engine(NullModelRunner(), EngineConfig(**(CFG | cfg)))


def prompt(start: int, n: int = 6) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def check_seeded(engine: Engine, p: dict, params: SamplingParams, outs: list) -> None:
    ids, mm = process_prompt(p, engine.runner.info, context_len=10**6, capacity=10**6,
                             max_images=9)
    assert sorted(o.index for o in outs) == list(range(params.n))
    for out in outs:
        assert out.error is None
        ref = engine.runner.reference_generate(ids, mm, params, params.seed + out.index,
                                               engine.max_model_len)
        assert (list(out.token_ids), out.finish_reason) == ref, out.index


def run(engine: Engine, bigs: list[tuple[dict, SamplingParams, str | None]], warm: int,
        hi_key: str | None = None, max_steps: int = 5000) -> tuple[int | None, dict]:
    """Start the big requests, step `warm` times, add a "hi"; run all to the end. Returns
    (steps until the hi finished, {request id: final outputs})."""
    finals: dict[str, list] = {}
    for k, (p, params, key) in enumerate(bigs):
        engine.add_request(p, params, request_id=f"big{k}", fair_key=key)
    steps, hi_steps = 0, None
    for _ in range(warm):
        for o in engine.step():
            if o.finished:
                finals.setdefault(o.request_id, []).append(o)
        steps += 1
    engine.add_request(prompt(60, 3), HI, request_id="hi", fair_key=hi_key)
    start = steps
    while engine.has_unfinished() and steps < max_steps:
        for o in engine.step():
            if o.finished:
                finals.setdefault(o.request_id, []).append(o)
                if o.request_id == "hi":
                    hi_steps = steps - start
        steps += 1
    return hi_steps, finals


def test_water_fill_is_max_min() -> None:
    assert water_fill(10, {"a": 1, "b": 100, "c": 100}) == {"a": 1, "b": 4.5, "c": 4.5}
    assert water_fill(6, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert water_fill(0, {"a": 3}) == {"a": 0}


@pytest.mark.parametrize("blocks", [24, 400])  # KV blocks run out; only the slots do
@pytest.mark.parametrize("fair", [True, False])
def test_newcomer_is_served_beside_a_request_holding_everything(fair: bool,
                                                                blocks: int) -> None:
    engine = make_engine(fair_share=fair, num_kv_blocks=blocks)
    try:
        big = prompt(40)
        hi_steps, finals = run(engine, [(big, BIG, None)], warm=12)
        engine.check_idle()
        if not fair:  # first come, first served: the newcomer waits for the whole request
            assert hi_steps is not None and hi_steps > 25
            return
        assert hi_steps is not None and hi_steps <= 8, hi_steps
        assert finals["hi"][0].token_ids == engine.runner.reference_generate(
            [60, 61, 62], None, HI, 0, engine.max_model_len)[0]
        check_seeded(engine, big, BIG, finals["big0"])
        assert finals["hi"][0].metrics.num_preemptions == 0  # the big yields, not the hi
    finally:
        engine.close()


def test_groups_detach_over_their_share_and_stay_seeded(monkeypatch) -> None:
    """Three n=8 requests at once: each is admitted with a share of the 8 slots (its other
    siblings detached, queued alone), one of them from a user behind a key with two requests;
    detached ones adopt a running sibling's prompt blocks; every sequence draws its seed's
    tokens."""
    from spaceserve.runtime.core import scheduler

    detached: list[int] = []
    adopted: list[bool] = []
    real, real_adopt = scheduler.detach, scheduler.adopt
    monkeypatch.setattr(scheduler, "detach",
                        lambda req, keep: detached.append(len(out := real(req, keep))) or out)
    takers: set[int] = set()

    def spy_adopt(req, bm):
        got = real_adopt(req, bm)
        adopted.append(got)
        if got:
            takers.add(id(req))
        return got

    monkeypatch.setattr(scheduler, "adopt", spy_adopt)
    engine = make_engine(num_kv_blocks=40)
    copies = record_copies(engine)
    execute, bm = engine.runner.execute, engine.block_manager

    def writes_own_blocks(batch, **kw):  # an adopter never writes into a shared block
        for req, c, n in zip(batch.reqs, batch.num_cached, batch.num_new, strict=True):
            if id(req) in takers:
                assert all(bm.ref_count(req.block_ids[p // bm.block_size]) == 1
                           for p in range(c, c + n)), "a write into a shared block"
        return execute(batch, **kw)

    engine.runner.execute = writes_own_blocks
    try:
        bigs = [(prompt(10 + 10 * k, 5 + k), BIG, "alice" if k else None) for k in range(3)]
        bigs[2] = (bigs[2][0], SamplingParams(n=5, max_tokens=30, temperature=0.8, seed=3,
                                              ignore_eos=True), "alice")
        hi_steps, finals = run(engine, bigs, warm=3, hi_key="bob")
        engine.check_idle()
        assert hi_steps is not None and hi_steps <= 8, hi_steps
        for k, (p, params, _) in enumerate(bigs):
            check_seeded(engine, p, params, finals[f"big{k}"])
        assert sum(detached) >= 10  # siblings over a group's share queued on their own
        assert sum(adopted) >= 5  # ... most of them on a running sibling's prompt blocks
        assert len(copies) >= sum(adopted)  # each copies the shared partial block it writes
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["temporal", "spatial"])
def test_partial_preemption_keeps_seeded_outputs(mode: str) -> None:
    """Eight big requests (same seed: the same outputs) and a newcomer; preempted and
    detached sequences recompute to exactly their seed's tokens, in the pipelined temporal
    mode and the unpipelined co-located one."""
    engine = make_engine(mode=mode, num_kv_blocks=48, max_num_seqs=16)
    try:
        big = prompt(40)
        params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
        hi_steps, finals = run(engine, [(big, params, None)] * 8, warm=6)
        engine.check_idle()
        assert hi_steps is not None and hi_steps <= 10, hi_steps
        for k in range(8):
            check_seeded(engine, big, params, finals[f"big{k}"])
        preempted = [sum(o.metrics.num_preemptions > 0 for o in finals[f"big{k}"])
                     for k in range(8)]
        assert any(0 < p < params.n for p in preempted), preempted  # part of a group
    finally:
        engine.close()


def test_without_a_group_the_share_is_skipped_and_decides_the_same() -> None:
    """Single-sequence requests only (a queue behind a full batch): the fair share builds no
    units - its per-step cost is a scan - and the tokens and the order requests finish in are
    those of the engine without it."""
    runs = []
    for fair in (True, False):
        engine = make_engine(fair_share=fair)
        for k in range(12):  # 8 slots: 4 wait
            engine.add_request(prompt(3 * k, 5), SamplingParams(
                max_tokens=6 + k % 3, temperature=1.0, seed=k, ignore_eos=True),
                request_id=f"r{k}")
        order, toks = [], {}
        while engine.has_unfinished():
            outs = engine.step()
            if fair:
                assert engine.scheduler.fair.units == {}
            for o in outs:
                if o.finished:
                    order.append(o.request_id)
                    toks[o.request_id] = list(o.token_ids)
        runs.append((order, toks))
    assert len(runs[0][0]) == 12 and runs[0] == runs[1]
