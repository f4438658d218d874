"""The simulator predicts the engine: the engine on the null model, with a clock that advances by
the same resource-utility curves the simulator prices work with, and the simulator, on the same
arrivals, agree on mean and p99 TTFT and TPOT (within 10%; the time-multiplexed modes agree to
well under 1% - they run the same scheduler objects). A deliberate divergence (another token
budget on one side) breaks the agreement, so the comparison can fail.

Co-located modes are not bound here: the engine's spatial step overlaps two lanes on a real
device, which a single advancing clock cannot express.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine import engine as engine_module
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.policy.analytic.model import analytic_curves, qwen2_vl_7b_config
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.metrics import percentile
from spaceserve.runtime.sim.stepped import batch_seconds
from spaceserve.runtime.sim.workload import Request, Workload, generate
from spaceserve.runtime.worker.null import NullModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

IMG = 3  # the null model's image token id
N_TEXT = 31  # text tokens before the image; the image is followed by one more token
SLO = Slo.parse("ttft:2000,tpot:50")
WORKLOAD = Workload(20.0, 3.0, image_mix={"448x448": 0.5, "1280x720": 0.5}, text_rate=4.0,
                    text_tokens=N_TEXT + 1, output_tokens=40, seed=3)
GRIDS = {256: (1, 32, 32), 1196: (1, 52, 92)}  # image tokens -> (t, h, w) patches
TOLERANCE = 0.10


class Clock:
    """The engine's injected clock: moved only by the runner's predicted work."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedRunner(NullModelRunner):
    """The null model, every launch advancing `clock` by the curves' whole-GPU time of it
    (an engine step plus the simulator's host time, an encoder pass or layer chunk)."""

    def __init__(self, curves: CurveSet, clock: Clock, host_s: float) -> None:
        super().__init__(check=False, max_model_len=8192, encoder_layers=curves.encoder_depth)
        self.curves, self.clock, self.host_s = curves, clock, host_s
        self.sms = curves.num_sms

    def execute(self, batch: Any, *, stage: str = "decoder") -> torch.Tensor:
        self.clock.t += batch_seconds(self.curves, batch, self.sms) + self.host_s
        return super().execute(batch, stage=stage)

    def encode(self, mms: Any) -> list[torch.Tensor]:  # temporal: whole passes, one batch
        patches = sum(int(mm.pixel_values.shape[0]) for mm in mms)
        self.clock.t += self.curves.encoder(patches, self.curves.encoder_depth, self.sms)
        return super().encode(mms)

    def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
        ran = super().advance_encode(job, layers)
        self.clock.t += ran * self.curves.encoder(int(job.mm.pixel_values.shape[0]), 1, self.sms)
        return ran

    def finish_encode(self, job: Any, *, num_sms: int | None = None) -> torch.Tensor:
        return NullModelRunner.encode(self, [job.mm])[0]  # the layers were paid for


def prompt(req: Request, gen: torch.Generator) -> dict:
    ids = torch.randint(4, 97, (N_TEXT,), generator=gen).tolist()
    if req.kind == "text":
        return {"prompt_token_ids": ids + [1]}
    t, h, w = GRIDS[req.image_tokens]
    return {"prompt_token_ids": ids + [IMG] * req.image_tokens + [1],
            "pixel_values": torch.randn(t * h * w, 8, generator=gen),
            "image_grid_thw": torch.tensor([[t, h, w]])}


def run_engine(curves: CurveSet, path: str, cfg: SimConfig, monkeypatch) -> list[tuple]:
    """(ttft, tpot) of every request, served by the engine in `cfg.mode` on the null model."""
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(monotonic=clock))
    ecfg = EngineConfig(mode=cfg.mode, block_size=cfg.block_size, num_kv_blocks=cfg.kv_blocks,
                        max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_held_embeddings=cfg.max_held,
                        max_encoder_tokens_per_step=cfg.max_encoder_tokens, curves=path,
                        encoder_window_s=cfg.window_s or 0.02, slo=cfg.slo,
                        async_scheduling=False, enable_prefix_caching=False,
                        encoder_cache_bytes=0)
    eng = Engine(TimedRunner(curves, clock, cfg.host_s), ecfg, clock=clock)
    gen = torch.Generator().manual_seed(0)
    arrivals = generate(WORKLOAD)
    reqs, i, idle = [], 0, 0
    while i < len(arrivals) or eng.has_unfinished():
        if i < len(arrivals) and arrivals[i].arrival <= clock.t:
            a = arrivals[i]
            params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True)
            rid = eng.add_request(prompt(a, gen), params)
            req = eng._active[rid]
            req.arrival_time = a.arrival  # it came in during the step that just ran
            reqs.append(req)
            i += 1
            continue
        before = clock.t
        eng.step()
        if clock.t == before:  # nothing ran: wait for the next arrival
            idle += 1
            assert i < len(arrivals) and idle < 10_000, "the engine stalled"
            clock.t = max(clock.t, arrivals[i].arrival)
    eng.check_idle()
    return [(r.first_token_time - r.arrival_time,
             (r.token_times[-1] - r.first_token_time) / (len(r.token_times) - 1))
            for r in reqs]


def run_sim(curves: CurveSet, cfg: SimConfig) -> list[tuple]:
    res = simulate(curves, cfg, WORKLOAD)
    return [(r.first_token - r.arrival, (r.finish - r.first_token) / (r.generated - 1))
            for r in res.requests if r.kind != "background"]


def summary(rows: list[tuple]) -> dict[str, float]:
    ttft, tpot = [r[0] for r in rows], [r[1] for r in rows]
    return {"ttft_mean": sum(ttft) / len(ttft), "ttft_p99": percentile(ttft, 99),
            "tpot_mean": sum(tpot) / len(tpot), "tpot_p99": percentile(tpot, 99)}


def worst(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest relative difference of the four figures."""
    return max(abs(a[k] - b[k]) / b[k] for k in a)


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> tuple[CurveSet, str]:
    c = analytic_curves(qwen2_vl_7b_config(), "H200", name="Qwen2-VL-7B")
    return c, str(c.save(tmp_path_factory.mktemp("curves") / "h200.json"))


@pytest.mark.parametrize("mode,window", [("temporal", None), ("temporal-chunked", 0.01)])
def test_the_simulator_predicts_the_engine(curves, mode, window, monkeypatch) -> None:
    c, path = curves
    cfg = SimConfig(mode=mode, background=0, slo=SLO, window_s=window, async_scheduling=False)
    eng = summary(run_engine(c, path, cfg, monkeypatch))
    sim = summary(run_sim(c, cfg))
    assert len(run_sim(c, cfg)) == len(generate(WORKLOAD)) > 40
    assert eng["ttft_p99"] > 2 * eng["ttft_mean"] / 3 and eng["tpot_mean"] > 0.005  # loaded
    assert worst(eng, sim) < TOLERANCE, (eng, sim)
    assert worst(eng, sim) < 0.01, (eng, sim)  # the figure reached: the same scheduler
    other = summary(run_sim(c, dataclasses.replace(cfg, max_num_batched_tokens=256)))
    assert worst(eng, other) > TOLERANCE, (eng, other)  # a divergence is caught
