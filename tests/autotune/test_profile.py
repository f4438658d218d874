"""The profiler on CPU: a fake timer (latencies from analytic curves) over a callable workload,
resuming after an interruption, checkpoint identity, and the Qwen2-VL adapter at tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch

from autotune.compare import point_errors, summarize_errors
from autotune.profile import Grid, Profiler, main, sms_points
from autotune.timers import WallTimer
from autotune.workload import FunctionWorkload, Point, Qwen2VLWorkload, image_grid, load_model
from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.contention import Contention, Pair
from spaceserve.runtime.policy.curves import CurveSet

GRID = Grid(sms=(8, 64, 132), patches=(64, 256), prefill_tokens=(16, 64),
            prefill_context=(0, 128), decode_batch=(1, 8), decode_context=(0, 256))
MODEL = {"name": "fake", "vision_depth": 4}


class Interrupted(Exception):
    pass


class FakeTimer:
    """Latency of a point from reference curves (times the point's units); raises after
    `fail_after` points, as an interruption would."""

    def __init__(self, curves: CurveSet, fail_after: int | None = None) -> None:
        self.curves, self.fail_after, self.calls = curves, fail_after, []

    def __call__(self, run, background, point: Point) -> float:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise Interrupted(point.key)
        self.calls.append(point)
        run()
        if point.corun:
            background()
        return modelled(self.curves, point) * point.units


def modelled(curves: CurveSet, p: Point) -> float:
    """The curves' value of a profile point: beside the other stage at its `other_sms`."""
    other = p.other_sms if p.corun else False
    if p.stage == "encoder":
        return curves.encoder(p.work[0], 1, p.sms, other)
    if p.stage == "prefill":  # run beside an encoder pass: the decode side
        return curves.prefill(*p.work, p.sms, other, side="decoder")
    return curves.decode(*p.work, p.sms, other)


@pytest.fixture(scope="module")
def reference() -> CurveSet:
    return analytic_curves()


def _workload(log: list | None = None) -> FunctionWorkload:
    def rec(stage):
        return lambda *a: log.append((stage, *a)) if log is not None else None

    return FunctionWorkload(MODEL, rec("encoder"), rec("prefill"), rec("decode"),
                            device_name="fake-gpu", num_sms=132)


def _profile(tmp, reference, **kw):
    timer = FakeTimer(reference, kw.pop("fail_after", None))
    return Profiler(_workload(kw.pop("log", None)), kw.pop("grid", GRID), tmp, timer=timer,
                    progress=False, **kw), timer


def test_fake_run_writes_valid_curves_and_plot(tmp_path, reference):
    prof, timer = _profile(tmp_path, reference)
    res = prof.run()
    assert res.complete and res.total == 3 * (2 + 4 + 4) * 2 == len(timer.calls)
    curves = CurveSet.load(res.files["json"])
    assert curves.source == "measured" and curves.device == "fake-gpu"
    assert curves.encoder_depth == 4 and curves.decode_curve.sms == [8, 64, 132]
    # per-layer encoder values: the pass time divided by the depth
    assert curves.encoder(256, 1, 64) == pytest.approx(reference.encoder(256, 1, 64))
    assert curves.decode(8, 256, 8, corun=True) == pytest.approx(reference.decode(8, 256, 8,
                                                                                  corun=True))
    assert curves.prefill(64, 128, 132) == pytest.approx(reference.prefill(64, 128, 132))
    png = res.files["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_contention_table_is_filled_from_the_corun_measurements(tmp_path, reference):
    """A reference whose slowdown depends on the SM pair: the profiled table holds, per side,
    the reference's slowdown at every pair the profiler measured (and nothing else)."""
    pairs = (Pair(8, 124, 0.02, 0.40), Pair(64, 68, 0.10, 0.20), Pair(124, 8, 0.30, 0.05))
    varied = reference.with_contention(Contention({"encoder": 0.5, "decoder": 0.5}, pairs,
                                                  "modelled"))
    prof, _ = _profile(tmp_path, varied)
    res = prof.run()
    table = CurveSet.load(res.files["json"]).contention
    assert table.source == "measured"
    measured = {(p.encoder_sms, p.decoder_sms): p for p in table.pairs}
    # encoder points at (own, background); decode and prefill points at (background, own)
    assert set(measured) == {(8, 124), (64, 68), (132, 8), (124, 8), (68, 64), (8, 132)}
    for (e, d), p in measured.items():
        for side in ("encoder", "decoder"):
            got = getattr(p, side)
            if got is not None:
                assert got == pytest.approx(varied.slowdown(side, e, d), abs=1e-9), (e, d, side)
    assert measured[(8, 124)].encoder == pytest.approx(0.02)
    assert measured[(124, 8)].decoder == pytest.approx(0.05)
    assert measured[(8, 124)].decoder is None and measured[(124, 8)].encoder is None


def test_interrupted_run_resumes_to_identical_files(tmp_path, reference):
    whole, _ = _profile(tmp_path / "whole", reference)
    whole.run()
    part, timer = _profile(tmp_path / "part", reference, fail_after=17)
    with pytest.raises(Interrupted):
        part.run()
    saved = json.loads(part.checkpoint_path.read_text())["points"]
    assert len(saved) == 17 and not part.json_path.exists()
    resumed, timer2 = _profile(tmp_path / "part", reference)
    res = resumed.run()
    assert res.complete and len(timer2.calls) == res.total - 17
    assert not {p.key for p in timer2.calls} & set(saved)  # finished points are skipped
    assert part.json_path.read_bytes() == whole.json_path.read_bytes()
    assert part.png_path.read_bytes() == whole.png_path.read_bytes()
    again, timer3 = _profile(tmp_path / "part", reference)
    again.run()  # everything done: nothing is timed, the same bytes are written again
    assert not timer3.calls and part.json_path.read_bytes() == whole.json_path.read_bytes()


class HostTimer(FakeTimer):
    """A fake timer that knows host time, as `CudaTimer` does: one-sequence decode points are
    host-bound (their eager launches take longer than the device's work)."""

    def host_bound(self, key: str) -> bool:
        return key.startswith("decode:1x")


def test_host_bound_points_are_marked_in_the_curve_file_and_survive_a_resume(tmp_path,
                                                                              reference):
    whole = Profiler(_workload(), GRID, tmp_path / "whole", timer=HostTimer(reference),
                     progress=False)
    res = whole.run()
    data = json.loads(res.files["json"].read_text())["curves"]
    assert data["decode"]["host_bound"] == [
        {"sms": s, "batch": 1, "context": c, "corun": corun}
        for s in GRID.sms for c in GRID.decode_context for corun in (False, True)]
    assert data["encoder"]["host_bound"] == data["prefill"]["host_bound"] == []
    assert res.curves.decode_curve.host_bound == data["decode"]["host_bound"]
    part = Profiler(_workload(), GRID, tmp_path / "part", timer=HostTimer(reference, 45),
                    progress=False)
    with pytest.raises(Interrupted):  # stops inside the decode points
        part.run()
    assert len(json.loads(part.checkpoint_path.read_text())["host_bound"]) == 6 + 3
    Profiler(_workload(), GRID, tmp_path / "part", timer=HostTimer(reference),
             progress=False).run()
    assert part.json_path.read_bytes() == whole.json_path.read_bytes()


def test_time_budget_stops_early_and_checkpoint_is_bound_to_its_plan(tmp_path, reference):
    prof, timer = _profile(tmp_path, reference)
    res = prof.run(time_budget_s=0.0)
    assert not res.complete and not res.measured and not timer.calls and res.curves is None
    partial, _ = _profile(tmp_path, reference, fail_after=3)
    with pytest.raises(Interrupted):
        partial.run()
    other = Grid(**{**GRID.__dict__, "sms": (8, 132)})
    wrong, _ = _profile(tmp_path, reference, grid=other)
    with pytest.raises(ValueError, match="another profile.*grid"):
        wrong.run()


def test_corun_points_run_the_other_stage_at_the_complementary_budget(tmp_path, reference):
    log: list = []
    prof, timer = _profile(tmp_path, reference, log=log)
    prof.run()
    assert prof.other_sms(8) == 124 and prof.other_sms(132) == 8 and prof.other_sms(128) == 8
    encoder_corun = [p for p in timer.calls if p.stage == "encoder" and p.corun]
    assert {p.other_sms for p in encoder_corun} == {124, 68, 8}
    # beside the encoder runs a decode step of the background shape, at the other budget
    assert ("decode", 32, 1024, 124) in log and ("decode", 32, 1024, 68) in log
    assert ("encoder", 4096, 124) in log  # and beside decode / prefill an encoder pass
    assert all(not p.corun or p.other_sms == prof.other_sms(p.sms) for p in timer.calls)


def test_bad_timer_value_and_grid_are_refused(tmp_path, reference):
    prof = Profiler(_workload(), GRID, tmp_path, timer=lambda run, bg, p: 0.0, progress=False)
    with pytest.raises(ValueError, match="timer returned 0.0"):
        prof.run()
    with pytest.raises(ValueError, match="grid.sms"):
        Grid(**{**GRID.__dict__, "sms": (8, 200)}).validate(132)
    with pytest.raises(ValueError, match="grid.decode_batch"):
        Grid(**{**GRID.__dict__, "decode_batch": (8, 8)}).validate(132)
    with pytest.raises(ValueError, match="grid.prefill_context"):
        Grid(**{**GRID.__dict__, "prefill_context": (-1, 4)}).validate(132)
    assert sms_points(132)[:3] == (8, 16, 24) and sms_points(132)[-2:] == (128, 132)
    assert Grid.quick(132).sms == (16, 64, 132) and Grid.quick(40).sms == (16, 40)


def test_analytic_error_against_measured(tmp_path, reference):
    prof, _ = _profile(tmp_path, reference)
    res = prof.run()
    rows = point_errors(res.measured, prof.points(), reference)
    assert len(rows) == res.total and max(abs(r["rel_err"]) for r in rows) < 1e-9
    doubled = {k: 2 * v for k, v in res.measured.items()}
    summary = summarize_errors(point_errors(doubled, prof.points(), reference))
    assert len(summary) == 6
    assert all(s["median_err"] == pytest.approx(-0.5) for s in summary)


def test_image_grid():
    assert image_grid(1024) == (1, 32, 32) and image_grid(4096) == (1, 64, 64)
    t, h, w = image_grid(24)
    assert h * w == 24 and h % 2 == 0 and w % 2 == 0
    with pytest.raises(ValueError, match="patches=30"):
        image_grid(30)


def test_qwen2_vl_workload_on_cpu(tmp_path):
    """The adapter's stages at tiny shapes (torch backend on CPU, wall-clock timer)."""
    model, name = load_model("tiny", "cpu")
    workload = Qwen2VLWorkload(model, name=name, block_size=4, background_patches=16,
                               background_decode=(2, 8))
    grid = Grid(sms=(8, 132), patches=(16,), prefill_tokens=(4,), prefill_context=(0, 6),
                decode_batch=(2,), decode_context=(5,))
    res = Profiler(workload, grid, tmp_path, timer=WallTimer(target_s=0.0),
                   progress=False).run()
    assert res.complete
    curves = CurveSet.load(res.files["json"])
    assert curves.encoder_depth == 2 and curves.model["name"] == "tiny"
    assert curves.decode(2, 5, 132) > 0
    encoder = workload.prepare("encoder", (16,))
    out = encoder.run(8)
    assert out.shape == (4, 64) and torch.equal(encoder.run(132), out)  # rerun from the start
    workload.close()


def test_cli_tiny(tmp_path, capsys):
    assert main(["--model", "tiny", "--out", str(tmp_path), "--sms", "8,132",
                 "--no-progress", "--device", "cpu"]) == 0
    assert "40/40 points" in capsys.readouterr().out
    CurveSet.load(tmp_path / "curves.json")
    assert (tmp_path / "curves.png").exists()


def test_load_model_from_a_config_directory(tmp_path):
    from autotune.workload import tiny_config

    path = tmp_path / "my-model"
    tiny_config().save_pretrained(path)
    model, name = load_model(str(path), "cpu")
    assert name == "my-model" and model.vision.num_layers == 2
    assert model.attention_backend == "torch" and model.dtype == torch.float32
