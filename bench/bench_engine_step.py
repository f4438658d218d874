"""Engine overhead per decode step: scheduler + planner + dispatch + sampling + bookkeeping.

A batch of decoding requests runs against `NullModelRunner(check=False)`, whose "forward" is a
handful of tiny tensor ops; the time of those ops is measured separately and subtracted, so the
reported engine time is what the host spends per step around the model. Goal (CPU, batch 64):
<= 0.3 ms per step. The sampler column is included in the engine time; with random sampling it
is mostly the noise computation over [batch, vocab], device work on a GPU (asynchronous there)
that the CPU has to do itself here.

    PYTHONPATH=. python3 bench/bench_engine_step.py [--batch 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spaceserve.runtime.engine import Engine, EngineConfig
from spaceserve.runtime.request import SamplingParams
from spaceserve.runtime.runner import NullModelRunner

GOAL_MS = 0.3


class TimedNullRunner(NullModelRunner):
    """The null runner, timing its planner and its own tensor math separately."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.plan_s = 0.0
        self.execute_s = 0.0

    def execute(self, batch):
        t0 = time.perf_counter()
        planner = self.planner
        plan_fn = planner.plan

        def timed_plan(b):
            p0 = time.perf_counter()
            out = plan_fn(b)
            self.plan_s += time.perf_counter() - p0
            return out

        planner.plan = timed_plan
        try:
            return super().execute(batch)
        finally:
            planner.plan = plan_fn
            self.execute_s += time.perf_counter() - t0


def measure(batch: int = 64, steps: int = 2000, prompt: int = 128, block_size: int = 16,
            temperature: float = 0.0, repeats: int = 5) -> dict[str, float]:
    """Per-step times in ms (medians over `repeats` runs of `steps` decode steps)."""
    max_len = prompt + steps * (repeats + 1) + 8
    runner = TimedNullRunner(vocab_size=1024, max_model_len=max_len, check=False)
    blocks = batch * (-(-max_len // block_size)) + 8
    engine = Engine(runner, EngineConfig(block_size=block_size, num_kv_blocks=blocks,
                                         max_num_seqs=batch, max_num_batched_tokens=8192,
                                         graph_batch_sizes=()))
    params = SamplingParams(max_tokens=max_len, temperature=temperature, seed=1,
                            ignore_eos=True)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": [(7 * i + j) % 1000 + 4 for j in range(prompt)]},
                           params)
    sampler = engine.sampler
    sample_s = [0.0]

    def timed_sampler(logits, reqs):
        t0 = time.perf_counter()
        out = sampler(logits, reqs)
        sample_s[0] += time.perf_counter() - t0
        return out

    engine.sampler = timed_sampler
    engine.step()  # all prefills in one step
    for _ in range(steps // 10):  # warm up
        engine.step()
    totals, engine_ms, plans, models, samples = [], [], [], [], []
    for _ in range(repeats):
        runner.plan_s = runner.execute_s = sample_s[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = (time.perf_counter() - t0) / steps * 1e3
        plan = runner.plan_s / steps * 1e3
        model = runner.execute_s / steps * 1e3 - plan
        totals.append(total)
        plans.append(plan)
        models.append(model)
        samples.append(sample_s[0] / steps * 1e3)
        engine_ms.append(total - model)
    assert engine.scheduler.running and len(engine.scheduler.running) == batch
    return {"batch": batch, "step_ms": statistics.median(totals),
            "null_model_ms": statistics.median(models), "planner_ms": statistics.median(plans),
            "sampler_ms": statistics.median(samples), "engine_ms": statistics.median(engine_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'sampling':>9} {'batch':>5} {'step ms':>8} {'null model':>10} {'planner':>8} "
          f"{'sampler':>8} {'engine ms':>9}  goal <= {GOAL_MS}")
    for name, temp in (("greedy", 0.0), ("random", 0.8)):
        r = measure(args.batch, args.steps, temperature=temp)
        print(f"{name:>9} {r['batch']:>5} {r['step_ms']:>8.3f} {r['null_model_ms']:>10.3f} "
              f"{r['planner_ms']:>8.3f} {r['sampler_ms']:>8.3f} {r['engine_ms']:>9.3f}  "
              f"{'ok' if r['engine_ms'] <= GOAL_MS else 'over'}")


if __name__ == "__main__":
    main()
