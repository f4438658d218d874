"""The discrete-event simulator: determinism, completion, the real schedulers, the figure."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import time

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.sis import SpaceInferenceScheduler
from spaceserve.runtime.policy.slo import Slo
from spaceserve.runtime.policy.twsrft import TwsrftScheduler
from spaceserve.runtime.sim import (
    MODES,
    RESOLUTIONS,
    SimConfig,
    Simulator,
    Workload,
    generate,
    simulate,
)
from spaceserve.runtime.sim.cli import build_parser, main
from spaceserve.runtime.sim.metrics import percentile, request_record, summarize
from spaceserve.runtime.sim.sweep.rates import crossing
from spaceserve.runtime.sim.workload import Request, arrival_times


@pytest.fixture(scope="module")
def h200() -> CurveSet:
    return analytic_curves(device="H200")


def _records(res) -> list[dict]:
    return [request_record(r) | {"itls": list(r.itls)} for r in res.requests]


def test_deterministic_for_a_seed(h200) -> None:
    w = Workload(8.0, 1.5, text_rate=3.0, seed=11)
    for mode in ("temporal", "spatial"):
        a = simulate(h200, SimConfig(mode=mode, background=8), w)
        b = simulate(h200, SimConfig(mode=mode, background=8), w)
        assert _records(a) == _records(b)
        assert a.gpus[0].timeline == b.gpus[0].timeline
    c = simulate(h200, SimConfig(mode="spatial", background=8), dataclasses.replace(w, seed=12))
    assert _records(c) != _records(a)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefill_on", ["auto", "decode"])
def test_every_request_completes(h200, mode, prefill_on) -> None:
    w = Workload(12.0, 1.0, text_rate=6.0, output_tokens=20, burstiness=0.5, seed=3)
    cfg = SimConfig(mode=mode, prefill_on=prefill_on, background=16, background_output=40)
    res = simulate(h200, cfg, w)
    served = [r for r in res.requests if r.kind != "background"]
    assert len(served) == len(generate(w)) > 10
    assert any(r.kind == "text" for r in served) and any(r.kind == "image" for r in served)
    for r in res.requests:
        assert r.finish is not None and r.first_token is not None
        assert len(r.itls) == r.generated - 1 and all(x > 0 for x in r.itls)
        if r.kind != "background":
            assert r.generated == r.output_tokens == 20
            assert r.arrival < r.first_token <= r.finish
            assert r.prefilled == r.prompt_tokens
            assert (r.encoded_at is not None) == (r.kind == "image")
    assert sum(r.kind == "background" for r in res.requests) > 16  # replaced as they finish
    sim = res.gpus[0]
    if mode != "shared":  # partitions never hand out more SMs than the GPU has
        assert all(e + d <= sim.total for _, e, d in sim.timeline)
    if mode in ("temporal", "temporal-chunked"):
        assert all(e == 0 or d == 0 for _, e, d in sim.timeline)
    if mode == "spatial-static":
        assert {e for _, e, _ in sim.timeline} <= {0, 64}


def test_drives_the_real_schedulers(h200) -> None:
    sim = Simulator(h200, SimConfig(mode="spatial", background=4))
    assert [type(s) for s in sim.sched.scheds] == [TwsrftScheduler]  # the engine stage's
    assert type(sim.sis) is SpaceInferenceScheduler
    calls = []
    real = sim.sis.decide
    sim.sis.decide = lambda state: calls.append(state) or real(state)
    req = Request(0, 0.0, RESOLUTIONS["1920x1080"], 64, 4, "image")
    sim.add(req)
    sim.advance_to(0.5)
    sim.drain()
    assert req.done and calls and any(s.encode for s in calls)
    assert any(e > 0 for _, e in sim.splits) and sim.splits[-1][1] == 0
    assert sim.curves.encoder_depth == sim.sched.scheds[0].num_layers == 32


def _goodput(h200, mode: str, w: Workload, slo: Slo, **kw):
    runs = [simulate(h200, SimConfig(mode=mode, slo=slo, **kw), dataclasses.replace(w, seed=s),
                     drain_s=5.0) for s in (0, 1)]
    met = sum(r.goodput(slo).met for r in runs)
    ttft = [r.first_token - r.arrival for res in runs for r in res.requests
            if r.kind == "image" and r.first_token is not None]
    tpot = [summarize(r.requests)["tpot"]["mean_ms"] for r in runs]
    _goodput.widest = max((e for r in runs for _, e in r.gpus[0].splits), default=0)
    return met / (2 * w.duration_s), sum(ttft) / len(ttft), sum(tpot) / len(tpot)


def test_spatial_serves_more_within_slo_than_time_multiplexing(h200) -> None:
    itl = Slo.parse("ttft:2000,itl:21")
    w = Workload(10.0, 4.0)
    good = {m: _goodput(h200, m, w, itl)[0] for m in ("temporal", "temporal-chunked", "spatial")}
    assert good["spatial"] > 0.8 * 10.0  # decode steps stay short while images encode
    assert good["spatial"] > 4 * max(good["temporal"], good["temporal-chunked"])
    tpot_slo = Slo.parse("ttft:2000,tpot:50")
    w = Workload(16.0, 5.0)
    good = {m: _goodput(h200, m, w, tpot_slo)[0] for m in ("temporal", "temporal-chunked",
                                                           "spatial")}
    assert good["spatial"] >= 0.95 * max(good["temporal"], good["temporal-chunked"])
    cap = Simulator(h200, SimConfig(slo=tpot_slo)).policy.splits[-1]
    assert _goodput.widest == cap  # under pressure the encoder takes all the decode SLO allows
    # the TPOT-first baseline objective gives the encoder too few SMs for this load
    assert _goodput(h200, "spatial", w, tpot_slo, sis_objective="tpot")[0] < \
        0.85 * good["spatial"]


def test_light_load_keeps_ttft_and_tpot_near_time_multiplexing(h200) -> None:
    slo = Slo.parse("ttft:2000,tpot:50")
    w = Workload(2.0, 8.0)
    idle = summarize(simulate(h200, SimConfig(mode="temporal"), dataclasses.replace(
        w, image_rate=0.0)).requests)["tpot"]["mean_ms"]
    _, ttft_t, _ = _goodput(h200, "temporal", w, slo)
    _, ttft_s, tpot_s = _goodput(h200, "spatial", w, slo)
    assert 0 < _goodput.widest < Simulator(h200, SimConfig(slo=slo)).policy.splits[-1]  # calm
    # the engine's step (spatial_loop.py) attaches embeddings and collects compute prefills at
    # step boundaries, and a split change waits for the compute side: 92 ms against 55 ms here
    assert ttft_s <= 2 * ttft_t
    # spatial's steps are not pipelined: they pay the host's step and SIS time on top
    host_ms = 1e3 * (SimConfig().host_s + SimConfig().sis_host_s)
    assert tpot_s <= 1.25 * idle + host_ms
    _, ttft_tpot, tpot_tpot = _goodput(h200, "spatial", w, slo, sis_objective="tpot")
    assert tpot_tpot <= 1.2 * idle and ttft_tpot > ttft_s  # TPOT first, at a TTFT cost


def test_cluster_routers(h200) -> None:
    w = Workload(16.0, 1.0, seed=9)
    n = len(generate(w))
    rr = simulate(h200, SimConfig(mode="spatial", background=4), w, num_gpus=2)
    gpus = [r.gpu for r in rr.requests if r.kind == "image"]
    assert gpus == [i % 2 for i in range(n)]
    ll = simulate(h200, SimConfig(mode="spatial", background=4), w, num_gpus=3,
                  router="least_loaded")
    counts = [sum(r.gpu == g for r in ll.requests if r.kind == "image") for g in range(3)]
    assert sum(counts) == n and min(counts) > 0
    assert all(r.done for r in ll.requests)
    with pytest.raises(ValueError, match="router"):
        simulate(h200, SimConfig(), w, router="random")
    with pytest.raises(ValueError, match="num_gpus"):
        simulate(h200, SimConfig(), w, num_gpus=0)


def test_workload_arrivals_and_mix() -> None:
    rng = random.Random(0)
    times = arrival_times(50.0, 200.0, 1.0, rng)
    assert abs(len(times) / 200.0 - 50.0) < 2.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    bursty = arrival_times(50.0, 200.0, 0.25, random.Random(0))
    bgaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    bmean = sum(bgaps) / len(bgaps)
    bcv = math.sqrt(sum((g - bmean) ** 2 for g in bgaps) / len(bgaps)) / bmean
    assert 0.9 < cv < 1.1 and bcv > 1.6  # Poisson: CV 1; gamma shape 0.25: CV 2
    reqs = generate(Workload(40.0, 50.0, image_mix={"448x448": 3, "1920x1080": 1}, seed=1))
    small = sum(r.image_tokens == 256 for r in reqs) / len(reqs)
    assert 0.7 < small < 0.8 and {r.patches for r in reqs} == {1024, 4 * 2691}
    with pytest.raises(ValueError, match="image_mix"):
        Workload(1.0, 1.0, image_mix={"640x480": 1.0})
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="fast")


def test_metrics_follow_vllm_definitions() -> None:
    r = Request(0, 1.0, 256, 64, 5, "image", first_token=1.5, finish=2.3, generated=5)
    r.itls = [0.2, 0.2, 0.2, 0.2]
    s = summarize([r])
    assert s["ttft"]["mean_ms"] == pytest.approx(500.0)
    assert s["tpot"]["mean_ms"] == pytest.approx(200.0)  # (E2EL - TTFT) / (out - 1)
    assert s["e2el"]["mean_ms"] == pytest.approx(1300.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert crossing([0, 1, 2], [1.0, 2.0, 4.0], 3.0) == 1.5
    assert crossing([0, 1], [1.0, 2.0], 3.0) is None


def _ops(sim: Simulator) -> list[tuple[str, float, object]]:
    """Record (kind, seconds alone, payload) of every op the simulator completes."""
    log: list[tuple[str, float, object]] = []
    real = sim._complete

    def complete(op):  # a pipelined loop's launch carries its batch or encoded requests
        p = op.payload
        if hasattr(p, "ready_at"):
            p = p.done if p.batch is None else p.batch
        log.append((op.kind, op.latency(op.sms, False), p))
        real(op)

    sim._complete = complete
    return log


def _one_image_beside_decode(h200, mode: str, small_at: float = 0.05, **kw
                             ) -> tuple[Simulator, list]:
    sim = Simulator(h200, SimConfig(mode=mode, background=8, **kw))
    log = _ops(sim)
    sim.add(Request(0, 0.0, RESOLUTIONS["1920x1080"], 64, 4, "image"))
    sim.advance_to(small_at)
    sim.add(Request(1, small_at, RESOLUTIONS["448x448"], 64, 4, "image"))
    sim.drain()
    return sim, log


@pytest.mark.parametrize("pipelined", [True, False])
def test_temporal_chunked_interleaves_decode_with_encoder_windows(h200, pipelined) -> None:
    """Each engine step the encoder runs at most one window (plus the layer that crosses it);
    a 1080p pass spans many windows, so decode keeps going while it encodes; prompts are
    prefilled in chunks of the engine's token budget, carried by the steps. Pipelined, the
    host sees the small image one step later (`loops.pipelined`): it comes earlier here."""
    window = 0.01
    sim, log = _one_image_beside_decode(h200, "temporal-chunked", 0.03 if pipelined else 0.05,
                                        window_s=window, max_num_batched_tokens=256,
                                        async_scheduling=pipelined)
    layer = h200.encoder(4 * RESOLUTIONS["1920x1080"], 1, 132)
    kinds = [k for k, _, _ in log]
    assert set(kinds) == {"encode", "decode"}  # no whole-prompt prefill op
    assert all(not (a == b == "encode") for a, b in zip(kinds, kinds[1:], strict=False))
    windows = [secs for k, secs, _ in log if k == "encode"]
    assert windows and max(windows) <= window + layer + 1e-12
    assert sum(w >= window for w in windows) >= 3
    passes = sum(windows)
    assert passes == pytest.approx(h200.encoder(4 * RESOLUTIONS["1920x1080"], 32, 132) +
                                   h200.encoder(4 * RESOLUTIONS["448x448"], 32, 132), rel=1e-9)
    # the small image arriving behind the big one is not stuck behind its whole pass
    small, big = sim.requests[1], sim.requests[0]
    assert small.encoded_at < big.encoded_at
    steps = [p for k, _, p in log if k == "decode"]
    assert all(b.num_tokens <= 256 for b in steps)
    assert sum(b.num_decodes < len(b.reqs) for b in steps) >= (64 + 2691) // 256


def test_temporal_runs_whole_jobs_and_decodes_between_them(h200) -> None:
    """The full-pass baseline: each step's encoder work is the oldest jobs' whole passes on
    the whole GPU (FIFO), and an engine step runs between any two of them."""
    sim, log = _one_image_beside_decode(h200, "temporal", window_s=0.01)  # window ignored
    encodes = [(secs, p) for k, secs, p in log if k == "encode"]
    assert [[r.rid for r in p] for _, p in encodes] == [[0], [1]]
    assert encodes[0][0] == pytest.approx(h200.encoder(4 * RESOLUTIONS["1920x1080"], 32, 132))
    kinds = [k for k, _, _ in log]
    assert all(not (a != "decode" and b != "decode") for a, b in zip(kinds, kinds[1:],
                                                                   strict=False))
    assert sim.requests[0].encoded_at < sim.requests[1].encoded_at  # FIFO


def test_temporal_steps_fill_the_token_budget_from_several_requests(h200) -> None:
    """Both time-multiplexed modes run the engine's continuous batching: one step carries
    prefill chunks of several requests under max_num_batched_tokens, at most max_num_seqs
    sequences run, and KV blocks run out into preemption by recompute."""
    for mode in ("temporal", "temporal-chunked"):
        sim = Simulator(h200, SimConfig(mode=mode, background=0, max_num_batched_tokens=4096,
                                        max_num_seqs=6))
        log = _ops(sim)
        for i in range(8):
            sim.add(Request(i, 0.0, 0, 1000, 16, "text"))
        sim.drain()
        steps = [p for k, _, p in log if k == "decode"]
        assert max(len(b.reqs) - b.num_decodes for b in steps) >= 3  # several prompts a step
        assert max(b.num_tokens for b in steps) <= 4096
        assert max(len(b.reqs) for b in steps) == 6
        tight = Simulator(h200, SimConfig(mode=mode, background=0, kv_blocks=200))
        for i in range(8):
            tight.add(Request(i, 0.0, 0, 1000, 200, "text"))
        tight.drain()
        assert tight.loop.num_preemptions > 0
        assert all(r.generated == 200 for r in tight.requests.values())
    with pytest.raises(ValueError, match="prefill_on='compute' is not a temporal schedule"):
        SimConfig(mode="temporal", prefill_on="compute")
    with pytest.raises(ValueError, match="temporal encodes whole passes"):
        SimConfig(mode="temporal", encoder_policy="twsrft")


def test_contention_slows_co_running_work(h200) -> None:
    """The same split and arrivals with the contention table at 0 and at 35%: decode beside
    the encoder, and the encoder itself, run about 35% slower."""
    w = Workload(6.0, 2.0, seed=4)
    cfg = SimConfig(mode="spatial-static", background=16)
    runs = {}
    for x in (0.0, 0.35):
        curves = h200.with_contention(Contention.flat(x))
        runs[x] = simulate(curves, cfg, w)
    busy = {x: summarize(res.requests, ("background",))["itl"]["p99_ms"]
            for x, res in runs.items()}
    assert 1.3 * busy[0.0] < busy[0.35] < 1.4 * busy[0.0]
    enc = {x: max(r.encoded_at - r.arrival for r in res.requests if r.kind == "image")
           for x, res in runs.items()}
    assert enc[0.35] > 1.3 * enc[0.0]  # queueing can only add to it


def test_bounded_drain_counts_unfinished_requests_as_misses(h200) -> None:
    w = Workload(30.0, 2.0, seed=2)  # well past the GPU's image capacity
    cfg = SimConfig(mode="temporal", background=8)
    cut = simulate(h200, cfg, w, drain_s=0.5)
    left = [r for r in cut.requests if r.kind == "image" and r.finish is None]
    assert left and cut.drain_s == 0.5
    g = cut.goodput(Slo(ttft=1e6))  # every finished request meets it
    assert g.counted == len(generate(w)) and g.met == g.counted - len(left)
    assert summarize(cut.requests, ("image",))["unfinished"] == len(left)
    whole = simulate(h200, cfg, w)
    assert all(r.finish is not None for r in whole.requests)
    assert whole.goodput(Slo(ttft=1e6)).attainment == 1.0


def test_sweep_rows_carry_goodput_per_mode_and_rate(tmp_path, capsys) -> None:
    rc = main(["--modes", "temporal,temporal-chunked,spatial", "--slo", "ttft:2000,itl:21",
               "--contention", "0.2", "--rates", "0,6", "--duration", "1.5", "--seeds", "0,1",
               "--batch", "8", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0 and "SLO ttft:2000,itl:21" in out and "flat 20%" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["slo"] == {"ttft": 2000.0, "itl": 21.0}
    assert results["meta"]["contention"]["default"] == {"encoder": 0.2, "decoder": 0.2}
    for mode, rows in results["sweep"].items():
        assert [r["rate"] for r in rows] == [0.0, 6.0] and rows[1]["seeds"] == [0, 1]
        g = rows[1]["goodput"]
        assert g["slo"] == {"ttft": 2000.0, "itl": 21.0} and 0 <= g["attainment"] <= 1
        assert g["rate_per_s"] == pytest.approx(g["met"] / (2 * 1.5))
        line = next(x for x in out.splitlines() if x.startswith(mode + " ") and " 6.00 " in x)
        assert f"{g['rate_per_s']:.2f}" in line and f"{100 * g['attainment']:.1f}%" in line
    saved = CurveSet.load(tmp_path / "curves_H200.json")
    assert saved.contention.flat_value == 0.2
    for bad in (["--slo", "ttft:x"], ["--contention", "-1"], ["--encoder-window-ms", "0"]):
        with pytest.raises(SystemExit):
            main(bad + ["--out", str(tmp_path), "--no-plot"])


def test_defaults_are_the_goodput_sweep() -> None:
    args = build_parser().parse_args([])
    assert args.duration == 30.0 and args.sis_objective == "goodput"
    assert args.modes == "temporal,temporal-chunked,spatial"
    assert [float(r) for r in args.rates.split(",")] == [0.0, *range(2, 21, 2)]
    assert args.seeds is None and args.seed is None  # seeds 0,1 (DEFAULT_SEEDS)
    assert str(args.slo) == "ttft:2000,tpot:50"


def test_one_command_produces_the_figure(tmp_path, capsys) -> None:
    start = time.perf_counter()
    rc = main(["--rates", "auto", "--points", "4", "--duration", "2", "--out", str(tmp_path),
               "--seed", "1"])
    took = time.perf_counter() - start
    out = capsys.readouterr().out
    assert rc == 0 and took < 30, took
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["device"] == "H200" and results["meta"]["source"] == "modelled"
    assert list(results["sweep"]) == ["temporal", "temporal-chunked", "spatial"]
    assert results["sweep"]["spatial"][0]["seeds"] == [1]
    assert all(len(rows) == 4 for rows in results["sweep"].values())
    assert (tmp_path / "curves_H200.json").exists() and "temporal" in out
    CurveSet.load(tmp_path / "curves_H200.json")
    assert all("goodput" in row for rows in results["sweep"].values() for row in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "tpot_vs_rate.png").stat().st_size > 10_000
        assert (tmp_path / "goodput_vs_rate.png").stat().st_size > 10_000
    else:
        assert "skipping the figure" in out
