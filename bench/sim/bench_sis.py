"""How long SIS's `decide` takes with many encoder jobs pending (goal: <= 0.1 ms at 64).

The states are what a saturated GPU shows: `pending` encoder jobs of the default image mix at
random depths and ages up to 3 s, a few prompts ready to prefill, a decode batch of 32-128 and
an arrival-rate estimate near saturation. Curves: the analytic (modelled) Qwen2-VL-7B on the
H200 preset, the splits `choose_splits` picks under the default SLO. Each round the scheduler's
clock advances 5 ms (a decode step), so hysteresis runs as in the engine.

    PYTHONPATH=. python -m pytest bench/sim/bench_sis.py -p no:cacheprovider --benchmark-only \
        --benchmark-timer=time.thread_time --benchmark-columns=min,median,mean

Thread CPU time keeps other processes on a shared machine out of the figure (wall time under
load counts the waits). The plain `pytest` collects only tests/ and bench/conftest.py keeps
bench/ scripts out of `pytest bench/`, so this file runs only when named. Each entry's
`extra_info` says whether its median meets the goal (a benchmark reports; it does not fail).
"""

from __future__ import annotations

import random

import pytest

from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo

GOAL_S = 1e-4
PATCHES = (1024, 4784, 5476, 10764)  # the default mix's ViT patches (4 per LLM token)
STATES = 64


def random_state(rng: random.Random, pending: int, depth: int = 32) -> SisState:
    """A saturated GPU's view: `pending` encoder jobs, prompts ready, a decode batch."""
    encode = tuple(PendingEncode(p, rng.randint(1, depth), p // 4 + 64, rng.uniform(0, 3.0), 1)
                   for p in (rng.choice(PATCHES) for _ in range(pending)))
    ready = rng.randint(0, 4)
    prefill = tuple(rng.choice(PATCHES) // 4 + 64 for _ in range(ready))
    ages = tuple(rng.uniform(0, 2.5) for _ in range(ready))
    return SisState(encode, prefill, rng.choice((32, 64, 96, 128)),
                    float(rng.choice(range(1024, 2049, 64))), ages, rng.uniform(10, 22),
                    rng.choice(PATCHES), 700.0)


def scheduler(slo: str = "ttft:2000,tpot:50", **kw: object) -> SpaceInferenceScheduler:
    """SIS on modelled Qwen2-VL-7B / H200 curves with the splits the engine would pick; its
    clock advances 5 ms per read."""
    from spaceserve.runtime.policy.analytic.model import analytic_curves
    from spaceserve.runtime.policy.scheduling import scheduling_policy

    curves = analytic_curves()
    policy = scheduling_policy(curves, Slo.parse(slo))
    t = [0.0]

    def clock() -> float:
        t[0] += 0.005
        return t[0]

    return SpaceInferenceScheduler(curves, policy.splits, objective=policy.objective,
                                   slo=policy.slo, decode_margin=policy.decode_margin,
                                   ttft_margin=policy.ttft_margin,
                                   comfort_factor=policy.comfort_factor, clock=clock, **kw)


@pytest.mark.parametrize("actions", ["share", "superset"])
@pytest.mark.parametrize("pending", [32, 64])
def test_decide(benchmark, pending: int, actions: str) -> None:
    rng = random.Random(pending)
    states = [random_state(rng, pending) for _ in range(STATES)]
    sis = scheduler(actions=actions)
    for s in states:  # warm the caches a long-running engine has warm
        sis.decide(s)
    it = iter(range(1 << 62))

    def one() -> None:
        sis.decide(states[next(it) % STATES])

    benchmark.pedantic(one, rounds=2000, iterations=1, warmup_rounds=50)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(pending=pending, actions=actions, goal_s=GOAL_S,
                                goal_met=bool(median <= GOAL_S))
