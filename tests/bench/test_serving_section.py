"""The serving benchmark's random-weight models, `--llm-layers`, `--sim` and the GPU harness's
"serving" section, at a tiny scale on CPU: argument errors, image grids against the simulator's
token table, token-id prompts, the simulator's prediction beside measured runs, run deadlines,
and the section's rows and files (the H200 run itself needs a GPU)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from bench.gpu import harness
from bench.serving import serving as bench_serving
from spaceserve.bench import random_model
from spaceserve.bench.metrics import Result
from spaceserve.bench.predict import errors, sim_requests, simulate_requests
from spaceserve.bench.prompts import TokenPrompts, image_grid, prompt_shape
from spaceserve.bench.serve import CUT, main, run_one
from spaceserve.bench.workload import BenchRequest, ServeWorkload
from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config
from spaceserve.runtime.sim import RESOLUTIONS, SimConfig

SPECIAL = 250  # the tiny config's special ids: 250..253, inside its 256-token vocabulary


def tiny_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=SPECIAL, video_token_id=SPECIAL + 1, vision_start_token_id=SPECIAL + 2,
        vision_end_token_id=SPECIAL + 3)


@pytest.fixture
def tiny_random(monkeypatch):
    monkeypatch.setitem(random_model.RANDOM_MODELS, "tiny-random", tiny_config)
    return "tiny-random"


@pytest.mark.parametrize("argv,needle", [
    (["--model", "qwen2-vl-7b"], "--model 'qwen2-vl-7b': not a checkpoint directory"),
    (["--llm-layers", "2"], "--llm-layers applies to the random-weight models only"),
    (["--model", "qwen2-vl-7b-random", "--llm-layers", "0"], "--llm-layers 0 must be"),
    (["--model", "qwen2.5-vl-7b-random", "--llm-layers", "29"], "in 1..28"),
    (["--backend", "http", "--sim"], "--sim needs the in-process backend"),
])
def test_bad_model_arguments_exit_2_naming_them(argv, needle, capsys) -> None:
    t0 = time.monotonic()
    assert main(argv + ["--no-plot", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "--model" not in needle or "qwen2-vl-7b-random" in err  # the valid names listed
    assert time.monotonic() - t0 < 2  # refused before any engine is built


def test_random_config_cuts_the_llm_only() -> None:
    cfg = random_model.random_config("qwen2.5-vl-7b-random", 3)
    assert cfg.text_config.num_hidden_layers == 3 and len(cfg.text_config.layer_types) == 3
    assert cfg.vision_config.depth == 32
    full = random_model.random_config("qwen2-vl-7b-random")
    assert full.text_config.num_hidden_layers == 28
    with pytest.raises(ValueError, match="--model 'nope'"):
        random_model.random_config("nope")
    assert random_model.default_backend("shared", torch.device("cuda")) == "torch"
    assert random_model.default_backend("spatial", torch.device("cuda")) == "triton"
    assert random_model.default_backend("spatial", torch.device("cpu")) == "torch"


def test_image_grids_match_the_simulators_token_table() -> None:
    vision = qwen2_vl_7b_config().vision_config
    assert image_grid("1920x1080", vision) == (1, 78, 138)
    for res, tokens in RESOLUTIONS.items():
        t, h, w = image_grid(res, vision)
        assert t * h * w // 4 == tokens, res


def test_token_prompts_have_the_grid_shape_and_avoid_special_ids() -> None:
    from spaceserve.runtime.worker.protocol import ModelInfo

    info = ModelInfo(256, 4096, (), SPECIAL, 2, 1176)
    make = TokenPrompts(info, tiny_config(), seed=3)
    img = BenchRequest(0, "image", 0.0, "Describe " + "red house " * 150, 4, "224x224")
    text = BenchRequest(1, "probe", 0.1, "Describe cat dog.", 4)
    p, q = make(img), make(text)
    assert prompt_shape(p, 2) == (make.text_tokens(img) + 64, 64)  # 224 px: 16x16 patches
    assert p["pixel_values"].shape == (256, 1176)
    assert prompt_shape(q, 2) == (make.text_tokens(text), 0)
    text_ids = [i for i in p["prompt_token_ids"] if i != SPECIAL] + q["prompt_token_ids"]
    assert text_ids and max(text_ids) < SPECIAL
    assert make(img)["pixel_values"] is p["pixel_values"]  # one draw per grid


def result(idx: int, kind: str, send: float, first: float, finish: float, n: int,
           prompt: int, image: int = 0, error: str | None = None) -> Result:
    times = [first + (finish - first) * i / max(n - 1, 1) for i in range(n)]
    return Result(idx, kind, "448x448" if image else "", send, first, times, finish, prompt, n,
                  error=error, image_tokens=image)


def test_sim_requests_and_prediction_errors() -> None:
    rs = [result(2, "probe", 10.3, 10.4, 10.5, 4, 22),
          result(0, "image", 10.0, 10.2, 10.6, 8, 290, image=256),
          result(1, "text", 10.1, 10.2, 10.4, 8, 40, error="HTTP 500")]
    reqs = sim_requests(rs, t0=10.0)
    assert [(r.rid, r.kind, r.image_tokens, r.text_tokens, r.output_tokens) for r in reqs] == \
        [(0, "image", 256, 34, 8), (2, "probe", 0, 22, 4)]
    assert reqs[1].arrival == pytest.approx(0.3)
    from spaceserve.runtime.policy.model_curves import load_curves

    pred = simulate_requests(load_curves(None, None), SimConfig(mode="temporal", background=0),
                             reqs)
    assert pred["load"]["completed"] == 1 and pred["probe"]["completed"] == 1
    assert pred["load"]["mean_ttft_ms"] > pred["probe"]["mean_ttft_ms"] > 0
    assert errors({"mean_tpot_ms": 10.0, "p99_itl_ms": 20.0, "mean_ttft_ms": math.nan},
                  {"mean_tpot_ms": 12.0, "p99_itl_ms": 15.0, "mean_ttft_ms": 5.0}) == \
        pytest.approx({"tpot": 0.2, "p99_itl": -0.25})


class SlowBackend:
    """Answers each request after `delay` seconds (never, in effect, for a large one)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.cancelled = delay, 0

    def body(self, req: BenchRequest, model: str) -> dict:
        return {}

    async def send(self, req: BenchRequest, body: dict) -> Result:
        t = time.monotonic()
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Result(req.idx, req.kind, req.resolution, t, t + 0.001, [t + 0.001], t + 0.002,
                      5, 1)


def test_run_one_cuts_at_the_deadline_and_keeps_what_finished() -> None:
    w = ServeWorkload(request_rate=40.0, duration_s=1.0, image_mix={"text": 1.0}, seed=2)
    fast = asyncio.run(run_one(SlowBackend(0.0), w, "m", {}))
    assert fast["unsent"] == 0 and fast["metrics"]["failed"] == 0
    backend = SlowBackend(30.0)

    async def go() -> dict:
        return await run_one(backend, w, "m", {}, deadline=time.monotonic() + 0.3)

    t0 = time.monotonic()
    run = asyncio.run(go())
    assert time.monotonic() - t0 < 2
    assert 0 < run["num_requests"] < fast["num_requests"]
    assert run["unsent"] == fast["num_requests"] - run["num_requests"]
    assert backend.cancelled == run["num_requests"] == run["metrics"]["failed"]
    assert run["metrics"]["errors"] == [CUT]


def test_sim_beside_measured_runs_on_the_tiny_checkpoint(tiny_path, tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    rc = main(["--model", str(tiny_path), "--modes", "spatial", "--rates", "6", "--duration",
               "0.5", "--probe-rate", "4", "--output-len", "4", "--image-mix",
               "112x112=0.7,text=0.3", "--device", "cpu", "--num-kv-blocks", "128", "--sim",
               "--no-plot", "--out", str(out)])
    assert rc == 0
    assert "  sim " in capsys.readouterr().out
    run = json.loads((out / "results.json").read_text())["runs"][0]
    sim, load = run["sim"], run["metrics"]["load"]
    assert sim["requests"] == load["completed"] + run["metrics"]["probe"]["completed"] > 0
    assert sim["config"]["mode"] == "spatial" and len(sim["config"]["allowed_encoder_sms"]) > 1
    for key, short in (("mean_tpot_ms", "tpot"), ("p99_itl_ms", "p99_itl"),
                       ("mean_ttft_ms", "ttft")):
        assert sim["load"][key] > 0
        assert sim["errors"]["load"][short] == pytest.approx(
            (sim["load"][key] - load[key]) / load[key])
    images = [r for r in run["requests"] if r["kind"] == "image"]
    assert images and all(r["image_tokens"] == 16 for r in images)  # 112 px: 4x4 tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_section_skips_without_cuda(tmp_path) -> None:
    assert bench_serving.run(tmp_path, 30) == [{"section": "serving",
                                                "skipped": "needs a CUDA device"}]
    assert harness.SECTIONS["serving"].target == "bench.serving.serving:run"
    assert harness.SECTIONS["serving"].dry == "bench.serving.serving:dry_run"


def test_slo_window_fits_the_decode_bound_with_a_margin() -> None:
    """temporal-chunked's window: margin x the tighter of tpot / itl, less the decode step at
    the split-set load and one encoder layer of the largest image; 1 ms at the least; an SLO
    without a decode bound is refused."""
    from spaceserve.runtime.policy.model_curves import model_curves
    from spaceserve.runtime.policy.slo import Slo

    config = random_model.random_config("qwen2-vl-7b-random", bench_serving.LLM_LAYERS)
    curves, vision = model_curves(None, config), config.vision_config
    mix, load = bench_serving.IMAGE_MIX, (32, 1152)
    w = bench_serving.slo_window(curves, Slo.parse("ttft:2000,tpot:50"), vision, mix, load)
    layer = curves.encoder(78 * 138, 1, curves.num_sms) * 1e3  # 1920x1080: 78x138 patches
    assert w["window_layer_ms"] == pytest.approx(layer)
    assert w["window_decode_ms"] == pytest.approx(curves.decode(32, 1152, curves.num_sms) * 1e3)
    assert w["encoder_window_ms"] == pytest.approx(0.8 * 50 - layer - w["window_decode_ms"])
    assert 20 < w["encoder_window_ms"] < 40 and "0.8 x 50 ms" in w["window_from"]
    tight = bench_serving.slo_window(curves, Slo.parse("tpot:50,itl:30"), vision, mix, load)
    assert tight["encoder_window_ms"] == pytest.approx(w["encoder_window_ms"] - 0.8 * 20)
    assert bench_serving.slo_window(curves, Slo.parse("tpot:2"), vision, mix, load)[
        "encoder_window_ms"] == 1.0
    with pytest.raises(ValueError, match="needs a tpot or itl bound"):
        bench_serving.slo_window(curves, Slo.parse("ttft:2000"), vision, mix, load)
    assert bench_serving.Plan().modes[:2] == ("spatial", "temporal-chunked")


def test_graph_steps_say_which_figures_are_graph_timed() -> None:
    """Decode figures are graph-timed once decode-only steps replay graphs; the fraction of
    them that did is beside; mixed steps and the encoder stage's are not counted."""
    from types import SimpleNamespace

    answers = iter([8, None, None, 8, 8])

    def prepare_step(batch, stage="decoder"):
        return SimpleNamespace(stage=stage, graph=next(answers))

    runner = SimpleNamespace(prepare_step=prepare_step)
    counted = bench_serving.GraphSteps(runner)
    assert counted.fields() == {"graph_timed": [], "graph_step_fraction": 0.0}
    decode, mixed = SimpleNamespace(num_decodes=4, num_seqs=4), SimpleNamespace(num_decodes=3,
                                                                              num_seqs=4)
    for batch, stage in ((decode, "decoder"), (decode, "decoder"), (mixed, "decoder"),
                         (decode, "encoder"), (decode, "decoder")):
        runner.prepare_step(batch, stage=stage)
    assert counted.fields() == {"graph_timed": list(bench_serving.DECODE_FIGURES),
                                "graph_step_fraction": 2 / 3}


def test_section_plan_on_a_tiny_random_model(tiny_random, tmp_path) -> None:
    plan = bench_serving.Plan(
        model=tiny_random, llm_layers=2, modes=("spatial", "temporal-chunked"),
        rates=(5.0, 10.0), duration_s=0.4, image_mix={"112x112": 0.6, "224x224": 0.4},
        probe_rate=5.0, output_len=4, probe_output_len=3,
        engine=dict(num_kv_blocks=256, max_num_seqs=16), device="cpu", min_mode_s=0.5,
        reserve_s=0.2)
    rows = bench_serving.run_plan(plan, tmp_path, 60.0)
    measured = [r for r in rows if "mean_tpot_ms" in r]
    assert [(r["mode"], r["rate"]) for r in measured] == [
        ("spatial", 5.0), ("spatial", 10.0), ("temporal-chunked", 5.0),
        ("temporal-chunked", 10.0)]
    for r in measured:
        assert r["llm_layers"] == 2 and r["failed"] == 0 and r["completed"] == r["requests"]
        for key in ("mean_ttft_ms", "p99_itl_ms", "sim_mean_tpot_ms", "sim_mean_ttft_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert "sim_err_tpot" in r and "cut" not in r
        assert r["graph_timed"] == [] and r["graph_step_fraction"] == 0.0  # no graphs on CPU
    assert all(isinstance(r["graph_timed"], list) for r in rows)  # every row says
    chunked = [r for r in measured if r["mode"] == "temporal-chunked"]
    assert chunked[0]["ran_as"] == "temporal-chunked" and chunked[0]["window_bound_ms"] == 50.0
    assert 0 < chunked[0]["encoder_window_ms"] < 40 and "window_from" in chunked[0]
    [mem] = [r for r in rows if r.get("row") == "graph-memory"]
    assert mem["mode"] == "spatial" and len(mem["splits"]) > 1
    assert mem["graph_bytes"] == {} and mem["graph_kv_blocks_total"] == 0  # captured on CUDA
    assert mem["kv_block_bytes"] > 0 and mem["headline"].startswith("spatial decode graphs: ")
    heads = [r["headline"] for r in rows if "headline" in r and "row" not in r]
    assert len(heads) == 2 and heads[0].startswith("spatial @ 5/10 img/s: TPOT ")
    assert heads[1].startswith("temporal-chunked (window ") and "eager decode" in heads[1]
    doc = json.loads((tmp_path / "serving_results.json").read_text())
    assert doc["config"]["llm_layers"] == 2 and len(doc["runs"]) == 4
    assert doc["config"]["window"]["encoder_window_ms"] == chunked[0]["encoder_window_ms"]
    sim = doc["runs"][2]["sim"]["config"]  # the engine ran (and the simulator replayed) it
    assert sim["mode"] == "temporal-chunked"
    assert sim["window_s"] * 1e3 == pytest.approx(chunked[0]["encoder_window_ms"])
    assert json.loads((tmp_path / "serving_rows.json").read_text()) == json.loads(
        json.dumps(rows, default=str))
    # no time left: every mode is skipped, and said so
    late = bench_serving.run_plan(plan, tmp_path / "late", 0.0)
    assert [r.get("skipped") for r in late] == ["time budget spent"] * 4
    pytest.importorskip("matplotlib")
    assert (tmp_path / "serving_latency_vs_rate.png").stat().st_size > 1000
    assert (tmp_path / "serving_sm_split_timeline.png").stat().st_size > 1000
