"""The simulator predicts the engine: the engine on the null model, with a clock that advances by
the same resource-utility curves the simulator prices work with, and the simulator, on the same
arrivals, agree on mean and p99 TTFT and TPOT (within 10%; the time-multiplexed modes agree to
well under 1% - they run the same scheduler objects). A deliberate divergence (another token
budget on one side) breaks the agreement, so the comparison can fail.

The co-located modes run on a virtual device with two lanes (`TwoLanes`): the decoder partition's
launches and the compute partition's stream (prefill chunks, encoder layers) each queue on their
own lane and take the curves' time at their partition's SMs; the engine's clock is its host, which
waits only where the engine waits (reading a decode step's tokens, `synchronize` on an event).
Their curves have no co-running slowdown, so a launch's time is fixed when it is queued.
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
from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.sis_goodput import MIN_SPREADS, IntervalSpread
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.sim.cluster import simulate
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.loops import sis_window
from spaceserve.runtime.sim.loops import spatial_loop as spatial_loop_module
from spaceserve.runtime.sim.loops.stepped import batch_seconds
from spaceserve.runtime.sim.metrics import percentile
from spaceserve.runtime.sim.workload import Request, Workload, generate
from spaceserve.runtime.spatial import launches as launches_module
from spaceserve.runtime.spatial import step as step_module
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


class OneLane(TimedRunner):
    """The null model on a virtual whole GPU, one queue: encoder work and engine steps run in
    launch order, each at the curves' whole-GPU time; a step's host time passes on the host's
    clock before it is launched, and reading its tokens back waits for the queue to finish it.
    A pipelined engine (asynchronous scheduling) plans the next step meanwhile."""

    def __init__(self, curves: CurveSet, clock: Clock, host_s: float) -> None:
        super().__init__(curves, clock, host_s)
        self.free = self.last_end = 0.0

    def attach(self, eng: Any) -> None:
        sample = eng.sampler.sample
        eng.sampler.sample = lambda logits, b: Drawn(sample(logits, b), self.clock,
                                                     self.last_end)

    def _queue(self, seconds: float) -> float:
        self.free = max(self.clock.t, self.free) + seconds
        return self.free

    def execute(self, batch: Any, *, stage: str = "decoder") -> torch.Tensor:
        self.clock.t += self.host_s
        self.last_end = self._queue(batch_seconds(self.curves, batch, self.sms))
        return NullModelRunner.execute(self, batch, stage=stage)

    def encode(self, mms: Any) -> list[torch.Tensor]:
        patches = sum(int(mm.pixel_values.shape[0]) for mm in mms)
        self._queue(self.curves.encoder(patches, self.curves.encoder_depth, self.sms))
        return NullModelRunner.encode(self, mms)

    def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
        ran = NullModelRunner.advance_encode(self, job, layers)
        self._queue(ran * self.curves.encoder(int(job.mm.pixel_values.shape[0]), 1, self.sms))
        return ran


class VirtualEvent:
    """An event recorded on the compute lane: complete once the host clock reaches its time."""

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock.t >= self.at

    def synchronize(self) -> None:
        self.clock.t = max(self.clock.t, self.at)


class Drawn:
    """A step's draws, read back once its lane has finished it (the host waits till then)."""

    def __init__(self, sampled: Any, clock: Clock, at: float) -> None:
        self.sampled, self.clock, self.at, self.batch = sampled, clock, at, sampled.batch

    def fetch(self) -> Any:
        self.clock.t = max(self.clock.t, self.at)
        return self.sampled.fetch()


class TwoLanes(NullModelRunner):
    """The null model on a virtual device of two lanes, each a queue: the decoder partition's
    steps (plus the step's host time, as the simulator charges it) and the compute partition's
    stream (prefill chunks, encoder layers), each priced by the curves at its budget. A decode
    step the engine pipelines (`SpatialRuntime.pipelining`) spends its host time on the host's
    clock instead, before it queues: the host plans it while the step before runs. Launching
    a vision layer costs `layer_launch_s` of the driver's host budget (`launch_s`)."""

    def __init__(self, curves: CurveSet, clock: Clock, cfg: SimConfig) -> None:
        super().__init__(check=False, max_model_len=8192, encoder_layers=curves.encoder_depth)
        self.curves, self.clock, self.cfg = curves, clock, cfg
        self.host_s = cfg.host_s + (cfg.sis_host_s if cfg.mode == "spatial" else 0.0)
        self.free = {"compute": 0.0, "decode": 0.0}
        self.launch_s = 0.0
        self.last_end = 0.0
        self.after = 0.0  # the decode lane's steps start no earlier (a window's end)
        self.spatial: Any = None

    def attach(self, eng: Any) -> None:
        self.spatial = eng.spatial
        sample = eng.sampler.sample
        eng.sampler.sample = lambda logits, b: Drawn(sample(logits, b), self.clock,
                                                     self.last_end)
        eng.encoder.event_factory = lambda: VirtualEvent(self.clock, self.free["compute"])
        eng.spatial.partitions.decoder_wait = self.decoder_wait

    def decoder_wait(self, event: VirtualEvent) -> None:
        """The decoder streams wait on the device for `event` (a window's end)."""
        self.after = max(self.after, event.at)

    def _queue(self, lane: str, seconds: float) -> float:
        start = max(self.clock.t, self.free[lane], self.after if lane == "decode" else 0.0)
        self.free[lane] = start + seconds
        return self.free[lane]

    def execute(self, batch: Any, *, stage: str = "decoder") -> torch.Tensor:
        sms = batch.num_sms(stage)
        if stage == "encoder":  # a prefill chunk on the compute partition
            self.last_end = self._queue("compute", batch_seconds(self.curves, batch, sms, False,
                                                                 "encoder"))
        elif self.spatial.pipelining:  # its host time runs while the step before computes
            self.clock.t += self.host_s
            self.last_end = self._queue("decode", batch_seconds(self.curves, batch, sms))
        else:
            self.last_end = self._queue("decode", batch_seconds(self.curves, batch, sms)
                                        + self.host_s)
        return super().execute(batch, stage=stage)

    def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
        ran = super().advance_encode(job, layers)
        self._queue("compute", self.curves.encoder(int(job.mm.pixel_values.shape[0]), ran,
                                                   num_sms))
        self.launch_s += ran * self.cfg.layer_launch_s
        return ran

    def finish_encode(self, job: Any, *, num_sms: int | None = None) -> torch.Tensor:
        return NullModelRunner.encode(self, [job.mm])[0]  # the layers were paid for


def colocated_settings(cfg: SimConfig) -> dict[str, Any]:
    """The engine settings of a co-located `cfg` (the simulator's defaults where it has them)."""
    out: dict[str, Any] = {"prefill_on": cfg.prefill_on, "sis_actions": cfg.sis_actions,
                           "encoder_launch_budget_s": cfg.launch_budget_s}
    if cfg.mode == "spatial-static":
        out["encoder_sms"] = cfg.static_encoder_sms
    else:
        out["encoder_splits"] = cfg.allowed_encoder_sms
    return out


def prompt(req: Request, gen: torch.Generator) -> dict:
    ids = torch.randint(4, 97, (N_TEXT,), generator=gen).tolist()
    if req.kind == "text":
        return {"prompt_token_ids": ids + [1]}
    t, h, w = GRIDS[req.image_tokens]
    return {"prompt_token_ids": ids + [IMG] * req.image_tokens + [1],
            "pixel_values": torch.randn(t * h * w, 8, generator=gen),
            "image_grid_thw": torch.tensor([[t, h, w]])}


def run_engine(curves: CurveSet, path: str, cfg: SimConfig, monkeypatch,
               workload: Workload = WORKLOAD, keep: list | None = None) -> list[tuple]:
    """(ttft, tpot) of every request, served by the engine in `cfg.mode` on the null model
    (appended to `keep`, when given, the engine)."""
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(monotonic=clock))
    colocated = cfg.mode in ("spatial", "spatial-static")
    runner = TwoLanes(curves, clock, cfg) if colocated else \
        OneLane(curves, clock, cfg.host_s) if cfg.async_scheduling else \
        TimedRunner(curves, clock, cfg.host_s)
    if colocated:  # the driver's launch budget is host time spent launching layers
        monkeypatch.setattr(launches_module, "time", types.SimpleNamespace(
            perf_counter=lambda: runner.launch_s, sleep=lambda s: None))
        monkeypatch.setattr(step_module, "time", types.SimpleNamespace(monotonic=clock))
    ecfg = EngineConfig(mode=cfg.mode, block_size=cfg.block_size, num_kv_blocks=cfg.kv_blocks,
                        max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_held_embeddings=cfg.max_held,
                        max_encoder_tokens_per_step=cfg.max_encoder_tokens, curves=path,
                        encoder_window_s=cfg.window_s or 0.02, slo=cfg.slo,
                        async_scheduling=cfg.async_scheduling,
                        enable_prefix_caching=False,
                        encoder_cache_bytes=0, **(colocated_settings(cfg) if colocated else {}))
    eng = Engine(runner, ecfg, clock=clock)
    if colocated or cfg.async_scheduling:
        runner.attach(eng)
    gen = torch.Generator().manual_seed(0)
    arrivals = generate(workload)
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
        if clock.t != before:
            idle = 0
            continue
        idle += 1  # nothing ran (a co-located step may have only launched): again, then wait
        if idle > 3:
            assert i < len(arrivals), "the engine stalled"
            clock.t, idle = max(clock.t, arrivals[i].arrival), 0
    eng.check_idle()
    if keep is not None:
        keep.append(eng)
    return [(r.first_token_time - r.arrival_time,
             (r.token_times[-1] - r.first_token_time) / (len(r.token_times) - 1))
            for r in reqs]


def run_sim(curves: CurveSet, cfg: SimConfig, workload: Workload = WORKLOAD,
            keep: list | None = None) -> list[tuple]:
    res = simulate(curves, cfg, workload)
    if keep is not None:
        keep.append(res.gpus[0])
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


@pytest.mark.parametrize("mode,window", [("temporal", None), ("temporal-chunked", 0.01)])
def test_the_simulator_predicts_the_pipelined_engine(curves, mode, window, monkeypatch) -> None:
    """With asynchronous scheduling (the default) the engine plans step n+1 before it reads
    step n back - unless the encoder has work left, when it reads it back at once: its host
    time runs while the device computes, and what it learns from a step in flight (arrivals
    meanwhile, finished requests) reaches the step after next. The simulator's pipelined loop
    (`loops.pipelined`) agrees with it (0.3% and 0.0%); a loop that hides the host's time and
    plans every step on the newest state (the simulator's model before: 11-13% off on mean
    TTFT) is caught, and so is either side without the read-back rule (2.7%)."""
    c, path = curves
    cfg = SimConfig(mode=mode, background=0, slo=SLO, window_s=window, async_scheduling=True)
    eng = summary(run_engine(c, path, cfg, monkeypatch))
    sim = summary(run_sim(c, cfg))
    assert eng["ttft_p99"] > 2 * eng["ttft_mean"] / 3 and eng["tpot_mean"] > 0.005  # loaded
    assert worst(eng, sim) < 0.01, (eng, sim)  # the figure reached: 0.0 (the same host)
    ideal = summary(run_sim(c, dataclasses.replace(cfg, async_scheduling=False, host_s=0.0)))
    assert worst(eng, ideal) > 0.1, (eng, ideal)
    unpiped = summary(run_sim(c, dataclasses.replace(cfg, async_scheduling=False)))
    assert worst(eng, unpiped) > 0.05, (eng, unpiped)


@pytest.fixture(scope="module")
def calm_curves(curves, tmp_path_factory) -> tuple[CurveSet, str]:
    """The same curves without a co-running slowdown (the virtual device's lanes are
    independent)."""
    c = curves[0].with_contention(Contention.flat(0.0))
    return c, str(c.save(tmp_path_factory.mktemp("calm") / "h200-calm.json"))


@pytest.mark.parametrize("mode", ["spatial", "spatial-static"])
def test_the_simulator_predicts_the_colocated_engine(calm_curves, mode, monkeypatch) -> None:
    c, path = calm_curves
    cfg = SimConfig(mode=mode, background=0, slo=SLO, allowed_encoder_sms=(32, 64, 96))
    eng = summary(run_engine(c, path, cfg, monkeypatch))
    sim = summary(run_sim(c, cfg))
    assert eng["ttft_p99"] > 2 * eng["ttft_mean"] and eng["tpot_mean"] > 0.003  # loaded
    assert worst(eng, sim) < TOLERANCE, (eng, sim)
    assert worst(eng, sim) < 0.01, (eng, sim)  # the figure reached: the same step, two lanes
    other = summary(run_sim(c, dataclasses.replace(cfg, max_num_batched_tokens=256)))
    assert worst(eng, other) > TOLERANCE, (eng, other)  # a divergence is caught


def turns_run(calm: tuple[CurveSet, str], slo: str, monkeypatch, rate: float = 30.0, **kw
              ) -> tuple[dict, dict, Any, Any, SimConfig, Workload]:
    """The superset past what sharing sustains, run by the engine and by the simulator: their
    summaries, the engine, the simulator's GPU, the config and the workload."""
    c, path = calm
    cfg = SimConfig(mode="spatial", background=0, slo=Slo.parse(slo),
                    allowed_encoder_sms=(32, 64, 96), sis_actions="superset", **kw)
    wl = dataclasses.replace(WORKLOAD, image_rate=rate)
    engines, sims = [], []
    eng = summary(run_engine(c, path, cfg, monkeypatch, wl, engines))
    sim = summary(run_sim(c, cfg, wl, sims))
    return eng, sim, engines[0], sims[0], cfg, wl


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_simulator_predicts_the_colocated_engine_taking_turns(calm_curves, pipelined,
                                                                   monkeypatch) -> None:
    """The superset past what sharing sustains: both switch from sharing to taking turns on the
    whole GPU (temporal-chunked's windows) after sharing, take the same actions, and agree as
    closely - with asynchronous scheduling (decode steps pipelined while taking turns: a step's
    host time runs while the step before computes, or while a window the host does not wait
    out runs) and without. Getting the host time wrong either way (charged on top of the device
    time while the engine pipelines, or hidden while it does not; the host waiting out every
    window) is caught."""
    c = calm_curves[0]
    eng, sim, engine, gpu, cfg, wl = turns_run(calm_curves, "ttft:2000,tpot:50", monkeypatch,
                                               async_scheduling=pipelined)
    counts, theirs = engine.spatial.sis.action_counts(), gpu.sis.action_counts()
    for idle in (counts, theirs):  # the test's driver steps an idle engine a few times more
        idle.pop("decoder-only", None)
    assert counts == theirs, (counts, theirs)
    assert counts["regime:turns"] >= 1 and counts["window"] > 0 and counts["prefill:compute"] > 0
    assert engine.spatial.num_windows == gpu.loop.num_windows > 0
    assert (gpu.loop.num_pipelined > 100) == pipelined, gpu.loop.num_pipelined
    hidden = engine.spatial.num_hidden  # windows the host did not wait out
    assert hidden == gpu.loop.num_hidden > 0, (hidden, gpu.loop.num_hidden)
    assert worst(eng, sim) < 0.01, (eng, sim)  # the figure reached: the same step, two lanes
    if pipelined:  # the simulator's host waiting out every window is caught (0.97%)
        with monkeypatch.context() as m:
            m.setattr(spatial_loop_module, "window_launch",
                      lambda loop, hide=False: sis_window.window_launch(loop))
            waited = summary(run_sim(c, cfg, wl))
        assert worst(eng, waited) > 0.005, (eng, waited)
    other = summary(run_sim(c, dataclasses.replace(cfg, max_num_batched_tokens=256), wl))
    assert worst(eng, other) > TOLERANCE, (eng, other)  # a divergence is caught
    flipped = summary(run_sim(c, dataclasses.replace(cfg, async_scheduling=not pipelined), wl))
    assert worst(eng, flipped) > 0.02, (eng, flipped)  # ~4% at 0.4 ms of host time a step


def test_the_turns_window_follows_the_measured_intervals_alike(calm_curves, monkeypatch) -> None:
    """Under an ITL bound SIS sizes the turns' window from the intervals the requests see
    (`IntervalSpread`): the engine and the simulator measure the same intervals, plan the same
    windows and agree as closely; a simulator that does not measure them is caught."""
    c = calm_curves[0]
    eng, sim, engine, gpu, cfg, wl = turns_run(calm_curves, "ttft:2000,itl:30", monkeypatch)
    mine, theirs = engine.spatial.sis, gpu.sis
    assert len(mine.spread.spreads) >= MIN_SPREADS
    assert list(mine.spread.spreads) == pytest.approx(list(theirs.spread.spreads), abs=1e-9)
    fallback = mine.slo_target()
    assert mine.spread.bound(mine.slo, fallback) != fallback  # the measured bound is in use
    assert worst(eng, sim) < 1e-9, (eng, sim)  # the figure reached
    with monkeypatch.context() as m:  # the simulator's SIS never measures an interval
        m.setattr(IntervalSpread, "read", lambda self, now, turns: None)
        blind = summary(run_sim(c, cfg, wl))
    assert worst(eng, blind) > 0.02, (eng, blind)  # 4.5%: its windows are 0.8 x the bound


def test_the_turns_encoder_passes_its_window_alike(calm_curves, monkeypatch) -> None:
    """Taking turns with the embedded prompts a third of a tight TTFT bound behind, SIS passes
    the encoder's window (`sis_goodput.hold_encoder`): the engine and the simulator pass the
    same windows and agree as closely; a simulator that runs every window is caught."""
    c = calm_curves[0]
    eng, sim, engine, gpu, cfg, wl = turns_run(calm_curves, "ttft:300,tpot:50", monkeypatch, 40.0)
    mine, theirs = engine.spatial.sis.action_counts(), gpu.sis.action_counts()
    assert mine["window:held"] == theirs["window:held"] > 5, (mine, theirs)
    assert engine.spatial.num_windows == gpu.loop.num_windows > 0
    assert worst(eng, sim) < 0.01, (eng, sim)  # the figure reached
    step = spatial_loop_module.SpatialLoop._window_step

    def every_window(loop: Any) -> bool:
        sis, held = loop.sim.sis, loop.sim.sis.hold
        sis.hold = False
        try:
            return step(loop)
        finally:
            sis.hold = held

    with monkeypatch.context() as m:
        m.setattr(spatial_loop_module.SpatialLoop, "_window_step", every_window)
        blind = summary(run_sim(c, cfg, wl))
    assert worst(eng, blind) > 0.005, (eng, blind)  # 0.9% (14 windows passed)
