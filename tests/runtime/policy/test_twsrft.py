"""TWSRFT under a fake clock: ordering, preemption at layer boundaries, aging, batching."""

from __future__ import annotations

import math
import random

import pytest

from spaceserve.runtime.policy.twsrft import Grant, TwsrftScheduler

LAYERS = 10


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def cost(patches: int, layers: int) -> float:
    """1 ms per 1000 patches per layer."""
    return patches * layers * 1e-6


def make(clock: Clock, **kw) -> TwsrftScheduler:
    kw.setdefault("token_budget", 1)  # no batching unless a test asks for it
    return TwsrftScheduler(LAYERS, cost, clock=clock, **kw)


def run(s: TwsrftScheduler, clock: Clock, g: Grant) -> tuple:
    clock.t += cost(g.patches, g.layers)
    return s.report(g.job_id, g.layers)


def drain(s: TwsrftScheduler, clock: Clock) -> list[Grant]:
    grants = []
    while (g := s.next_grant()) is not None:
        grants.append(g)
        run(s, clock, g)
    return grants


@pytest.mark.parametrize("window", [math.inf, 0.004])
def test_shortest_remaining_first(window) -> None:
    clock = Clock()
    s = make(clock, window_s=window)
    for rid, p in [("a", 3000), ("b", 500), ("c", 1500), ("d", 800)]:
        s.submit(rid, p)
    order = []
    for g in drain(s, clock):
        if not order or order[-1] != g.request_ids:
            order.append(g.request_ids)
    assert order == [("b",), ("d",), ("c",), ("a",)]
    fifo = make(Clock(), policy="fifo", window_s=window)
    for rid, p in [("a", 3000), ("b", 500), ("c", 1500)]:
        fifo.submit(rid, p)
    assert [g.request_ids for g in drain(fifo, Clock())][0] == ("a",)


def test_long_job_preempted_at_layer_boundary_and_resumed() -> None:
    clock = Clock()
    s = make(clock, window_s=0.008)  # 8 ms: two layers of a 4000-patch image
    s.submit("long", 4000)
    g1 = s.next_grant()
    assert (g1.request_ids, g1.start_layer, g1.layers) == (("long",), 0, 2)
    clock.t += 0.003
    s.submit("short", 500)  # arrives mid-grant: waits for the layer boundary
    clock.t += 0.005
    assert s.report(g1.job_id, 2) == ()
    g2 = s.next_grant()
    assert g2.request_ids == ("short",) and g2.layers == LAYERS  # 5 ms fits the window
    assert run(s, clock, g2) == ("short",)
    g3 = s.next_grant()
    assert (g3.request_ids, g3.start_layer, g3.job_id) == (("long",), 2, g1.job_id)
    rest = [g3] + drain_after(s, clock, g3)
    assert sum(g.layers for g in rest) == LAYERS - 2
    assert [g.start_layer for g in rest] == [2, 4, 6, 8]


def drain_after(s: TwsrftScheduler, clock: Clock, g: Grant) -> list[Grant]:
    run(s, clock, g)
    return drain(s, clock)


def _long_job_waits(max_wait: float, rounds: int = 400) -> tuple[list[float], bool]:
    """A long job under a stream of shorter arrivals; its waits between grants."""
    clock = Clock()
    s = make(clock, window_s=0.005, max_wait_s=max_wait)
    s.submit("long", 8000)
    waiting_since, waits, finished = 0.0, [], False
    for i in range(rounds):
        s.submit(f"s{i}", 200 + (i * 37) % 100)  # a shorter job always waits
        g = s.next_grant()
        if "long" in g.request_ids:
            waits.append(clock.t - waiting_since)
        done = run(s, clock, g)
        if "long" in g.request_ids:
            waiting_since = clock.t
            finished = finished or "long" in done
    if not finished:
        waits.append(clock.t - waiting_since)
    return waits, finished


def test_aging_bounds_every_wait() -> None:
    max_wait, window = 0.05, 0.005
    waits, finished = _long_job_waits(max_wait)
    assert finished and len(waits) == LAYERS  # one layer (8 ms > window) per grant
    # at most the aging bound plus the grant in flight when it was reached
    assert max(waits) <= max_wait + window + 1e-12, max(waits)
    assert max(waits) >= max_wait  # it did wait behind the shorter jobs
    starved, finished = _long_job_waits(1e9)  # without aging the long job never runs
    assert not finished and starved[-1] > 10 * max_wait


def test_equal_jobs_in_arrival_order() -> None:
    for policy in ("twsrft", "fifo"):
        clock = Clock()
        s = make(clock, policy=policy, window_s=math.inf)
        ids = [f"r{i}" for i in range(6)]
        for rid in ids:
            s.submit(rid, 1000)
        assert [g.request_ids[0] for g in drain(s, clock)] == ids


def flat_cost(patches: int, layers: int) -> float:
    """An under-occupied device: up to 2000 patches cost the same (merging them is free)."""
    return max(patches, 2000) * layers * 1e-6


def test_batching_never_mixes_layer_depths() -> None:
    rng = random.Random(7)
    clock = Clock()
    s = TwsrftScheduler(LAYERS, flat_cost, window_s=0.003, token_budget=6000, clock=clock)
    depth: dict[str, int] = {}
    sizes: dict[str, int] = {}
    finished, batched, n = [], 0, 0

    def step() -> bool:
        nonlocal batched
        g = s.next_grant()
        if g is None:
            return False
        assert {depth[r] for r in g.request_ids} == {g.start_layer}
        assert g.patches == sum(sizes[r] for r in g.request_ids)
        assert len(g.request_ids) == 1 or g.patches <= 2000  # only where merging is free
        batched += len(g.request_ids) > 1
        clock.t += flat_cost(g.patches, g.layers)
        done = s.report(g.job_id, g.layers)
        for r in g.request_ids:
            depth[r] += g.layers
        finished.extend(done)
        assert all(depth[r] == LAYERS for r in done)
        return True

    for _ in range(600):
        for _ in range(rng.choice([0, 0, 1, 2])):
            rid = f"r{n}"
            n += 1
            sizes[rid] = rng.choice([256, 1024, 1196 * 4, 2691 * 4, 300])
            depth[rid] = 0
            s.submit(rid, sizes[rid])
        if not step():
            clock.t += 0.001
    while step():
        pass
    assert sorted(finished) == sorted(depth) and len(s) == 0
    assert batched > 10


def test_deterministic_under_fake_clock() -> None:
    def trace() -> list[tuple]:
        clock = Clock()
        s = TwsrftScheduler(LAYERS, cost, window_s=0.004, token_budget=3000, clock=clock)
        out = []
        for i in range(40):
            s.submit(i, 300 + (i * 613) % 5000)
            g = s.next_grant()
            out.append((g.job_id, g.request_ids, g.start_layer, g.layers))
            run(s, clock, g)
        return out

    assert trace() == trace()


def test_jobs_view_and_remaining() -> None:
    clock = Clock()
    s = make(clock, window_s=0.002)
    s.submit("a", 1000)
    s.submit("b", 2000)
    g = s.next_grant()
    views = {v.request_ids: v for v in s.jobs()}
    assert views[("a",)].running and not views[("b",)].running
    run(s, clock, g)
    a = {v.request_ids: v for v in s.jobs()}[("a",)]
    assert a.depth == g.layers and a.layers_left == LAYERS - g.layers
    assert s.remaining(a) == pytest.approx(cost(1000, LAYERS - g.layers))


def test_invalid_inputs() -> None:
    clock = Clock()
    with pytest.raises(ValueError, match="num_layers"):
        TwsrftScheduler(0, cost)
    with pytest.raises(ValueError, match="policy"):
        TwsrftScheduler(4, cost, policy="lifo")
    with pytest.raises(ValueError, match="window_s"):
        TwsrftScheduler(4, cost, window_s=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        TwsrftScheduler(4, cost, max_wait_s=-1)
    with pytest.raises(ValueError, match="token_budget"):
        TwsrftScheduler(4, cost, token_budget=0)
    s = make(clock)
    with pytest.raises(ValueError, match="patches"):
        s.submit("x", 0)
    s.submit("x", 100)
    g = s.next_grant()
    with pytest.raises(RuntimeError, match="grant"):
        s.next_grant()
    with pytest.raises(ValueError, match="job_id"):
        s.report(g.job_id + 1, 1)
    with pytest.raises(ValueError, match="layers_done"):
        s.report(g.job_id, g.layers + 1)


def test_aging_without_deadline_serves_the_oldest_starving_job_first() -> None:
    """The engine's chunked stage runs TWSRFT without a deadline: among jobs past `max_wait_s`
    the one waiting longest goes first - not the newest, and not the shortest."""
    clock = Clock()
    s = make(clock, window_s=math.inf, max_wait_s=0.5)
    s.submit("old", 9000)
    clock.t = 0.1
    s.submit("newer", 5000)  # shorter than "old": SRPT alone would pick it
    clock.t = 0.6
    s.submit("short", 100)  # shortest of all, not starving
    clock.t = 0.7  # "old" waited 0.7 s, "newer" 0.6 s: both starving
    order = [g.request_ids[0] for g in drain(s, clock)]
    assert order == ["old", "newer", "short"], order  # "newer" still starves after "old"
