"""The GPU harness's sections, in the order they run (most valuable first): one line each.

A section is a function ``run(results_dir, time_budget_s) -> list[dict]`` named as
"module:function", or a command (argv; the tokens ``{python}``, ``{results_dir}`` and
``{budget_s}`` are filled in, ``{gpu_tests}`` becomes the test files that mark tests ``gpu``
(`gpu_test_files`: collecting only those takes seconds, the whole suite most of a dry run's
budget), and ``{xdist}`` becomes ``-n N --dist loadfile`` where
pytest-xdist is installed and N = min(8, cores / 2) >= 2, so tests compile their kernels in
parallel).
A pytest suite is a command made by `pytest_section`: its tests become rows as they finish
(bench/gpu/pytest_rows.py), pytest-benchmark figures included, so a kernel benchmark suite is
one more line here. In a dry run (``run.sh --dry-run``) a section runs its `dry` target when it
has one (its control flow on CPU with the CUDA work faked), else its own target (which skips
without CUDA), under `dry_budget_s`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

DEFAULT_TOTAL_S = 530.0  # one 9-minute call: the sections, the harness's start and its archive
DRY_TOTAL_S = 75.0  # + the harness itself: the dry run ends within 90 s
GPU_TEST_TIMEOUT_S = 45  # per test (pytest-timeout); a hung test fails alone


@dataclass(frozen=True)
class Section:
    """A benchmark section: a "module:function" target or a command, and its time budget."""

    budget_s: float
    target: str | None = None
    command: tuple[str, ...] | None = None
    help: str = ""
    env: dict[str, str] = field(default_factory=dict)
    ok_codes: tuple[int, ...] = (0,)
    dry: str | None = None  # "module:function" of the dry run, when the section has one
    dry_budget_s: float = 8.0

    def missing(self) -> str | None:
        """Why this section cannot run here (its module is absent), else None."""
        if self.target is None:
            return None
        module = self.target.split(":")[0]
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        return None if found else f"{module.replace('.', '/')}.py not present"

    def argv(self, python: str, results_dir: str, budget_s: float) -> list[str]:
        """The command with its tokens filled in."""
        assert self.command is not None
        out = []
        for arg in self.command:
            if arg == "{gpu_tests}":
                out += gpu_test_files()
                continue
            if arg == "{xdist}":
                workers = min(8, (os.cpu_count() or 1) // 2)
                if workers >= 2 and importlib.util.find_spec("xdist") is not None:
                    out += ["-n", str(workers), "--dist", "loadfile"]
                continue
            arg = python if arg == "{python}" else arg
            out.append(arg.replace("{results_dir}", results_dir)
                       .replace("{budget_s}", f"{budget_s:.0f}"))
        return out


def gpu_test_files(root: str = "tests") -> list[str]:
    """The test files under `root` that mark tests ``gpu`` (``pytest.mark.gpu`` or a
    ``pytestmark`` naming it), sorted; `root` itself when none is found (pytest then collects
    everything, as before)."""
    from pathlib import Path

    files = sorted(str(p) for p in Path(root).rglob("test_*.py")
                   if "mark.gpu" in p.read_text(errors="replace"))
    return files or [root]


def pytest_section(budget_s: float, *args: str, timeout_s: int = GPU_TEST_TIMEOUT_S,
                   help: str = "", dry_budget_s: float = 30.0) -> Section:
    """A pytest run as a section: one row per test as it finishes, a per-test timeout, tests
    spread over processes where pytest-xdist is installed, and exit 5 (nothing collected)
    counted as ok."""
    return Section(budget_s, command=("{python}", "-m", "pytest", *args, "-q", "-p",
                                      "no:cacheprovider", "-p", "bench.gpu.pytest_rows",
                                      f"--timeout={timeout_s}", "{xdist}"),
                   help=help, ok_codes=(0, 5), dry_budget_s=dry_budget_s)


# Budgets add up to DEFAULT_TOTAL_S. engine-step (40 s) and serving's fourth mode (+15 s) took
# 55 s from sections whose questions others also answer, each of which stops at its soft
# budget and keeps what it measured: kernel-suite -10 (its graph-timed kernels overlap kernels
# and paged-attention), models -10 (its decode step is engine-step's, in the engine),
# vit-attention -10 (also in the kernel suite and models' vision pass), gpu-tests, paged-attention,
# kernels, qwen25-vision and autotune -5 each; verdict's 20 s (the simulator on the measured
# curves, CPU only) came from kernel-suite (40 -> 20 s). The end-to-end sections (engine-step,
# colocation, serving) run right after the kernels they stand on, before the per-component ones.
SECTIONS: dict[str, Section] = {
    "warmup": Section(70, "bench.gpu.warmup:run", dry="bench.gpu.warmup:dry_run",
                      dry_budget_s=15, help="compile every launcher's shapes into the run's "
                      "Triton cache in parallel workers; cold and second-launch time per case"),
    "facts": Section(30, "bench.gpu.facts:run", dry="bench.gpu.facts:dry_run", dry_budget_s=12,
                     help="SMs, copy GB/s, matmul TFLOP/s, green contexts, HBM GB/s vs "
                     "programs, launch overhead"),
    "gpu-tests": pytest_section(65, "-m", "gpu", "{gpu_tests}", dry_budget_s=45,
                                help="the bf16/CUDA tests (pytest -m gpu), a row per test"),
    "paged-attention": Section(30, "bench.kernels.paged_attention:run",
                               help="paged decode / prefill attention"),
    "kernels": Section(25, "bench.gpu.bench_kernels:run", dry="bench.gpu.bench_kernels:dry_run",
                       dry_budget_s=12, help="linear, gated_mlp, norms vs torch (decode shapes "
                       "and multi-launch ops graph-timed, host us per call); SM sweeps"),
    "engine-step": Section(40, "bench.gpu.engine_step:run", dry="bench.gpu.engine_step:dry_run",
                           dry_budget_s=12, help="the pipelined engine step on Qwen2-VL-7B "
                           "(bf16, 28 layers), batch 1/16/64, greedy and random, graphs and "
                           "eager: device ms (CUDA events), host ms, idle fraction"),
    "colocation": Section(75, "bench.serving.colocation:run",
                          dry="bench.serving.colocation:dry_run", dry_budget_s=15,
                          help="decode beside an image stream, per engine mode, vs the "
                          "simulator; decode-graph bytes per split"),
    "serving": Section(50, "bench.serving.serving:run", dry="bench.serving.serving:dry_run",
                       dry_budget_s=15, help="TPOT, ITL, TTFT vs rate per mode (spatial and "
                       "temporal-chunked with its SLO window first); vs sim; graph memory"),
    "models": Section(35, "bench.kernels.models:run",
                      help="Qwen2-VL-7B vision pass and decode step vs transformers"),
    "vit-attention": Section(20, "bench.kernels.vit_attention:run", help="ViT varlen attention"),
    "qwen25-vision": Section(20, "bench.kernels.qwen25_vision:run", help="Qwen2.5-VL-7B ViT vs HF"),
    "kernel-suite": Section(20, "bench.kernel_suite.section:run",
                            dry="bench.kernel_suite.section:dry_run", dry_budget_s=12,
                            help="the pytest-benchmark kernel suite's GPU profile (graph-timed, "
                            "7B shapes first); its JSON and plot go into the archive"),
    "autotune": Section(30, "bench.kernels.autotune:run", help="measured curves, tuned configs"),
    "verdict": Section(20, "bench.gpu.verdict:run", dry="bench.gpu.verdict:dry_run",
                       dry_budget_s=10, help="the measured curves (autotune's) copied up, the "
                       "hardware facts that decide sharing, and the simulator's spatial vs "
                       "best-temporal on them (modelled)"),
}
