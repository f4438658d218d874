"""`turn_budget`: a step while SIS takes turns carries at most the plan's prefill budget on the
whole GPU, and its decodes alone while the partition has not switched to the whole GPU yet;
the queues come back whole. The simulator runs the same function: a burst at 4 img/s with 128
decodes under `ttft:2000,itl:21` (seed 3) sent a 1260-token chunk into the decode step on the
36-SM decoder partition while the switch waited, an 88 ms step that put three requests past
their ITL bound."""

from __future__ import annotations

from types import SimpleNamespace

from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.core.request import Request, SamplingParams
from spaceserve.runtime.core.scheduler import Scheduler
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.loops import spatial_loop
from spaceserve.runtime.sim.metrics import image_goodput
from spaceserve.runtime.sim.workload import Workload
from spaceserve.runtime.spatial.batch_split import turn_budget


def make_req(i: int, n: int) -> Request:
    return Request(f"r{i}", i, list(range(10, 10 + n)), SamplingParams(), seed=i)


def queues(num_blocks: int = 64) -> tuple[Scheduler, Request, Request, Request]:
    """A scheduler with `a` decoding, `b` running with 27 prompt tokens left and `c` waiting."""
    s = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=256, eos_token_ids=(0,))
    a, b, c = make_req(0, 3), make_req(1, 40), make_req(2, 5)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.update(batch, [5] * len(batch.sample_reqs), 0.0)
    s.add(c)
    return s, a, b, c


def test_while_the_partition_is_shared_a_turns_step_carries_decodes_only() -> None:
    s, a, b, c = queues()
    sis = SimpleNamespace(last_turn_tokens=8)
    with turn_budget(s, sis, True, shared=True):
        batch = s.schedule()
    assert batch.reqs == [a] and batch.num_decodes == 1 and batch.num_tokens == 1
    assert s.waiting == [c] and [id(r) for r in s.running] == [id(a), id(b)]  # their order
    assert s.max_num_batched_tokens == 16
    s.update(batch, [5], 1.0)
    batch = s.schedule()  # after it, the decode first, then the prompt's next chunk
    assert [id(r) for r in batch.reqs] == [id(a), id(b)] and batch.num_new == [1, 15]


def test_on_the_whole_gpu_the_plan_bounds_the_prefill() -> None:
    s, a, b, c = queues()
    with turn_budget(s, SimpleNamespace(last_turn_tokens=8), True):
        batch = s.schedule()
        assert s.max_num_batched_tokens == 8
    assert batch.num_tokens == 8 and a in batch.reqs and b in batch.reqs
    assert s.max_num_batched_tokens == 16
    with turn_budget(s, SimpleNamespace(last_turn_tokens=8), False, shared=True):
        assert s.max_num_batched_tokens == 16 and s.waiting == [c]  # not taking turns


def test_a_request_preempted_in_a_decodes_only_step_is_queued_first() -> None:
    """No block free for the decode's next token: the scheduler preempts the newest running
    decode, which goes to the front of the queue, the waiting request behind it."""
    s, a, b, c = queues(num_blocks=11)
    d = make_req(3, 4)
    s.add(d)
    s.waiting.remove(d)  # admitted beside a (a full block of prompt: its next token needs one)
    s.running.append(d)
    d.status, d.row = a.status, s._free_rows.pop()
    assert s.bm.ensure(d.block_ids, 4)
    d.num_computed, d.token_ids = 4, d.token_ids + [5]
    while s.bm.num_free:  # every block taken
        assert s.bm.ensure(b.block_ids, len(b.block_ids) * 4 + 4)
    with turn_budget(s, SimpleNamespace(last_turn_tokens=8), True, shared=True):
        s.schedule()
    assert [id(r) for r in s.waiting] == [id(d), id(c)]
    assert [id(r) for r in s.running] == [id(a), id(b)]


def test_the_simulated_transition_steps_carry_no_prefill(monkeypatch) -> None:
    taken: list[int] = []  # prefill tokens of each step taken while the switch waits
    schedule = spatial_loop.SpatialLoop._schedule

    def traced(self):
        batch = schedule(self)
        if self.window and self.current > 0 and batch:
            taken.append(batch.num_tokens - batch.num_decodes)
        return batch

    monkeypatch.setattr(spatial_loop.SpatialLoop, "_schedule", traced)
    slo = Slo.parse("ttft:2000,itl:21")
    workload = Workload(4.0, 30.0, seed=3)
    res = simulate(analytic_curves(), SimConfig(mode="spatial", slo=slo, sis_actions="superset",
                                                admission="slo", background=128),
                   workload, drain_s=5.0)
    images = [r for r in res.requests if r.kind == "image"]
    assert taken and not any(taken), taken
    assert image_goodput(images, slo, workload.duration_s).attainment == 1.0
