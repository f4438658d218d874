"""The GPU harness end to end on CPU: `run.sh --dry-run OUTDIR` runs every section's control flow
(CUDA work skipped or faked, the serve extra blocked as on the GPU image) and returns at most 8
files; a section killed at its limit keeps the rows it wrote; the pytest rows plugin reports
each test (pytest-benchmark figures included) as it finishes.

The two dry runs (the whole run, and one with a section made to hang) run in the background
(tests/background.py; tests/conftest.py starts them with the session), beside the rest of the
suite; their tests read the results at its end."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

from bench.gpu.sections import SECTIONS
from tests.background import STALL_BUDGET_S, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the dry run is the CPU stand-in of the GPU run")


def archived(out: Path, name: str) -> dict:
    with tarfile.open(out / "results.tar.gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/{name}"))
        return json.loads(tar.extractfile(member).read())


BENCH_TESTS = textwrap.dedent('''
    import pytest


    def test_timed(benchmark):
        benchmark.extra_info["shape"] = "4x4"
        benchmark.pedantic(sum, args=([1, 2, 3],), rounds=3, iterations=1)


    def test_fails():
        assert 1 == 2


    @pytest.mark.skip(reason="not here")
    def test_skipped():
        pass
''')


def test_pytest_rows_plugin_reports_each_test_and_its_benchmark(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(BENCH_TESTS)
    rows_path = tmp_path / "rows.json"
    env = subprocess_env(SPACESERVE_ROWS_PATH=str(rows_path), SPACESERVE_SECTION="bench")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "bench.gpu.pytest_rows", "--timeout=30", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout  # one test fails
    data = json.loads(rows_path.read_text())
    assert data["section"] == "bench" and data["status"] == "done"
    by = {r["test"].split("::")[-1]: r for r in data["rows"]}
    assert by["test_timed"]["status"] == "passed" and by["test_timed"]["rounds"] == 3
    assert by["test_timed"]["median_ms"] >= 0 and by["test_timed"]["extra_info"] == {
        "shape": "4x4"}
    assert by["test_fails"]["status"] == "failed" and "assert" in by["test_fails"]["error"]
    assert by["test_skipped"]["status"] == "skipped" and "not here" in by["test_skipped"]["reason"]
    assert by["(session)"]["figures"] == {"tests_passed": 1, "tests_failed": 1,
                                         "tests_skipped": 1}


def test_warm_cases_launch_at_tiny_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's case functions call the launchers and the sections' suites as they expect
    (tiny shapes and configs on CPU here; the sections' own shapes on the GPU). A wrong call
    would cost its case on the GPU: here it fails."""
    from bench.gpu import warm_cases as wc
    from bench.kernels import models as bench_models
    from bench.kernels import qwen25_vision as bench_qwen25_vision
    from spaceserve.runtime.policy.analytic import model as analytic
    from tests.models.conftest import tiny_config
    from tests.models.test_qwen2_5_vl import tiny_config as tiny_25

    calls: list[float] = []

    def timer(fn) -> float:
        fn()
        calls.append(1.0)
        return 1.0

    cpu = torch.device("cpu")
    wc.linear_shape(cpu, timer, n=24, k=16, ms=(1, 17))
    wc.gated_mlp(cpu, timer, hidden=16, inter=24, ms=(3,), bias=True)
    wc.norms(cpu, timer, shapes=((5, 16),))
    wc.paged_decode(cpu, timer, context=40, batches=(1, 3))
    wc.paged_prefill(cpu, timer, tokens=20)
    wc.vit_attention(cpu, timer, lens=[4, 3], rotary=True)
    assert len(calls) == 2 + 1 + 3 + 2 + 1 + 4
    monkeypatch.setattr(analytic, "qwen2_vl_7b_config", lambda: tiny_config("small"))
    monkeypatch.setattr(analytic, "qwen2_5_vl_7b_config", tiny_25)
    monkeypatch.setitem(bench_models.IMAGES, "448x448", (56, 84))
    monkeypatch.setitem(bench_qwen25_vision.IMAGES, "1024x1024", (56, 56))
    before = len(calls)
    wc.models_suite(cpu, timer, images=("448x448",), batches=(2,), context=24)
    wc.qwen25_vision(cpu, timer, images=("1024x1024",))
    assert len(calls) >= before + 3
    from bench.gpu import engine_step as es

    # The engine-step case runs the section's own plan at one LLM layer (`run_plan` itself is
    # tested in tests/test_harness.py; at 7B widths it is too slow for the CPU).
    plans: list = []
    monkeypatch.setattr(es, "run_plan", lambda plan, out, budget: plans.append(plan))
    wc.engine_step(cpu, timer)
    assert [(p.model, p.llm_layers, p.batches, p.sampling) for p in plans] == [
        ("qwen2-vl-7b-random", 1, es.BATCHES, es.SAMPLING)]


def test_dry_run_runs_every_section_within_90_s(whole_run) -> None:
    run, out = whole_run
    proc = run.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run.wall < 90, f"dry run took {run.wall:.0f} s"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["harness.log", "results.tar.gz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["dry_run"] and summary["run"]["finished"]
    sections = {s["name"]: s for s in summary["sections"]}
    assert list(sections) == list(SECTIONS)  # every section named, in order, with a status
    for name, s in sections.items():
        assert s["status"] == "ok" or s["status"].startswith(("timeout", "skipped (no time")), \
            (name, s["status"], s.get("note"))
    # The first sections always get their time (a loaded machine may starve the last ones).
    for name in ("warmup", "facts", "gpu-tests", "paged-attention"):
        assert sections[name]["status"] == "ok", (name, sections[name])
    tests = [r for r in sections["gpu-tests"]["rows"] if r["test"] != "(session)"]
    assert len(tests) >= 23 and all(r["status"] == "skipped" for r in tests)  # all collected
    warm = sections["warmup"]
    assert warm["figures"]["warm_cases"] == warm["figures"]["cases"] >= 20
    assert {"cold", "second", "per kernel", "summary"} <= {r["round"] for r in warm["rows"]}
    facts = sections["facts"]
    assert facts["rows"][0]["fact"] == "device"
    assert {"overlap_fraction", "granted_encoder_sms", "granted_decoder_sms"} <= set(
        facts["figures"])  # the green-streams row: None / the fallback's budgets on CPU
    assert summary["environment"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    kernels = sections["kernels"]
    if kernels["status"] == "ok":  # every kernel row says how it was timed and its host cost
        timed = [r for r in kernels["rows"] if "ms" in r]
        assert timed and all(isinstance(r["graph"], bool) and r["host_us"] > 0 for r in timed)
    if any("ms" in r for r in kernels["rows"]):  # the summary's columns name them
        assert {"graph", "timing", "launches", "host_us"} <= set(kernels["columns"])
    if sections["colocation"]["status"] == "ok":
        assert len(sections["colocation"]["headlines"]) == 4
        colocated = [r for r in sections["colocation"]["rows"] if r["mode"] != "temporal"]
        assert all("graph_bytes" in r and "graph_kv_blocks_total" in r for r in colocated)
    step = sections["engine-step"]
    if step["status"] == "ok":  # a row per batch, sampling and graphs setting (tiny, CPU)
        rows = [r for r in step["rows"] if "device_ms" in r]
        assert {(r["batch"], r["sampling"], r["graphs"]) for r in rows} == {
            (b, s, g) for b in (1, 4, 8) for s in ("greedy", "random") for g in (True, False)}
        assert all(r["host_ms"] > 0 and 0 <= r["idle_fraction"] < 1 and
                   r["graph_timed"] is False for r in rows)
        assert {"device_ms", "host_ms", "idle_fraction", "graph_timed"} <= set(step["columns"])
    serving = sections["serving"]
    if serving["status"] == "ok":  # the SLO-windowed baseline, graph memory, graph_timed
        modes = [r["mode"] for r in serving["rows"] if "mean_tpot_ms" in r or "skipped" in r]
        assert modes[:2] == ["spatial", "temporal-chunked"]
        chunked = [r for r in serving["rows"] if r["mode"] == "temporal-chunked"]
        assert chunked and ("encoder_window_ms" in chunked[0] or "skipped" in chunked[0])
        [mem] = [r for r in serving["rows"] if r.get("row") == "graph-memory"
                 and r["mode"] == "spatial"]
        assert mem["graph_bytes"] == {} and mem["kv_block_bytes"] > 0
        assert all(isinstance(r["graph_timed"], list) for r in serving["rows"])
    verdict = sections["verdict"]
    if verdict["status"] == "ok":  # the simulator on the (stand-in) curves, its ratio stated
        assert {"spatial_over_best_temporal_A", "spatial_over_best_temporal_B",
                "decode_sms_for_90pct"} <= set(verdict["figures"])
        assert any("best-temporal" in h for h in verdict["headlines"])
    assert "SpaceServe GPU harness summary" in (out / "harness.log").read_text()
    assert archived(out, "summary.json")["sections"][0]["name"] == "warmup"
    assert archived(out, "facts.json")["status"] == "done"


def test_a_killed_section_keeps_its_rows_in_the_archive(stalled_run) -> None:
    """facts is made to hang after its 2nd row; its limit kills it, and the archive holds the
    two rows the killed section wrote (and dumped on SIGTERM)."""
    run, out = stalled_run
    proc = run.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run.wall >= STALL_BUDGET_S  # it was held until its limit
    summary = json.loads((out / "summary.json").read_text())
    [facts] = summary["sections"]
    assert facts["status"] == f"timeout after {STALL_BUDGET_S} s" and facts["row_count"] == 2
    assert "stalling after 2 rows" in facts["note"]
    data = archived(out, "facts.json")
    assert data["status"] == "terminated (SIGTERM)"
    assert [r["fact"] for r in data["rows"]] == ["device", "copy_gbs"]
