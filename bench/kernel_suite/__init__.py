"""The kernel benchmark suite (pytest-benchmark), run only when asked for:

    pytest bench/kernel_suite --benchmark-only [-k EXPR] [--gpu-profile] --benchmark-json out.json
    spaceserve bench kernels --json out.json [-k EXPR] [--gpu-profile]      (the same, wrapped)

Every kernel of `spaceserve.kernels` and every registered attention backend over Qwen2-VL
shapes, dtypes and SM budgets; see conftest.py (parametrisation), shapes.py (profiles),
cases.py / backend_cases.py (problems, bytes, FLOPs) and runner.py (timing, extra_info).
`run(results_dir, time_budget_s)` is the GPU harness's entry point (section.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SUITE_DIR = Path(__file__).resolve().parent


def run(results_dir: Path, time_budget_s: float, **options: Any) -> list[dict[str, Any]]:
    """Run the suite's GPU profile within `time_budget_s`; JSON and plot into `results_dir`
    (`options`: `select`, a pytest -k expression; `profile`, "gpu" or "cpu")."""
    from .section import run as _run

    return _run(Path(results_dir), time_budget_s, **options)
