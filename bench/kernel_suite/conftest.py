"""Kernel suite set-up: the profile, the parametrisation and the GPU timer.

Tests are parametrised here, from the profile's cases: ``test_<kernel>`` over
``kernel_case, dtype, budget`` and ``test_backend_<op>`` over ``backend, backend_case, dtype,
budget``. Ids read ``<case>-<dtype>-budget<SMs>`` (``<backend>-`` first for backends), so
``-k "paged and budget66"`` picks a slice. Options are registered in bench/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from .backend_cases import backend_cases, backend_unavailable, registered_backends  # noqa: E402
from .cases import kernel_cases  # noqa: E402
from .runner import SuiteEnv, cuda_event_timer, measure  # noqa: E402

HERE = Path(__file__).resolve().parent
_ENV = pytest.StashKey[SuiteEnv]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ENV] = SuiteEnv.from_config(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    env = config.stash.get(_ENV, None)
    if env is not None:
        env.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    env = config.stash[_ENV]
    green = "green contexts" if env.green else f"grid budgets only ({env.green_reason})"
    return [f"spaceserve kernel suite: {env.profile} profile on {env.device}, "
            f"{env.total_sms} SMs, budgets {[b.sms for b in env.budgets]} ({green}), "
            f"dtypes {list(env.dtypes)}, {env.rounds} rounds, timing {env.timing}"]


def _kernel_cases(env: SuiteEnv) -> dict:
    return env.cases("kernels", lambda: kernel_cases(env.profile))


def _backend_cases(env: SuiteEnv, backend: str) -> dict:
    return env.cases(f"backend:{backend}", lambda: backend_cases(env.profile, backend))


def _kernel_params(env: SuiteEnv, kernel: str) -> tuple[list[tuple], list[str]]:
    cases = _kernel_cases(env)
    if kernel not in cases:
        raise pytest.UsageError(f"test_{kernel}: no kernel {kernel!r} in the suite's cases")
    values, ids = [], []
    for case in cases[kernel]:
        points = env.budgets if kernel != "rotary_tables" else env.budgets[-1:]
        for dt in env.dtypes:
            for b in points:
                values.append((case.name, dt, b.sms))
                ids.append(f"{case.name}-{dt}-{b.id}")
    return values, ids


def _backend_params(env: SuiteEnv, op: str) -> tuple[list[tuple], list[str]]:
    values, ids = [], []
    for backend in registered_backends():
        for case in _backend_cases(env, backend)[op]:
            for dt in env.dtypes:
                for b in env.budgets:
                    values.append((backend, case.name, dt, b.sms))
                    ids.append(f"{backend}-{case.name}-{dt}-{b.id}")
    return values, ids


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    env = metafunc.config.stash[_ENV]
    name = metafunc.function.__name__
    if "kernel_case" in metafunc.fixturenames:
        values, ids = _kernel_params(env, name.removeprefix("test_"))
        metafunc.parametrize("kernel_case,dtype,budget", values, ids=ids)
    elif "backend_case" in metafunc.fixturenames:
        values, ids = _backend_params(env, name.removeprefix("test_backend_"))
        metafunc.parametrize("backend,backend_case,dtype,budget", values, ids=ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU rounds are timed between CUDA events (`cuda_event_timer`); GC stays off meanwhile.
    Order: the vision and 7B cases before the 72B ones, kernels before backends, so a run cut
    short by `--kernel-deadline` has the most used shapes (each case's budgets stay adjacent)."""
    env = config.stash[_ENV]
    extra = {"timer": cuda_event_timer} if env.device.type == "cuda" else {}
    ours = []
    for i, item in enumerate(items):
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.benchmark(disable_gc=True, **extra))
            params = getattr(item, "callspec", None)
            params = params.params if params is not None else {}
            case = str(params.get("kernel_case", params.get("backend_case", "")))
            ours.append(((case.startswith("72b"), "backend" in params, i), item))
    if ours:
        order = iter(item for _, item in sorted(ours, key=lambda pair: pair[0]))
        items[:] = [next(order) if HERE in Path(str(it.fspath)).parents else it for it in items]


@pytest.fixture(scope="session")
def kernel_suite(request: pytest.FixtureRequest) -> SuiteEnv:
    return request.config.stash[_ENV]


def _budget(env: SuiteEnv, sms: int):
    return next(b for b in env.budgets if b.sms == sms)


@pytest.fixture
def run_kernel(benchmark, kernel_suite: SuiteEnv, kernel_case: str, dtype: str, budget: int):
    """Time this test's kernel case at its dtype and budget."""

    def run(kernel: str) -> None:
        case = next(c for c in _kernel_cases(kernel_suite)[kernel] if c.name == kernel_case)
        measure(benchmark, kernel_suite, ("kernel", kernel, case.name, dtype), case, dtype,
                _budget(kernel_suite, budget), kernel=kernel,
                backend="torch" if kernel == "rotary_tables" else "triton")

    return run


@pytest.fixture
def run_backend(benchmark, kernel_suite: SuiteEnv, backend: str, backend_case: str, dtype: str,
                budget: int):
    """Time this test's attention backend on its case, dtype and budget (a clean skip naming
    the backend when its library is missing or it cannot run here)."""

    def run(op: str) -> None:
        reason = backend_unavailable(backend)
        if reason is not None:
            pytest.skip(reason)
        case = next(c for c in _backend_cases(kernel_suite, backend)[op]
                    if c.name == backend_case)
        measure(benchmark, kernel_suite, ("backend", backend, op, case.name, dtype), case, dtype,
                _budget(kernel_suite, budget), kernel=f"backend.{op}", backend=backend)

    return run
