"""pytest under bench/: only the kernel suite (bench/kernel_suite/) is ever collected.

The other modules here (serving/, kernels/, sim/, attack/, gpu/) are scripts and harness
sections, not tests, so `pytest bench/` ignores them whatever `python_files` says. The suite's
command-line options are registered here, where pytest finds them for `pytest bench/` as well
as for `pytest bench/kernel_suite`. The plain test command (`pytest`, testpaths = tests) never comes
here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SUITE = HERE / "kernel_suite"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = Path(collection_path).resolve()
    if path == HERE or path == SUITE or SUITE in path.parents:
        return None
    return HERE in path.parents or None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spaceserve kernel suite")
    group.addoption("--gpu-profile", action="store_true",
                    help="real Qwen2-VL-7B / 72B shapes in bf16 (needs a CUDA device; the "
                         "default there)")
    group.addoption("--cpu-profile", action="store_true",
                    help="small shapes (fp16, fp32), also on a GPU; the default without one")
    group.addoption("--kernel-dtypes", default=None, metavar="LIST",
                    help="comma-separated dtypes to run (fp32, fp16, bf16) instead of the "
                         "profile's")
    group.addoption("--kernel-rounds", type=int, default=None, metavar="N",
                    help="timed rounds per benchmark (default 30 on a GPU, 2 on CPU)")
    group.addoption("--kernel-deadline", type=float, default=None, metavar="S",
                    help="skip the benchmarks left once S seconds have passed since the "
                         "session started (the JSON still gets those that ran)")
    group.addoption("--kernel-green", choices=("auto", "on", "off"), default="auto",
                    help="run each SM budget inside a green-context partition of that size "
                         "(auto: where the driver offers them)")
    group.addoption("--kernel-timing", choices=("graph", "events"), default="graph",
                    help="GPU timing: replay a CUDA graph of the call between CUDA events "
                         "(default; falls back to eager where capture fails) or time eager "
                         "calls between CUDA events")
