"""The host time the simulator charges per engine step (`SimConfig.host_s`, ``--host-ms``),
measured on this CPU: the engine scheduler's `schedule` + `update` of a continuous batch
(``--batch`` decoding sequences plus a prefill chunk filling a 2048-token budget), and SIS's
`decide` with ``--pending`` encoder jobs waiting (the co-located modes' host work per
scheduling round). Prints the medians in ms.

    python -m bench.sim.host_time --batch 64 --pending 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def schedule_ms(batch: int, rounds: int) -> float:
    """Median ms of one `Scheduler.schedule` + `update` with `batch` decodes and a chunk."""
    from spaceserve.runtime.core.block_manager import BlockManager
    from spaceserve.runtime.core.request import Request
    from spaceserve.runtime.core.sampling_params import SamplingParams
    from spaceserve.runtime.core.scheduler import Scheduler

    sched = Scheduler(BlockManager(1 << 16, 16), max_num_seqs=batch + 8,
                      max_num_batched_tokens=2048, max_model_len=1 << 20)
    params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)
    for i in range(batch):
        req = Request(str(i), i, [1] * 1024, params, 0)
        req.num_computed = 1023
        sched.add(req)
    seq = batch
    times = []
    for _ in range(rounds):
        if not any(r.num_computed < r.num_prompt_tokens for r in sched.running + sched.waiting
                   if r.num_output_tokens == 0):
            sched.add(Request(str(seq), seq, [1] * 4096, SamplingParams(max_tokens=1), 0))
            seq += 1
        t0 = time.perf_counter()
        b = sched.schedule()
        sched.update(b, [1] * len(b.drawn_reqs), 0.0)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def decide_ms(pending: int, rounds: int) -> float:
    """Median ms of one SIS `decide` with `pending` encoder jobs waiting."""
    from spaceserve.runtime.policy.analytic.model import analytic_curves, qwen2_vl_7b_config
    from spaceserve.runtime.policy.sis import PendingEncode, SisState, SpaceInferenceScheduler
    from spaceserve.runtime.sim.config import SimConfig, sim_policy

    curves = analytic_curves(qwen2_vl_7b_config(), "H200", name="Qwen2-VL-7B")
    p = sim_policy(curves, SimConfig())
    sis = SpaceInferenceScheduler(curves, p.splits, objective=p.objective, slo=p.slo,
                                  decode_margin=p.decode_margin, comfort_factor=p.comfort_factor)
    jobs = tuple(PendingEncode(4 * (256 + 97 * i % 2500), 32, 1500, 0.01 * i)
                 for i in range(pending))
    state = SisState(jobs, (), 32, 1152)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sis.decide(state)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="decoding sequences per step")
    p.add_argument("--pending", type=int, default=32, help="encoder jobs SIS sees")
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args(argv)
    if args.batch < 1 or args.pending < 0 or args.rounds < 1:
        raise SystemExit("--batch and --rounds must be >= 1, --pending >= 0")
    print(f"scheduler schedule+update, {args.batch} decodes + a prefill chunk: "
          f"{schedule_ms(args.batch, args.rounds):.3f} ms (median)")
    print(f"SIS decide, {args.pending} pending encoder jobs: "
          f"{decide_ms(args.pending, max(1, args.rounds // 10)):.3f} ms (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
