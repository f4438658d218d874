"""A pytest plugin (``-p bench.gpu.pytest_rows``) that writes one row per test as it finishes to
the GPU harness's rows file (``SPACESERVE_ROWS_PATH``), so a test run killed at its time limit
still reports the tests that ran. A test that used pytest-benchmark's ``benchmark`` fixture
adds its timing (median / mean / min / stddev in ms, rounds) and ``extra_info`` to its row.
The last row carries the counts as a headline. Under pytest-xdist the rows are written by the
controlling process from the workers' reports. Without ``SPACESERVE_ROWS_PATH`` it does nothing.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

from bench.common import Rows

_ROWS: Rows | None = None
_COUNTS: Counter = Counter()
_BENCH = "spaceserve_benchmark"


def pytest_configure(config: pytest.Config) -> None:
    global _ROWS
    path = os.environ.get("SPACESERVE_ROWS_PATH")
    if path and not hasattr(config, "workerinput"):  # not inside an xdist worker
        _ROWS = Rows(path, os.environ.get("SPACESERVE_SECTION", "pytest"))
        _ROWS.save()


def _benchmark_cells(item: pytest.Item) -> dict[str, Any]:
    bench = getattr(item, "funcargs", {}).get("benchmark")
    stats = getattr(getattr(bench, "stats", None), "stats", None)
    if stats is None or not getattr(stats, "rounds", 0):
        return {}
    cells = {f"{k}_ms": getattr(stats, k) * 1e3 for k in ("median", "mean", "min", "stddev")}
    cells["rounds"] = stats.rounds
    extra = getattr(bench, "extra_info", None)
    if extra:
        cells["extra_info"] = dict(extra)
    return cells


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and os.environ.get("SPACESERVE_ROWS_PATH"):
        cells = _benchmark_cells(item)
        if cells:  # travels with the report (to the xdist controller too)
            report.user_properties.append((_BENCH, cells))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _ROWS is None:
        return
    # One row per test: its call phase, or the phase that failed or skipped before/after it.
    if not (report.when == "call" or (report.when == "setup" and not report.passed)
            or (report.when == "teardown" and report.failed)):
        return
    status = "error" if report.when != "call" and report.failed else report.outcome
    _COUNTS[status] += 1
    row: dict[str, Any] = {"test": report.nodeid, "status": status, "seconds": report.duration}
    for key, value in report.user_properties:
        if key == _BENCH:
            row |= value
    if report.skipped and isinstance(report.longrepr, tuple):
        row["reason"] = str(report.longrepr[2])[:200]
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        row["error"] = (crash.message if crash is not None else
                        str(report.longrepr).strip().splitlines()[-1])[:300]
    _ROWS.append(row)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ROWS is None:
        return
    counts = ", ".join(f"{n} {k}" for k, n in sorted(_COUNTS.items())) or "no tests ran"
    _ROWS.append({"test": "(session)", "status": f"exit {int(exitstatus)}",
                  "figures": {f"tests_{k}": n for k, n in _COUNTS.items()},
                  "headline": f"pytest: {counts}"})
    _ROWS.save("done")
