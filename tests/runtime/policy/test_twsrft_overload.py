"""TWSRFT with a deadline (overload): live jobs shortest first, late jobs demoted with a bounded
wait, overdue jobs first (a bounded tail), waits counted from arrival, batching only where it
cannot delay the chosen job."""

from __future__ import annotations

import math
import random

import pytest

from spaceserve.runtime.policy.twsrft import TwsrftScheduler
from tests.runtime.policy.test_twsrft import LAYERS, Clock, cost


def make(clock: Clock, **kw) -> TwsrftScheduler:
    kw.setdefault("token_budget", 1)
    kw.setdefault("window_s", math.inf)
    return TwsrftScheduler(LAYERS, cost, clock=clock, **kw)


def step(s: TwsrftScheduler, clock: Clock):
    g = s.next_grant()
    if g is None:
        return None, ()
    clock.t += cost(g.patches, g.layers)
    return g, s.report(g.job_id, g.layers)


def test_live_jobs_first_shortest_remaining_late_ones_after() -> None:
    clock = Clock()
    clock.t = 10.0
    s = make(clock, deadline_s=0.1, max_wait_s=1.0)
    s.submit("late", 500, arrival=9.5)  # arrived 0.5 s ago: cannot meet 100 ms any more
    s.submit("big", 3000)
    s.submit("small", 500)
    order = []
    while (g := step(s, clock)[0]) is not None:
        order.append(g.request_ids[0])
    assert order == ["small", "big", "late"]


def test_one_aged_grant_per_period_goes_to_the_oldest_late_job() -> None:
    """Catches an aging rule that picks the newest starving job, and a shared wait clock that
    is never reset (every grant would then go to late jobs)."""
    clock = Clock()
    s = make(clock, deadline_s=0.05, max_wait_s=0.1, window_s=0.002)
    s.submit("old", 3000, arrival=-2.0)  # both late; the older one is the bigger
    s.submit("newer", 1000, arrival=-1.0)
    rng = random.Random(1)
    n, grants = 0, []
    while clock.t < 1.0:
        if rng.random() < 0.6:  # a stream of live work that alone would fill the encoder
            s.submit(f"live{n}", rng.choice([500, 800, 1200]))
            n += 1
        g, _ = step(s, clock)
        if g is None:
            clock.t += 0.001
            continue
        grants.append((clock.t, g.request_ids[0]))
    late = [(t, r) for t, r in grants if r in ("old", "newer")]
    assert late and late[0][1] == "old"  # the oldest late job first
    assert all(r == "old" for _, r in late[:3])  # and it keeps the aged grants until done
    # about one aged grant per max_wait_s, not every grant
    assert len(late) <= 1.0 / 0.1 + 2, len(late)
    assert len(grants) > 5 * len(late)


def test_late_job_finishes_in_bounded_time_under_overload() -> None:
    clock = Clock()
    s = make(clock, deadline_s=0.05, max_wait_s=0.1, window_s=0.003)
    s.submit("late", 2000, arrival=-1.0)  # 20 ms of work, 2 ms per layer: one layer a grant
    done_at = None
    n = 0
    while clock.t < 3.0 and done_at is None:
        s.submit(f"live{n}", 600)  # arrivals faster than the encoder drains them
        s.submit(f"live{n}b", 700)
        n += 1
        _, done = step(s, clock)
        if "late" in done:
            done_at = clock.t
    # LAYERS aged grants, one per max_wait_s (plus the grant in flight each time)
    assert done_at is not None and done_at <= LAYERS * (0.1 + 0.003) + 0.01, done_at


def test_deadlines_count_from_arrival_not_from_the_last_grant() -> None:
    """A preempted job does not get younger: its deadline stays arrival + deadline_s."""
    clock = Clock()
    s = make(clock, deadline_s=0.05, max_wait_s=10.0, window_s=0.008)
    s.submit("long", 4000)  # 40 ms of work, 4 ms a layer: live at first
    g, _ = step(s, clock)  # two layers, to t = 8 ms
    view = s.jobs()[0]
    assert g.layers == 2 and view.arrival == 0.0 and not s.late(view, clock.t)
    clock.t = 0.02  # 32 ms left: finishing at 52 ms > 50 ms after its arrival
    assert s.late(s.jobs()[0], clock.t)
    s.submit("short", 1000)  # live: it goes first even though "long" started earlier
    assert s.next_grant().request_ids == ("short",)


def test_aging_clock_resets_after_each_grant() -> None:
    """Without a deadline: a starving job gets one grant, then waits its turn again (a wait
    clock never reset would keep it first and starve the short jobs instead)."""
    clock = Clock()
    s = make(clock, max_wait_s=0.02, window_s=0.003)
    s.submit("long", 3000)  # 3 ms per layer
    clock.t = 0.03
    for i in range(3):
        s.submit(f"s{i}", 2000)
    g, _ = step(s, clock)
    assert g.request_ids == ("long",) and g.layers == 1  # it starved: one grant
    assert step(s, clock)[0].request_ids == ("s0",)  # then shortest first again
    assert step(s, clock)[0].request_ids == ("s0",)


def flat(patches: int, layers: int) -> float:
    """An under-occupied device: up to 2000 patches cost the same."""
    return max(patches, 2000) * layers * 1e-6


@pytest.mark.parametrize("model", [cost, flat])
def test_batching_never_delays_the_chosen_job(model) -> None:
    clock = Clock()
    s = TwsrftScheduler(LAYERS, model, window_s=math.inf, token_budget=16384, clock=clock)
    for i, p in enumerate([300, 400, 500, 1500, 4000]):
        s.submit(i, p)
    g = s.next_grant()
    alone = model(300, LAYERS)
    assert model(g.patches, LAYERS) <= alone * (1 + 1e-9)
    if model is cost:
        assert g.request_ids == (0,)  # a linear cost: any merge delays the shortest job
    else:
        assert set(g.request_ids) == {0, 1, 2} and g.patches == 1200  # merges for free


def test_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        TwsrftScheduler(4, cost, deadline_s=0.0)


def test_an_overdue_job_goes_first_oldest_first_and_finishes() -> None:
    """Past its deadline by more than `overdue_s`, a job goes before live and late ones (the
    oldest overdue first) and keeps its turn until done: its extra wait is bounded."""
    clock = Clock()
    clock.t = 10.0
    s = make(clock, deadline_s=0.1, max_wait_s=1.0, overdue_s=0.2, window_s=0.002)
    s.submit("late", 2000, arrival=9.85)  # 0.15 s old: late, not yet overdue
    s.submit("overdue", 3000, arrival=9.6)  # 0.4 s old > 0.1 + 0.2
    s.submit("older", 4000, arrival=9.5)
    s.submit("small", 500)  # live
    order = []
    while (g := step(s, clock)[0]) is not None:
        if not order or order[-1] != g.request_ids[0]:
            order.append(g.request_ids[0])
    # whole, one after the other; then the live job; "late" is not overdue yet at 10.07 s
    assert order == ["older", "overdue", "small", "late"], order
    assert TwsrftScheduler(LAYERS, cost, deadline_s=1.8, clock=clock).overdue_s is None
    with pytest.raises(ValueError, match="overdue_s"):
        TwsrftScheduler(LAYERS, cost, deadline_s=1.0, overdue_s=-1.0, clock=clock)
