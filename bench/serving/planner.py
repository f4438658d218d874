"""Host cost of planning one language-model step for the real Qwen2-VL runner.

A tiny Qwen2-VL (the planner's cost depends on the batch, not on the layers) runs behind
`Qwen2VLRunner` on the CPU with its forward replaced by a no-op, so what is timed is everything
the runner does on the host per step besides the model: step metadata (block tables, slot
mapping, M-RoPE positions, logits rows), the attention backend's work lists, token ids and
image rows. Rows:

- ``runner decode``: `Qwen2VLRunner.execute` on a decode step of `batch` sequences whose
  contexts grow by one token per step (new KV blocks appear as they would in the engine);
- ``runner mixed``: the same batch with one sequence replaced by a 256-token prefill chunk;
- ``plan_step decode``: the functional `plan_step` on the decode step (lists in, a fresh
  context out), as tests, benchmarks and one-off steps use it;
- ``null planner``: the engine's planner for `NullModelRunner` on the same decode batch.

Goal: the whole engine step (scheduler + planner + dispatch) <= 0.3 ms at batch 64, so the
runner's planning must stay well under that.

    PYTHONPATH=. python3 bench/serving/planner.py [--batch 64] [--steps 400] [--backend triton]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the planner runs, no kernel launches

import torch  # noqa: E402

GOAL_MS = 0.3
BLOCK_SIZE = 16
IMAGE, VIDEO, VSTART, VEND = 200, 201, 202, 203


def tiny_model(backend: str) -> Any:
    """A one-layer Qwen2-VL with random weights on the CPU."""
    from transformers import Qwen2VLConfig

    from spaceserve.models import from_config

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=0, bos_token_id=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)
    return from_config(config, attention_backend=backend)


class DecodeSim:
    """`batch` running requests of growing length, as the scheduler would hand them over."""

    def __init__(self, runner: Any, batch: int, context: int, prompt: int = 64) -> None:
        from spaceserve.runtime.core.request import Request, SamplingParams

        self.runner = runner
        self.reqs = []
        self.next_block = 0
        for i in range(batch):
            req = Request(str(i), i, [(5 + i + j) % 190 + 4 for j in range(prompt)],
                          SamplingParams(max_tokens=1 << 20), seed=i)
            runner.prepare_request(req)
            req.token_ids += [(7 * i + j) % 190 + 4 for j in range(context + i - prompt + 1)]
            req.num_computed = len(req.token_ids) - 1
            req.row = i
            self._grow(req)
            self.reqs.append(req)

    def _grow(self, req: Any) -> None:
        need = -(-len(req.token_ids) // BLOCK_SIZE)
        while len(req.block_ids) < need:
            req.block_ids.append(self.next_block)
            self.next_block += 1

    def batch(self, prefill: int = 0) -> Any:
        """This step's ScheduledBatch: decodes, then (when `prefill`) one prefill chunk."""
        from spaceserve.runtime.core.batch import ScheduledBatch

        dec = self.reqs[:-1] if prefill else self.reqs
        reqs = list(dec)
        cached = [r.num_computed for r in dec]
        new = [1] * len(dec)
        if prefill:
            last = self.reqs[-1]
            reqs.append(last)
            cached.append(0)
            new.append(min(prefill, len(last.token_ids)))
        need = [True] * len(dec) + ([False] if prefill else [])
        return ScheduledBatch(reqs=reqs, num_cached=cached, num_new=new, need_logits=need,
                              sample_reqs=list(dec), num_decodes=len(dec),
                              num_tokens=sum(new))

    def advance(self) -> None:
        """Every decoding request computed its token and sampled the next one."""
        for req in self.reqs:
            req.num_computed = len(req.token_ids)
            req.token_ids.append(9)
            self._grow(req)


def time_ms(step: Callable[[], Any], after: Callable[[], Any], steps: int,
            repeats: int = 5) -> float:
    """Median over `repeats` of the mean ms of `step` (`after` runs untimed between steps)."""
    for _ in range(max(5, steps // 10)):
        step()
        after()
    means = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            total += time.perf_counter() - t0
            after()
        means.append(total / steps * 1e3)
    return statistics.median(means)


def runner_for(model: Any, batch: int, max_len: int) -> Any:
    from spaceserve.runtime.worker.protocol import StepLimits
    from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner

    runner = Qwen2VLRunner(model, eos_token_ids=[0])
    limits = StepLimits(max_num_seqs=batch, max_num_batched_tokens=2048,
                        max_model_len=max_len, block_size=BLOCK_SIZE)
    runner.allocate_kv_cache(batch * (-(-max_len // BLOCK_SIZE)) + 8, limits)
    model.forward = lambda input_ids, ctx, kv_cache, **kw: None  # host work only
    return runner


def measure(batch: int = 64, steps: int = 400, context: int = 1000,
            backend: str = "triton") -> dict[str, float]:
    """Per-step host ms of each row (see the module docstring)."""
    from spaceserve.runtime.worker.protocol import StepLimits, StepPlanner

    max_len = context + batch + 4 * (6 * steps + 5) + 512  # four rows of growing contexts
    model = tiny_model(backend)
    runner = runner_for(model, batch, max_len)
    sim = DecodeSim(runner, batch, context)
    out: dict[str, float] = {}
    out["runner decode"] = time_ms(lambda: runner.execute(sim.batch()), sim.advance, steps)
    out["runner mixed"] = time_ms(lambda: runner.execute(sim.batch(prefill=256)), sim.advance,
                                  steps)

    def functional() -> Any:
        b = sim.batch()
        return model.plan_step(b.num_cached, b.num_new, [r.block_ids for r in b.reqs],
                               block_size=BLOCK_SIZE,
                               rope_deltas=[r.model_state[1] for r in b.reqs])

    out["plan_step decode"] = time_ms(functional, sim.advance, steps)
    planner = StepPlanner(StepLimits(batch, 2048, max_len, BLOCK_SIZE), "cpu")
    for r in sim.reqs:
        r.synced_blocks = 0
    out["null planner"] = time_ms(lambda: planner.plan(sim.batch()), sim.advance, steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.batch, args.steps, args.context, args.backend)
    print(f"batch {args.batch}, context ~{args.context}, backend {args.backend}, "
          f"block size {BLOCK_SIZE} (CPU host ms per step; goal: engine step <= {GOAL_MS})")
    for name, ms in rows.items():
        print(f"{name:>18} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
