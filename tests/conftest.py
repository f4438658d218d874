"""Test setup: the Triton interpreter on CPU (set before any kernel module is imported), one
intra-op thread, and the GPU-harness dry runs started with the session."""

import json
import os
import subprocess

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite's tensors are tiny: a second intra-op thread only adds overhead, and on a busy CPU
# (the harness dry runs run beside the suite; CI has two cores) its barrier waits cost far more
# than it saves. Child processes keep their own defaults.
torch.set_num_threads(1)

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The `--model tiny` checkpoint (tokenizer, image processor, random weights), built once
    per session."""
    from spaceserve.server.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _background_run(tmp_path_factory, name: str):
    from tests import harness_runs

    out = tmp_path_factory.mktemp(name) / "out"
    run = getattr(harness_runs, name)(out)
    yield run, out
    run.kill()


@pytest.fixture(scope="session")
def whole_run(tmp_path_factory):
    """(Background, OUT) of `run.sh --dry-run OUT` (tests/harness_runs.py)."""
    yield from _background_run(tmp_path_factory, "whole_run")


@pytest.fixture(scope="session")
def stalled_run(tmp_path_factory):
    """(Background, OUT) of a dry run of facts alone, hung after 2 rows until its limit."""
    yield from _background_run(tmp_path_factory, "stalled_run")


@pytest.fixture(scope="session", autouse=True)
def _start_background_runs(request) -> None:
    """Start the harness dry runs at the session's start when selected tests use them, so they
    run beside the rest of the suite. Not under pytest-xdist (every worker would start them;
    there they start when first used) nor with CUDA (their tests are skipped)."""
    if HAS_CUDA or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = {name for item in request.session.items for name in item.fixturenames}
    for name in ("whole_run", "stalled_run"):
        if name in wanted:
            request.getfixturevalue(name)


@pytest.fixture(scope="session")
def sm90_check(tmp_path_factory):
    """sm90_check(python) -> {module: [result rows]} of one ahead-of-time sm_90 compile
    (`python -m spaceserve.kernels.aot --no-spills`, no interpreter) of every kernel module, every
    GPU tuning candidate (autotune.aot_candidates) and the harness's facts kernels, run once per
    python and shared by their tests: one process start and one worker pool instead of three."""
    from spaceserve.kernels.aot import kernel_module_names
    from tests.harness_runs import ROOT, subprocess_env

    done: dict[str, dict[str, list[dict]]] = {}

    def get(python: str) -> dict[str, list[dict]]:
        if python not in done:
            out = tmp_path_factory.mktemp("sm90") / "aot.json"
            targets = [*kernel_module_names(), "autotune.aot_candidates", "bench/gpu/facts.py"]
            modules = [a for t in targets for a in ("--module", t)]
            proc = subprocess.run([python, "-m", "spaceserve.kernels.aot", "--jobs", "2",
                                   "--no-spills", "--json", str(out), *modules],
                                  cwd=ROOT, env=subprocess_env(PYTHONPATH=os.pathsep.join(
                                      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
                                  capture_output=True, text=True, timeout=900)
            assert out.exists(), f"the checker wrote no results:\n{proc.stdout}{proc.stderr}"
            by: dict[str, list[dict]] = {t: [] for t in targets}
            for row in json.loads(out.read_text())["results"]:
                by.setdefault(row["module"], []).append(row)
            done[python] = by
        return done[python]

    return get
