"""Every figure `spaceserve bench serve`, `spaceserve sim` and `spaceserve bench plot-kernels`
writes says where its numbers come from: the device and the model in its title or annotation,
and, off a GPU, that it proves plumbing, not performance (MODELLED for the simulator), with SM
counts a CPU does not have labelled nominal. Read from the matplotlib figure objects the
commands save, not from pixels."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

PLUMBING = "proves plumbing, not performance"


def figure_text(fig: Any) -> str:
    """Every text a reader of the saved image sees: suptitle, annotations, axes titles, axis
    labels and legends."""
    parts = [fig._suptitle.get_text() if fig._suptitle is not None else ""]
    parts += [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        parts += [ax.get_title(loc) for loc in ("left", "center", "right")]
        parts += [ax.get_xlabel(), ax.get_ylabel()]
        legend = ax.get_legend()
        if legend is not None:
            parts += [t.get_text() for t in legend.get_texts()]
    return "\n".join(p for p in parts if p)


def suptitle(fig: Any) -> str:
    return fig._suptitle.get_text() if fig._suptitle is not None else ""


def caveat(fig: Any) -> str:
    """The annotation along the figure's bottom edge (`spaceserve.plotting.caption`)."""
    return "\n".join(t.get_text() for t in fig.texts if t.get_gid() == "caveat")


@pytest.fixture
def saved(monkeypatch) -> dict[str, Any]:
    """{file name: figure} of every figure saved while the test runs."""
    from matplotlib.figure import Figure

    out: dict[str, Any] = {}
    real = Figure.savefig

    def savefig(self, fname, *args, **kw):
        out[Path(fname).name] = self
        return real(self, fname, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return out


def _metrics(tpot: float) -> dict[str, float]:
    return {"mean_tpot_ms": tpot, "p99_itl_ms": 2 * tpot, "mean_ttft_ms": 10 * tpot}


def serve_runs() -> list[dict[str, Any]]:
    """Two modes at two rates, as `spaceserve bench serve` records them (what the figures
    read), with a split timeline on a device of 132 SMs."""
    runs = []
    for label, base in (("spatial", 30.0), ("temporal", 20.0)):
        for rate in (1.0, 2.0):
            timeline = [{"t": 0.0, "encoder_sms": 132.0, "decoder_sms": 132.0},
                        {"t": 0.5, "encoder_sms": 66.0, "decoder_sms": 66.0}]
            runs.append({"label": label, "rate": rate, "timeline": timeline,
                         "metrics": {"load": _metrics(base * rate),
                                     "probe": _metrics(math.nan)},
                         "sim": {"load": _metrics(base)}, "results": [], "t0": 0.0})
    return runs


SERVE_FIGURES = {"latency_vs_rate.png", "sm_split_timeline.png"}


def test_bench_serve_figures_on_a_cpu_name_device_model_and_the_caveat(tmp_path, saved):
    from spaceserve.bench.report.tables import title, write_outputs

    device = "CPU (2 cores)"
    head = title("inprocess", "tiny (random weights)", device, ["spatial", "temporal"])
    write_outputs(serve_runs(), tmp_path, {"model": "tiny"}, title=head, device=device)
    assert set(saved) == SERVE_FIGURES
    for name, fig in saved.items():
        assert suptitle(fig) == head, name  # not a panel's title ("TTFT mean (ms)")
        assert device in suptitle(fig) and "tiny (random weights)" in suptitle(fig)
        assert caveat(fig).startswith("ran on a CPU: ") and PLUMBING in caveat(fig), name
    vs_rate = saved["latency_vs_rate.png"]
    assert [ax.get_title() for ax in vs_rate.axes] == ["TPOT mean (ms)", "ITL p99 (ms)",
                                                       "TTFT mean (ms)"]
    timeline = saved["sm_split_timeline.png"]
    assert {ax.get_ylabel() for ax in timeline.axes} == {"nominal SMs"}
    assert "SM counts are nominal: a CPU has no SMs" in caveat(timeline)
    assert "nominal" not in caveat(vs_rate)


def test_bench_serve_figures_on_a_gpu_carry_no_caveat(tmp_path, saved):
    from spaceserve.bench.report.tables import title, write_outputs

    device = "NVIDIA H200 (132 SMs)"
    head = title("http", "Qwen/Qwen2-VL-7B-Instruct", device, ["spatial"])
    write_outputs(serve_runs(), tmp_path, {}, title=head, device=device)
    assert set(saved) == SERVE_FIGURES
    for fig in saved.values():
        assert suptitle(fig) == head and caveat(fig) == ""
        assert "nominal" not in figure_text(fig) and PLUMBING not in figure_text(fig)
    assert {ax.get_ylabel() for ax in saved["sm_split_timeline.png"].axes} == {"SMs"}


@pytest.mark.parametrize("device, says", [
    ("cpu", "ran on a CPU: "), ("cuda:0", None),
    (None, "ran on a device nobody named, not shown to be a GPU: "),
])
def test_bench_serve_figures_without_a_title_take_model_and_device_from_the_config(
        tmp_path, saved, device, says):
    """The GPU harness's serving section passes only its config (model, torch device)."""
    from spaceserve.bench.report.tables import write_outputs

    config = {"model": "qwen2-vl-7b-random", "device": device}
    write_outputs(serve_runs(), tmp_path, config, prefix="serving_")
    assert set(saved) == {f"serving_{n}" for n in SERVE_FIGURES}
    for fig in saved.values():
        assert suptitle(fig).startswith("qwen2-vl-7b-random on ")
        assert suptitle(fig).endswith(device or "an unknown device")
        if says is None:
            assert caveat(fig) == ""
        else:
            assert caveat(fig).startswith(says) and PLUMBING in caveat(fig)


def test_sim_figures_are_modelled_and_name_device_and_model(tmp_path, saved, capsys):
    from spaceserve.runtime.sim.cli import main

    assert main(["--rates", "4", "--duration", "1", "--seed", "1", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert set(saved) == {"tpot_vs_rate.png", "goodput_vs_rate.png"}
    for name, fig in saved.items():
        assert "Qwen2-VL-7B on H200" in suptitle(fig), name
        assert caveat(fig).startswith("MODELLED"), name
        assert "not measured" in caveat(fig)


def kernel_json(path: Path, device: str, model: str = "qwen2-vl-7b") -> Path:
    """A pytest-benchmark file of one kernel case at two budgets, with the `extra_info` the
    kernel suite records (bench/kernel_suite/runner.py)."""
    benchmarks = [{"stats": {"median": 1e-3 * 132 / sms},
                   "extra_info": {"kernel": "linear", "case": "7b-decode", "dtype": "fp16",
                                  "backend": "triton", "budget": sms, "gbs": 10.0 * sms,
                                  "device": device, "model": model, "device_sms": 132}}
                  for sms in (66, 132)]
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return path


def test_kernel_plots_on_a_cpu_name_device_model_caveat_and_nominal_budgets(tmp_path, saved,
                                                                            capsys):
    from spaceserve.bench.kernels.plots import main

    cpu = kernel_json(tmp_path / "cpu.json", "cpu")
    assert main([str(cpu), "--out", str(tmp_path / "curves.png"), "--title", "mine"]) == 0
    capsys.readouterr()
    fig = saved["curves.png"]
    assert suptitle(fig) == "mine\non cpu; models qwen2-vl-7b"
    assert caveat(fig).startswith("CPU run (Triton interpreter): ") and PLUMBING in caveat(fig)
    assert "SM counts are nominal" in caveat(fig)
    assert {ax.get_xlabel() for ax in fig.axes} == {"SM budget (nominal)"}


def test_kernel_plots_of_a_gpu_run_carry_no_caveat(tmp_path, saved, capsys):
    from spaceserve.bench.kernels.plots import main

    gpu = kernel_json(tmp_path / "h200.json", "NVIDIA H200", model="qwen2-vl-72b")
    assert main([str(gpu), "--out", str(tmp_path / "curves.png")]) == 0
    capsys.readouterr()
    fig = saved["curves.png"]
    assert suptitle(fig).endswith("\non NVIDIA H200; models qwen2-vl-72b")
    assert caveat(fig) == "" and {ax.get_xlabel() for ax in fig.axes} == {"SM budget"}
