"""Test setup: the Triton interpreter on CPU (set before any kernel module is imported), one
intra-op thread, and the subprocess runs some tests read (tests/background.py) started with the
session, their readers sorted to its end."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite's tensors are tiny: a second intra-op thread only adds overhead, and on a busy CPU
# (the harness dry runs run beside the suite; CI has two cores) its barrier waits cost far more
# than it saves. Child processes keep their own defaults.
torch.set_num_threads(1)

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
T36_ENV = "SPACESERVE_TRITON36_PYTHON"
BACKGROUND = ("whole_run", "stalled_run", "sm90_check", "kernels_cli")  # tests/background.py


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    # The readers of background runs go last (in their order), so that the runs, started with
    # the session, overlap the rest of the suite instead of being waited for.
    items.sort(key=lambda item: any(name in BACKGROUND for name in item.fixturenames))


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The `--model tiny` checkpoint (tokenizer, image processor, random weights), built once
    per session."""
    from spaceserve.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def whole_run(tmp_path_factory):
    """(Background, OUT) of `run.sh --dry-run OUT` (tests/background.py)."""
    from tests.background import whole_run

    out = tmp_path_factory.mktemp("dry") / "out"
    run = whole_run(out)
    yield run, out
    run.kill()


@pytest.fixture(scope="session")
def stalled_run(tmp_path_factory):
    """(Background, OUT) of a dry run of facts alone, hung after 2 rows until its limit."""
    from tests.background import stalled_run

    out = tmp_path_factory.mktemp("stalled") / "out"
    run = stalled_run(out)
    yield run, out
    run.kill()


@pytest.fixture(scope="session")
def sm90_check(tmp_path_factory):
    """sm90_check(python) -> {module: [result rows]} of one ahead-of-time sm_90 compile
    (`python -m spaceserve.kernels.aot --no-spills`, no interpreter) of every kernel module, every
    GPU tuning candidate (autotune.aot_candidates) and the harness's facts kernels, once per
    python (this one, and SPACESERVE_TRITON36_PYTHON's where set), shared by their tests: one
    process start and one worker pool instead of three."""
    from tests.background import sm90_results, sm90_run

    runs = {}

    def start(python: str) -> None:
        out = tmp_path_factory.mktemp("sm90") / "aot.json"
        runs[python] = (sm90_run(python, out), out)

    for python in filter(None, dict.fromkeys([sys.executable, os.environ.get(T36_ENV)])):
        start(python)

    def get(python: str) -> dict[str, list[dict]]:
        if python not in runs:
            start(python)
        return sm90_results(*runs[python])

    yield get
    for run, _ in runs.values():
        run.kill()


@pytest.fixture(scope="session")
def kernels_cli(tmp_path_factory):
    """(Background, JSON path) of `spaceserve bench kernels` on a slice of the kernel suite."""
    from tests.background import kernels_cli_run

    out = tmp_path_factory.mktemp("kernels") / "run.json"
    run = kernels_cli_run(out)
    yield run, out
    run.kill()


@pytest.fixture(scope="session", autouse=True)
def _start_background_runs(request) -> None:
    """Start the background runs (tests/background.py) the selected tests read when the session
    starts, so they run beside the rest of the suite. Not under pytest-xdist (every worker would
    start them; there they start when first used); the dry runs not with CUDA (their tests are
    skipped)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = {name for item in request.session.items for name in item.fixturenames}
    for name in BACKGROUND:
        if name in wanted and not (HAS_CUDA and name in ("whole_run", "stalled_run")):
            request.getfixturevalue(name)
