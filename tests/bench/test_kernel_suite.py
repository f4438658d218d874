"""The kernel benchmark suite (bench/kernel_suite/) and its commands, on CPU.

The suite itself runs only when asked for; these tests check that the plain test command never
collects it, run a small slice of it through `spaceserve bench kernels` and through the GPU
harness entry point (CPU profile), and plot two runs into one figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.kernel_suite import SUITE_DIR
from bench.kernel_suite.runner import derived
from bench.kernel_suite.shapes import budgets
from spaceserve.bench.kernels import plots as kernel_plots
from spaceserve.bench.kernels import suite as kernel_suite
from spaceserve.kernels import device_num_sms
from tests.background import KERNELS_OPTIONAL as OPTIONAL

ROOT = Path(__file__).resolve().parents[2]

WALK = textwrap.dedent('''
    """Records every file pytest would collect, without importing any of them."""
    import os
    from pathlib import Path

    SEEN = []


    def pytest_ignore_collect(collection_path, config):
        if Path(collection_path).is_file():
            SEEN.append(str(Path(collection_path).resolve()))
            return True
        return None


    def pytest_collection_finish(session):
        Path(os.environ["WALK_OUT"]).write_text("\\n".join(SEEN))
''')


def _env(**extra: str) -> dict[str, str]:
    # pytest-xdist's worker variables make a child pytest disable its benchmarks
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *extra.pop("_path", "").split(
        os.pathsep), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _walk(tmp_path: Path, *args: str) -> list[Path]:
    """Files a `pytest ARGS` run in the repo root would consider collecting (conftest files are
    not loaded, so this is a superset of what pytest collects)."""
    (tmp_path / "walk_plugin.py").write_text(WALK)
    out = tmp_path / "seen.txt"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "--noconftest", "-p", "walk_plugin", *args],
                          cwd=ROOT, env=_env(_path=str(tmp_path), WALK_OUT=str(out)),
                          capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout + proc.stderr
    return [Path(p) for p in out.read_text().splitlines() if p]


def test_plain_test_command_never_collects_the_suite(tmp_path: Path) -> None:
    seen = _walk(tmp_path)
    # the walk sees the test tree
    assert ROOT / "tests" / "bench" / "test_kernel_suite.py" in seen
    assert not [p for p in seen if ROOT / "bench" in p.parents], "plain pytest walks bench/"


def test_pytest_bench_collects_only_the_suite() -> None:
    """Under bench/ pytest considers the suite's files and ignores every script (bench_*.py,
    kernels.py, gpu/), whatever `python_files` says."""
    from bench import conftest

    files = [p for p in (ROOT / "bench").rglob("*.py") if "results" not in p.parts]
    kept = {p for p in files if not conftest.pytest_ignore_collect(p, None)}
    assert SUITE_DIR / "test_kernels.py" in kept
    assert ROOT / "bench" / "kernels" / "models.py" in files
    assert kept == {p for p in files if SUITE_DIR in p.parents}
    assert conftest.pytest_ignore_collect(ROOT / "bench" / "gpu", None)
    assert not conftest.pytest_ignore_collect(SUITE_DIR, None)


def test_budgets_and_derived_metrics() -> None:
    assert [(b.sms, b.fraction) for b in budgets(132)] == [
        (16, "1/8"), (33, "1/4"), (66, "1/2"), (132, "full")]
    assert [b.sms for b in budgets(132, 8)] == [16, 32, 64, 132]  # green-context SM groups
    assert [b.sms for b in budgets(4)] == [1, 2, 4]
    d = derived(2e-3, 8_000_000_000, 1_000_000_000_000, (4000.0, 800.0, "test"))
    assert d["gbs"] == pytest.approx(4000.0) and d["tflops"] == pytest.approx(500.0)
    assert d["frac_peak_bw"] == pytest.approx(1.0) and d["frac_peak_flops"] == pytest.approx(0.625)
    assert d["fraction_of_peak"] == pytest.approx(1.0)
    assert derived(None, 1, 1, (None, None, "none"))["gbs"] is None


@pytest.fixture(scope="module")
def cli_run(kernels_cli) -> tuple[Path, str]:
    """`spaceserve bench kernels` on the paged decode kernel in fp32 and the optional backends
    (run in the background from the session's start: tests/background.py)."""
    run, out = kernels_cli
    proc = run.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


def test_cli_writes_json_with_budget_grid_bytes_flops(cli_run) -> None:
    path, _ = cli_run
    data = json.loads(path.read_text())
    entries = data["benchmarks"]
    expected = {b.sms for b in budgets(device_num_sms())}  # {16, 33, 66, 132} on CPU
    assert {b["extra_info"]["budget"] for b in entries} == expected
    for b in entries:
        info = b["extra_info"]
        assert info["kernel"] == "paged_decode_attention" and info["dtype"] == "fp32"
        assert info["grid"] and all(g["programs"] <= info["budget"] for g in info["grid"])
        assert info["programs"] == max(g["programs"] for g in info["grid"])
        assert info["bytes"] > 0 and info["flops"] > 0
        assert info["gbs"] == pytest.approx(info["bytes"] / b["stats"]["median"] / 1e9)
        assert info["budget_fraction"] in ("1/8", "1/4", "1/2", "full")


def test_missing_backends_are_skipped_by_name(cli_run) -> None:
    from spaceserve.models import BackendUnavailable, get_backend

    _, output = cli_run
    checked = 0
    for name in OPTIONAL:
        try:
            get_backend(name)
        except BackendUnavailable as exc:
            assert str(exc) in output and repr(name) in str(exc)
            checked += 1
    if not checked:
        pytest.skip("flash_attn and flashinfer are both usable here")


def test_plot_two_runs_in_one_figure(cli_run, tmp_path: Path, monkeypatch, capsys) -> None:
    path, _ = cli_run
    data = json.loads(path.read_text())
    for b in data["benchmarks"]:  # a second "commit", twice as slow
        b["stats"]["median"] *= 2
        b["extra_info"]["gbs"] /= 2
    other = tmp_path / "commit-b.json"
    other.write_text(json.dumps(data))
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    out = tmp_path / "curves.png"
    assert kernel_plots.main([str(path), str(other), "--labels", "a", "b", "--out",
                              str(out)]) == 0
    assert out.stat().st_size > 10_000 and len(figures) == 1
    fig = figures[0]
    assert len(fig.axes) == 2  # one (kernel, case, dtype) group: latency and GB/s
    for ax in fig.axes:
        assert {ln.get_label() for ln in ax.get_lines()} == {"a · triton", "b · triton"}
        expected = sorted(b.sms for b in budgets(device_num_sms()))
        assert all(list(ln.get_xdata()) == expected for ln in ax.get_lines())
    text = capsys.readouterr().out
    assert "1 kernel groups, 8 points from 2 file(s)" in text
    assert text.count(" 2.000") == 4  # every point of b is twice a's median


def test_plot_rejects_other_json(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    assert kernel_plots.main([str(bad)]) == 2
    assert "not pytest-benchmark JSON" in capsys.readouterr().err


def test_kernels_cli_outside_a_source_tree(tmp_path: Path, monkeypatch, capsys) -> None:
    assert kernel_suite.main(["--source", str(tmp_path)]) == 2
    assert "source tree" in capsys.readouterr().err
    fake = tmp_path / "site-packages" / "spaceserve" / "bench" / "kernels" / "suite.py"
    monkeypatch.setattr(kernel_suite, "__file__", str(fake))
    assert kernel_suite.find_source() is None
    assert kernel_suite.main(["--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "site-packages" / "bench" / "kernel_suite") in err
    assert kernel_suite.find_source() is None and kernel_suite.find_source(str(ROOT)) == ROOT


def test_harness_entry_point(cli_run, tmp_path: Path, monkeypatch) -> None:
    """`run(results_dir, time_budget_s)` runs the suite under a deadline inside its budget and
    turns the JSON into rows, headlines and a plot (the pytest run is the CLI's, replayed)."""
    from bench.kernel_suite import run, section

    path, _ = cli_run
    calls = []

    def fake_run(cmd, cwd, env, timeout):
        calls.append((cmd, timeout))
        json_arg = next(a for a in cmd if a.startswith("--benchmark-json="))
        Path(json_arg.split("=", 1)[1]).write_text(path.read_text())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(section.subprocess, "run", fake_run)
    rows = run(tmp_path, 100, select="paged", profile="gpu")
    (cmd, timeout), = calls
    assert "--gpu-profile" in cmd and cmd[cmd.index("-k") + 1] == "paged"
    deadline = float(next(a for a in cmd if a.startswith("--kernel-deadline=")).split("=")[1])
    assert deadline + section.STARTUP_S + section.TAIL_S <= 100 and timeout <= 100
    assert rows[0]["pytest_exit"] == 0 and rows[0]["benchmarks"] == 4
    assert {r["budget"] for r in rows[1:5]} == {b.sms for b in budgets(device_num_sms())}
    heads = [r["headline"] for r in rows if "headline" in r]
    assert len(heads) == 1 and heads[0].startswith("paged_decode_attention [triton]")
    assert (tmp_path / "kernel_suite.json").exists()
    assert (tmp_path / "kernel_suite.png").stat().st_size > 10_000


@pytest.mark.gpu
def test_gpu_timer_flush_and_graph_of_a_budgeted_kernel() -> None:
    from bench.kernel_suite.runner import RoundSetup, capture_graph, cuda_event_timer
    from spaceserve.kernels import record_launches, rms_norm

    setup = RoundSetup(torch.device("cuda"))
    x = torch.randn(4096, 3584, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3584, device="cuda", dtype=torch.bfloat16)
    setup()
    start = cuda_event_timer()
    torch.cuda._sleep(1_000_000)
    spin = cuda_event_timer() - start
    assert 1e-5 < spin < 0.5
    with record_launches() as recs:
        graph = capture_graph(lambda: rms_norm(x, w, 1e-6, num_sms=16))
    assert recs and all(r.programs <= 16 for r in recs)
    setup()
    start = cuda_event_timer()
    graph.replay()
    assert 0 < cuda_event_timer() - start < 0.1


def test_gpu_profile_has_qwen3_vl_shapes() -> None:
    """The GPU profile covers Qwen3-VL-8B (D=128 heads, q/k norm, its own 16-px vision tower
    and DeepStack mergers) next to Qwen2-VL's, whose case names stay as they were."""
    import dataclasses

    from bench.kernel_suite.backend_cases import backend_cases
    from bench.kernel_suite.cases import kernel_cases

    cases = kernel_cases("gpu")
    dims = {k: {c.name: dataclasses.astuple(c)[-1] for c in v} for k, v in cases.items()}
    assert dims["linear"]["vit-fc1"] == {"M": 4784 + 1024, "K": 1280, "N": 5120}
    assert dims["linear"]["q3-8b-vit-fc1"] == {"M": 3520 + 784, "K": 1152, "N": 4304}
    assert dims["linear"]["q3-8b-vit-merger-fc2"] == {"M": 1076, "K": 4608, "N": 4096}
    assert dims["linear"]["q3-8b-qkv-prefill"] == {"M": 2048, "K": 4096, "N": (32 + 16) * 128}
    assert dims["vit_attention"]["q3-8b-vit"] == {"T": 4304, "H": 16, "D": 72}
    assert dims["rms_norm"]["q3-8b-qk-norm-prefill"] == {"M": 2048 * 40, "K": 128}
    assert "q3-8b-b32-ctx4096" in dims["paged_decode_attention"]
    assert [c.name for c in backend_cases("gpu", "triton")["vit"]] == ["vit", "q3-8b-vit"]
