"""The co-location benchmark's CPU-side logic: the per-mode driver and metrics on the null model,
the simulator's prediction and its error, the plot, the drive loop's deadline, the host-side
driver experiment, and the entry point the GPU harness calls (the GPU run itself needs a
GPU)."""

import math

import pytest
import torch

from bench.serving import colocation as bc
from bench.serving.colocation_driver import driver_experiment
from spaceserve import Engine, EngineConfig
from spaceserve.kernels import device_num_sms
from spaceserve.runtime.policy.model_curves import load_curves
from spaceserve.runtime.sim import Workload, generate
from spaceserve.runtime.worker.null import NullModelRunner

GRIDS = {"1024x1024": (1, 8, 8), "1920x1080": (1, 8, 12)}



def test_run_modes_measures_every_mode_and_the_simulator(tmp_path) -> None:
    workload = Workload(image_rate=25.0, duration_s=0.25, image_mix=bc.IMAGE_MIX,
                        text_rate=25.0, text_tokens=4, output_tokens=4, seed=1)
    arrivals = generate(workload)
    n_img = sum(r.kind == "image" for r in arrivals)
    assert n_img and len(arrivals) > n_img

    def make(mode):
        return Engine(NullModelRunner(check=False, max_model_len=4096),
                      EngineConfig(mode=mode, num_kv_blocks=2048, block_size=16,
                                   max_num_seqs=48, max_num_batched_tokens=1024))

    rows = bc.run_modes(make, lambda eng: bc.Prompts(eng.runner.info, GRIDS), workload,
                        load_curves(None, None), alone_s=0.1, note="null model")
    assert [r["mode"] for r in rows] == list(bc.MODES)
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["images_done"] == n_img and r["probes_done"] == len(arrivals) - n_img
        for key in ("tpot_alone_ms", "tpot_load_ms", "probe_itl_p99_ms", "image_ttft_ms",
                    "sim_tpot_load_ms", "sim_image_ttft_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["mode"], key)
        assert r["sim_err_tpot_load"] == pytest.approx(
            (r["sim_tpot_load_ms"] - r["tpot_load_ms"]) / r["tpot_load_ms"])
    by = {r["mode"]: r for r in rows}
    assert "inline" in by["spatial-static"]["probe"]  # the SM probe skips on CPU
    static = by["spatial-static"]
    assert static["decoder_sms"] == device_num_sms("cpu") - static["encoder_sms"] > 0
    assert 0 in by["spatial"]["splits_used"] and len(by["spatial"]["splits_used"]) > 1
    path = bc.plot(rows, tmp_path / "colocation.png")
    if path is not None:
        assert path.stat().st_size > 1000


def test_run_modes_records_failures_and_spent_budgets() -> None:
    workload = Workload(image_rate=1.0, duration_s=0.05, image_mix=bc.IMAGE_MIX)

    def broken(mode):
        raise RuntimeError("no engine here")

    rows = bc.run_modes(broken, None, workload, load_curves(None, None),
                        modes=("temporal",))
    assert "no engine here" in rows[0]["error"] and "sim_tpot_load_ms" in rows[0]
    rows = bc.run_modes(broken, None, workload, load_curves(None, None),
                        modes=("shared",), deadline=0.0)
    assert rows[0]["skipped"] == "time budget spent"


def test_drive_stops_at_its_deadline_and_keeps_what_it_measured() -> None:
    """A deadline inside the load phase cuts the drive loop there (not after the whole load and
    drain): the open requests are aborted and the background's TPOT so far is kept. Real time
    (the TPOTs need the engine's clock), with bounds far from both the deadline and the 30 s
    load, so a loaded machine cannot fail it."""
    import time

    from bench.serving.colocation_load import drive

    workload = Workload(image_rate=25.0, duration_s=30.0, image_mix=bc.IMAGE_MIX,
                        text_rate=25.0, text_tokens=4, output_tokens=4, seed=2)
    engine = Engine(NullModelRunner(check=False, max_model_len=4096),
                    EngineConfig(mode="spatial-static", num_kv_blocks=2048, block_size=16,
                                 max_num_seqs=48, max_num_batched_tokens=1024))
    arrivals, prompts = generate(workload), bc.Prompts(engine.runner.info, GRIDS)
    t0 = time.perf_counter()
    row = drive(engine, arrivals, prompts, alone_s=0.2, load_s=workload.duration_s,
                deadline=t0 + 1.2)
    assert time.perf_counter() - t0 < 20.0  # not the 30 s load (and its drain)
    assert "while load" in row["cut"] and row["load_s"] < 15.0
    assert math.isfinite(row["tpot_alone_ms"]) and math.isfinite(row["tpot_load_ms"])
    assert not engine.has_unfinished() and engine.block_manager.num_free == 2048
    engine.close()


def test_run_modes_gives_each_mode_a_share_of_the_deadline() -> None:
    """Two modes, a 3 s deadline, 8 s of load each: the first mode's load is cut at half the
    time left (1.5 s), the second's at the deadline. The deadline is read from an injected
    clock that advances 10 ms per reading, so the cuts fall at the same place on any machine,
    however loaded (the latencies, on the engine's own clock, are not checked here)."""
    import itertools

    workload = Workload(image_rate=25.0, duration_s=8.0, image_mix=bc.IMAGE_MIX,
                        text_rate=25.0, text_tokens=4, output_tokens=4, seed=2)

    def make(mode):
        return Engine(NullModelRunner(check=False, max_model_len=4096),
                      EngineConfig(mode=mode, num_kv_blocks=2048, block_size=16,
                                   max_num_seqs=48, max_num_batched_tokens=1024))

    ticks = itertools.count()
    rows = bc.run_modes(make, lambda eng: bc.Prompts(eng.runner.info, GRIDS), workload,
                        load_curves(None, None), modes=("temporal", "spatial-static"),
                        alone_s=0.1, deadline=3.0, clock=lambda: next(ticks) * 0.01)
    assert [r["mode"] for r in rows] == ["temporal", "spatial-static"]
    assert all("while load" in r.get("cut", "") and "headline" in r for r in rows), rows
    first, second = (r["load_s"] for r in rows)
    assert 1.0 < first < 1.5 and 1.0 < second < 1.5  # each its half, not 3 s (nor 8 s) of it


def test_driver_experiment_runs_each_driver() -> None:
    rows = driver_experiment(seconds=0.3, image_every_s=0.05,
                                drivers=("none", "cooperative", "thread"))
    by = {r["driver"]: r for r in rows}
    assert by["none"]["encoder_layers"] == 0
    assert by["cooperative"]["encoder_layers"] > 0 and by["thread"]["encoder_layers"] > 0
    for r in rows:
        assert r["steps"] > 10 and r["gap_p50_ms"] >= 6.0  # never faster than the device


def test_gpu_entry_point_skips_on_cpu_and_resolves_as_a_section(tmp_path) -> None:
    from bench.gpu.harness import Section

    if not torch.cuda.is_available():
        assert bc.run(tmp_path, 10.0)[0]["skipped"] == "needs a CUDA device"
    assert Section(120, "bench.serving.colocation:run").missing() is None
