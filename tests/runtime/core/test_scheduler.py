"""Scheduler (continuous batching, chunked prefill, preemption) and the step planner."""

import numpy as np
import pytest
import torch

from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.request import MultiModalData, Request, SamplingParams, Status
from spaceserve.runtime.core.scheduler import Scheduler
from spaceserve.runtime.worker.protocol import StepLimits, StepPlanner


def make_req(i: int, n: int, **params) -> Request:
    return Request(f"r{i}", i, list(range(10, 10 + n)), SamplingParams(**params), seed=i)


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_len=256,
               **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_len, eos_token_ids=(0,),
                     **kw)


def run_step(s: Scheduler, token: int = 5):
    batch = s.schedule()
    assert batch.num_tokens <= s.max_num_batched_tokens
    done = s.update(batch, [token] * len(batch.sample_reqs), 0.0)
    return batch, done


def test_chunked_prefill_under_token_budget() -> None:
    s = make_sched(budget=16)
    a, b = make_req(0, 20), make_req(1, 6)
    s.add(a)
    s.add(b)
    batch, _ = run_step(s)
    assert batch.reqs == [a] and batch.num_new == [16] and batch.sample_reqs == []
    batch, _ = run_step(s)
    # a finishes its prompt (4 tokens, samples), b gets the rest of the budget (6, samples).
    assert batch.reqs == [a, b] and batch.num_new == [4, 6]
    assert batch.sample_reqs == [a, b] and batch.num_decodes == 0
    batch, _ = run_step(s)
    assert batch.reqs == [a, b] and batch.num_new == [1, 1] and batch.num_decodes == 2
    assert a.num_computed == 21 and len(a.token_ids) == 22
    assert len(a.block_ids) == s.bm.blocks_for(21)


def test_decodes_come_first_and_slots_are_bounded() -> None:
    s = make_sched(max_num_seqs=2, budget=64)
    reqs = [make_req(i, 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    batch, _ = run_step(s)
    assert batch.reqs == reqs[:2] and len(s.waiting) == 2
    assert sorted(r.row for r in reqs[:2]) == [0, 1]
    batch, _ = run_step(s)
    assert batch.num_decodes == 2 and batch.reqs == reqs[:2]


def test_stop_conditions() -> None:
    s = make_sched(max_len=8)
    eos = make_req(0, 2)
    ignore = make_req(1, 2, ignore_eos=True, max_tokens=2)
    stop = make_req(2, 2, stop_token_ids=[7])
    longest = make_req(3, 5, max_tokens=100)
    for r in (eos, ignore, stop, longest):
        s.add(r)
    batch = s.schedule()
    toks = {eos: 0, ignore: 0, stop: 7, longest: 5}
    done = s.update(batch, [toks[r] for r in batch.sample_reqs], 1.0)
    assert set(done) == {eos, stop}
    assert eos.finish_reason == stop.finish_reason == "stop" and eos.block_ids == []
    batch = s.schedule()
    done = s.update(batch, [0 if r is ignore else 5 for r in batch.sample_reqs], 2.0)
    assert done == [ignore] and ignore.finish_reason == "length"
    assert ignore.output_token_ids == [0, 0]
    while longest.status is Status.RUNNING:
        run_step(s)
    assert longest.finish_reason == "length" and len(longest.token_ids) == 8
    s.check_idle()


def test_preemption_by_recompute_frees_the_newest() -> None:
    s = make_sched(num_blocks=4, block_size=2, budget=64)
    old, new = make_req(0, 3, max_tokens=50), make_req(1, 3, max_tokens=50)
    s.add(old)
    s.add(new)
    run_step(s)  # both prefilled: 2 blocks each, the cache is full
    assert s.bm.num_free == 0
    batch, _ = run_step(s)  # token 4 of each fits in its second block
    assert batch.num_decodes == 2 and s.bm.num_free == 0
    batch, _ = run_step(s)  # old needs a third block: new is preempted
    assert batch.reqs == [old] and batch.preempted == [new]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.block_ids == []
    assert new.num_preemptions == 1 and s.waiting[0] is new and new.row == -1
    assert len(new.token_ids) == 5  # prompt + generated tokens kept for the recompute
    s.finish(old, "abort")
    batch, _ = run_step(s)
    assert batch.reqs == [new] and batch.num_new == [5] and batch.sample_reqs == [new]


def test_newest_request_yields_its_blocks() -> None:
    s = make_sched(num_blocks=3, block_size=2, budget=64)
    a, b = make_req(0, 4, max_tokens=50), make_req(1, 1, max_tokens=50)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 blocks, b: 1 block, cache full
    batch, _ = run_step(s)  # a needs block 3 -> b preempted; b then waits
    assert batch.preempted == [b] and batch.reqs == [a]
    assert s.bm.num_used == 3


def test_newest_request_preempts_itself() -> None:
    s = make_sched(num_blocks=3, block_size=2, budget=64)
    a, b = make_req(0, 3, max_tokens=50), make_req(1, 2, max_tokens=50)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 blocks (3 tokens), b: 1 block (2 tokens), cache full
    batch, _ = run_step(s)  # a's token 4 fits; b's token 3 needs a block: b yields
    assert batch.reqs == [a] and batch.preempted == [b] and s.waiting == [b]
    assert b.block_ids == [] and s.bm.num_used == 2


def test_not_ready_requests_are_skipped_not_blocking() -> None:
    blocked = {"r0"}
    s = make_sched(is_ready=lambda r, start: r.request_id not in blocked)
    a, b = make_req(0, 3), make_req(1, 3)
    s.add(a)
    s.add(b)
    batch, _ = run_step(s)
    assert batch.reqs == [b] and s.waiting == [a]
    blocked.clear()
    batch, _ = run_step(s)
    assert a in batch.reqs


def test_admission_stops_when_blocks_run_out() -> None:
    s = make_sched(num_blocks=3, block_size=4, budget=64)
    a, b = make_req(0, 8), make_req(1, 8)
    s.add(a)
    s.add(b)
    batch, _ = run_step(s)
    assert batch.reqs == [a] and s.waiting == [b] and not batch.preempted


def test_finish_waiting_and_running_frees_everything() -> None:
    s = make_sched()
    a, b = make_req(0, 5), make_req(1, 5)
    s.add(a)
    s.add(b)
    run_step(s)
    c = make_req(2, 5)
    s.add(c)
    s.finish(c, "abort")
    s.finish(a, "abort")
    s.finish(b, "error", "boom")
    assert b.error == "boom" and b.status is Status.FINISHED
    s.finish(b, "abort")  # a second finish is a no-op
    assert b.finish_reason == "error"
    s.check_idle()


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_bad_limits_name_the_argument(name) -> None:
    kw = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=16) | {name: 0}
    with pytest.raises(ValueError, match=name):
        Scheduler(BlockManager(4, 4), **kw)


# Step planner.


def test_plan_layout_matches_block_tables() -> None:
    s = make_sched(block_size=4, budget=9)
    limits = StepLimits(8, 9, 256, 4)
    planner = StepPlanner(limits, "cpu")
    a, b = make_req(0, 6), make_req(1, 5)
    s.add(a)
    s.add(b)
    batch = s.schedule()  # a: 6 tokens, b: first 3
    plan = planner.plan(batch)
    assert plan.num_tokens == 9 and plan.num_seqs == 2 and plan.num_decodes == 0
    assert plan.input_ids.tolist() == a.token_ids + b.token_ids[:3]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    slots = [a.block_ids[p // 4] * 4 + p % 4 for p in range(6)]
    slots += [b.block_ids[p // 4] * 4 + p % 4 for p in range(3)]
    assert plan.slot_mapping.tolist() == slots
    assert plan.query_start_loc.tolist() == [0, 6, 9] and plan.seq_lens.tolist() == [6, 3]
    assert plan.logits_indices.tolist() == [5] and plan.logits_seqs.tolist() == [0]
    assert plan.block_tables[0, :2].tolist() == a.block_ids
    s.update(batch, [1], 0.0)
    batch = s.schedule()  # a decodes (1), b finishes its prompt (2)
    plan = planner.plan(batch)
    assert plan.num_decodes == 1 and plan.input_ids.tolist() == [1, 13, 14]
    assert plan.positions.tolist() == [6, 3, 4]
    assert plan.seq_lens.tolist() == [7, 5] and plan.max_seqlen_k == 7
    assert plan.slot_mapping.tolist()[0] == a.block_ids[1] * 4 + 2
    assert plan.block_tables[1, :2].tolist() == b.block_ids


def test_plan_pads_decodes_to_graph_buckets() -> None:
    s = make_sched(block_size=4, budget=64)
    planner = StepPlanner(StepLimits(8, 64, 256, 4), "cpu", graph_batch_sizes=(1, 4, 8))
    reqs = [make_req(i, 2 + i) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.update(s.schedule(), [1, 2, 3], 0.0)
    plan = planner.plan(s.schedule())
    assert plan.num_real_seqs == 3 and plan.num_seqs == 4 and plan.num_tokens == 4
    assert plan.num_logits == 3 and plan.logits_indices.tolist() == [0, 1, 2, 3]
    assert plan.seq_lens.tolist()[3] == 0 and plan.slot_mapping.tolist()[3] == -1
    assert plan.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert plan.host["input_ids"].tolist() == [1, 2, 3, 0]


def test_plan_places_image_embeddings() -> None:
    s = make_sched(block_size=4, budget=4)
    planner = StepPlanner(StepLimits(8, 4, 256, 4), "cpu")
    req = make_req(0, 7)
    emb = torch.arange(3 * 2, dtype=torch.float32).view(3, 2)
    req.mm = MultiModalData(torch.zeros(12, 8), torch.tensor([[1, 2, 6]]),
                            np.array([2, 3, 4]))
    req.mm.set_embeds(emb)
    s.add(req)
    batch = s.schedule()
    plan = planner.plan(batch)  # tokens 0..3 hold image tokens 2 and 3
    assert plan.mm_index.tolist() == [2, 3] and torch.equal(plan.mm_embeds, emb[:2])
    s.update(batch, [], 0.0)
    plan = planner.plan(s.schedule())  # tokens 4..6 hold image token 4, first in the chunk
    assert plan.mm_index.tolist() == [0] and torch.equal(plan.mm_embeds, emb[2:])
    assert plan.logits_indices.tolist() == [2]


def test_decode_buckets_are_as_wide_as_the_step_needs_not_max_model_len() -> None:
    # max_model_len 32768 at 16-token blocks: 2048 blocks; graph widths double from 256 tokens.
    limits = StepLimits(8, 64, 32768, 16)
    assert limits.max_blocks_per_seq == 2048
    assert limits.graph_table_widths == (16, 32, 64, 128, 256, 512, 1024, 2048)
    s = make_sched(num_blocks=64, block_size=16, budget=512, max_len=32768)
    planner = StepPlanner(limits, "cpu", graph_batch_sizes=(1, 4, 8))
    short, long_ = make_req(0, 20), make_req(1, 300)
    s.add(short)
    s.add(long_)
    s.update(s.schedule(), [1, 2], 0.0)
    batch = s.schedule()  # two decodes: 21 and 301 cached tokens
    assert batch.num_decodes == 2
    assert planner.decode_need(batch) == 19 and planner.bucket(batch) == (4, 32)
    plan = planner.plan(batch)
    assert tuple(plan.block_tables.shape) == (4, 32)
    assert plan.block_tables[1, :19].tolist() == long_.block_ids
    s.update(batch, [3, 4], 0.0)
    s.finish(long_, "abort")  # one short sequence left: the narrowest width
    batch = s.schedule()
    plan = planner.plan(batch)
    assert tuple(plan.block_tables.shape) == (1, 16) and plan.num_seqs == 1
    s.update(batch, [5], 0.0)
    # context lengths named: a step longer than the widest runs eagerly (no bucket, no padding)
    named = StepLimits(8, 64, 32768, 16, graph_context_lens=(100, 256))
    assert named.graph_table_widths == (7, 16)
    eager = StepPlanner(named, "cpu", graph_batch_sizes=(1, 4, 8))
    s.add(big := make_req(2, 400))
    s.update(s.schedule(), [6, 7], 0.0)
    batch = s.schedule()
    assert batch.num_decodes == 2 and eager.bucket(batch) is None
    plan = eager.plan(batch)
    assert plan.num_seqs == 2 and tuple(plan.block_tables.shape) == (2, len(big.block_ids))
