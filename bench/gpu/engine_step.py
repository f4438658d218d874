"""The "engine-step" section: does the pipelined engine step keep the GPU busy?

bench/serving/engine_step.py measures the host's work per step on CPU (the model's work
subtracted); this section runs the real step on the device: random-weight Qwen2-VL-7B (all 28
LLM layers, bf16, Triton kernels) in the pipelined ``temporal`` engine, decode batches of 1, 16
and 64 requests (512-token prompts), greedy and random sampling (`bench_engine_step.MODES`),
each with its CUDA graphs replayed and then with them switched off (the same engine, requests
and KV cache; `eager`). Per configuration, over `Plan.steps` decode-only steps:

- ``device_ms``: median device time of a step (CUDA events on the engine's stream: one as the
  model's forward is launched, after the host has planned the step, one after the draw is
  launched). From a graph the forward is the kernels' time; eagerly, and in the sampler's
  launches after it, the span also holds the gaps where the device waited for launches.
- ``host_ms``: median host wall time of ``engine.step()`` less its wait for the previous step's
  tokens (the read-back): scheduling, planning, launching, sampling bookkeeping, accounting.
- ``idle_fraction``: of the event timeline from the first step's start to the last step's end,
  the share the device spent between steps (a step's end event to the next step's start):
  the time the pipelined host left it without work.
- ``graph_timed``: every measured step replayed a decode graph (``graph_steps`` says how many).

On CPU (`dry_run`) the same control flow runs a tiny model in fp32 with wall-clock marks in
place of the events (``timing`` says which); nothing there is graph-timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import BENCH_GRAPH_RESERVE_BYTES, format_table, section_rows, write_json

SECTION = "engine-step"
BATCHES = (1, 16, 64)
SAMPLING = ("greedy", "random")


@dataclass(frozen=True)
class Plan:
    """What the section measures (the GPU's by default, `dry_plan` on CPU)."""

    model: str = "qwen2-vl-7b-random"
    llm_layers: int | None = None  # None: the model's own (28)
    batches: tuple[int, ...] = BATCHES
    sampling: tuple[str, ...] = SAMPLING
    prompt: int = 512
    steps: int = 32  # measured decode steps per configuration
    warm: int = 6  # steps run before each measurement
    max_model_len: int = 1024  # one block-table width of graphs per batch size
    max_num_batched_tokens: int = 4096
    device: str | None = None
    reserve_s: float = 3.0  # kept for the table and the rows file


def dry_plan() -> Plan:
    from bench.common import register_dry_model

    return Plan(model=register_dry_model(), batches=(1, 4, 8), prompt=16, steps=8, warm=2,
                max_model_len=256, max_num_batched_tokens=256, device="cpu", reserve_s=0.5)


class StepTimeline:
    """Instruments one engine: marks around each launched step (CUDA events on the current
    stream, or `time.perf_counter` on CPU), the host's wait for read-backs, and which steps were
    decode-only and which replayed a graph. Counts only while `active`."""

    def __init__(self, engine: Any) -> None:
        self.cuda = torch.device(engine.runner.device).type == "cuda"
        self.active = False
        self.marks: list[tuple[Any, Any]] = []
        self.wait_s = 0.0
        self.decode_only = self.graph_steps = 0
        launch, complete = engine._launch, engine._complete
        prepare, run_step = engine.runner.prepare_step, engine.runner.run_step
        self._start: Any = None

        def timed_launch(batch: Any, *a: Any, **k: Any) -> Any:
            if not self.active:
                return launch(batch, *a, **k)
            self._start = None
            out = launch(batch, *a, **k)
            end = self._mark()
            self.marks.append((self._start if self._start is not None else end, end))
            self.decode_only += batch.num_decodes == batch.num_seqs
            return out

        def timed_run_step(*a: Any, **k: Any) -> Any:
            if self.active and self._start is None:  # the forward's first launch comes next
                self._start = self._mark()
            return run_step(*a, **k)

        def timed_complete(launched: Any, *a: Any, **k: Any) -> Any:
            if self.active and launched.sampled is not None:
                t0 = time.perf_counter()
                launched.sampled.fetch()  # the wait; `complete` then reads the cached draws
                self.wait_s += time.perf_counter() - t0
            return complete(launched, *a, **k)

        def counted_prepare(*a: Any, **k: Any) -> Any:
            step = prepare(*a, **k)
            self.graph_steps += self.active and step.graph is not None
            return step

        engine._launch, engine._complete = timed_launch, timed_complete
        engine.runner.prepare_step, engine.runner.run_step = counted_prepare, timed_run_step

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def reset(self) -> None:
        self.marks, self.wait_s, self.decode_only, self.graph_steps = [], 0.0, 0, 0

    def figures(self) -> dict[str, float]:
        """device_ms (median span), period_ms (timeline / steps) and idle_fraction."""
        if self.cuda:
            torch.cuda.synchronize()
        spans = [self._ms(a, b) for a, b in self.marks]
        gaps = [self._ms(b, a2) for (_, b), (a2, _) in zip(self.marks, self.marks[1:],
                                                          strict=False)]
        total = self._ms(self.marks[0][0], self.marks[-1][1])
        return {"device_ms": statistics.median(spans), "device_ms_max": max(spans),
                "period_ms": total / len(self.marks),
                "idle_fraction": max(0.0, sum(gaps)) / total if total > 0 else float("nan")}


@contextmanager
def eager(runner: Any) -> Iterator[None]:
    """Decode steps run eagerly: the runner finds no graph to replay (`DecodeGraphSet.pick`
    answers None) while the captured graphs stay in place."""
    graphs = runner.graphs
    if not len(graphs):
        yield
        return
    graphs.pick = lambda *a, **k: None
    try:
        yield
    finally:
        del graphs.pick


def measure(engine: Any, timeline: StepTimeline, steps: int) -> dict[str, Any]:
    """`steps` engine steps, timed (module docstring)."""
    timeline.reset()
    timeline.active = True
    walls, waits = [], []
    try:
        for _ in range(steps):
            w0, t0 = timeline.wait_s, time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            waits.append(timeline.wait_s - w0)
    finally:
        timeline.active = False
    host = [(w - x) * 1e3 for w, x in zip(walls, waits, strict=True)]
    return {"host_ms": statistics.median(host), "wait_ms": statistics.median(waits) * 1e3,
            "wall_ms": statistics.median(walls) * 1e3, **timeline.figures(),
            "decode_steps": timeline.decode_only, "graph_steps": timeline.graph_steps}


def run_batch(engine: Any, timeline: StepTimeline, plan: Plan, batch: int, sampling: str,
              base: dict[str, Any]) -> list[dict[str, Any]]:
    """One batch of requests with one sampling mode: graphs, then eagerly; two rows."""
    from bench.serving.engine_step import MODES
    from spaceserve.runtime.core.request import SamplingParams

    info = engine.runner.info
    top = min(info.vocab_size, info.image_token_id or info.vocab_size) - 4
    params = SamplingParams(max_tokens=plan.max_model_len - plan.prompt - 1, ignore_eos=True,
                            **MODES[sampling])
    ids = [engine.add_request({"prompt_token_ids": [(7919 * i + 31 * j) % top + 4
                                                    for j in range(plan.prompt)]}, params)
           for i in range(batch)]
    prefill = -(-batch * plan.prompt // plan.max_num_batched_tokens) + 1
    rows = []
    try:
        for graphs in (True, False):
            with (eager(engine.runner) if not graphs else _nothing()):
                for _ in range((prefill if graphs else 0) + plan.warm):
                    engine.step()
                context = statistics.mean(len(r.token_ids) for r in engine._active.values())
                got = measure(engine, timeline, plan.steps)
            row = base | {"batch": batch, "sampling": sampling, "graphs": graphs,
                          "graph_timed": got["graph_steps"] == plan.steps, "steps": plan.steps,
                          "context": round(context)} | got
            if got["decode_steps"] != plan.steps or engine.num_active != batch:
                row["note"] = (f"{got['decode_steps']} of {plan.steps} steps decode-only, "
                               f"{engine.num_active} of {batch} requests active")
            rows.append(row)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def headline(rows: list[dict[str, Any]]) -> str:
    """One batch and sampling mode: graphs against eager."""
    g, e = rows
    return (f"b{g['batch']} {g['sampling']}: graphs {g['device_ms']:.2f} ms device / "
            f"{g['host_ms']:.3f} ms host, idle {g['idle_fraction']:.0%}"
            f"{'' if g['graph_timed'] else ' (not graph-timed)'}; eager "
            f"{e['device_ms']:.2f} / {e['host_ms']:.3f} ms, idle {e['idle_fraction']:.0%}")


def run_plan(plan: Plan, results_dir: str | Path, time_budget_s: float,
             clock: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """Measure `plan` within `time_budget_s` seconds: a row per (batch, sampling, graphs),
    configurations left without time said so."""
    from spaceserve.bench.random_model import RandomModels

    start = clock()
    deadline = start + time_budget_s - plan.reserve_s
    device = torch.device(plan.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = "triton" if device.type == "cuda" else "torch"
    models = RandomModels(plan.model, llm_layers=plan.llm_layers, backends=(backend,),
                          device=device)
    blocks = max(plan.batches) * -(-plan.max_model_len // 16) + 16
    engine, _, _ = models.engine(
        "temporal", block_size=16, num_kv_blocks=blocks, max_num_seqs=max(plan.batches),
        max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        max_encoder_tokens_per_step=1024, graph_batch_sizes=tuple(plan.batches),
        graph_context_lens=(plan.max_model_len,), enable_prefix_caching=False,
        encoder_cache_bytes=0, graph_reserve_bytes=BENCH_GRAPH_RESERVE_BYTES)
    timeline = StepTimeline(engine)
    base = {"section": SECTION, "model": plan.model, "llm_layers": models.llm_layers,
            "dtype": str(models.dtype).removeprefix("torch."),
            "timing": "cuda-events" if timeline.cuda else "wall (CPU)",
            "graph_batch_sizes": list(engine.graph_batch_sizes)}  # captured (none on CPU)
    print(f"{plan.model}: LLM {models.llm_layers} layers, {base['dtype']}, graphs for batch "
          f"sizes {list(engine.graph_batch_sizes)}; built in {clock() - start:.1f} s", flush=True)
    rows = section_rows()
    try:
        for batch in plan.batches:
            for sampling in plan.sampling:
                if clock() > deadline:
                    rows += [base | {"batch": batch, "sampling": sampling, "graphs": g,
                                     "skipped": "time budget spent"} for g in (True, False)]
                    continue
                pair = run_batch(engine, timeline, plan, batch, sampling, base)
                pair[-1]["headline"] = headline(pair)
                rows += pair
    finally:
        engine.close()
    write_json(Path(results_dir) / f"{SECTION}_rows.json",
               {"plan": asdict(plan), "rows": list(rows)})
    print(format_table([r for r in rows if "device_ms" in r],
                       ["batch", "sampling", "graphs", "graph_timed", "device_ms", "period_ms",
                        "host_ms", "wait_ms", "idle_fraction", "graph_steps"]))
    return list(rows)


def run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """GPU harness entry point (bf16 Qwen2-VL-7B shapes, every LLM layer)."""
    if not torch.cuda.is_available():
        return [{"section": SECTION, "skipped": "needs a CUDA device"}]
    return run_plan(Plan(), results_dir, time_budget_s)


def dry_run(results_dir: str | Path, time_budget_s: float) -> list[dict[str, Any]]:
    """The section's control flow on CPU: a tiny model in fp32, wall-clock marks."""
    torch.set_num_threads(1)
    return run_plan(dry_plan(), results_dir, time_budget_s)
