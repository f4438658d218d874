"""Running the GPU harness's sections: each in its own process group under its own time limit,
killed (SIGTERM, then SIGKILL) when it overruns, its output copied to ``<section>.log`` and to
the console. A function section runs in a child (`child_main`) whose rows are saved to
``<section>.json`` after every row and once more on SIGTERM; a command section (pytest) writes
the same file through its plugin. Whatever a section left there is its result, killed or not.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu.sections import SECTIONS, Section

ROOT = Path(__file__).resolve().parents[2]
SOFT_FRACTION = 0.85  # a section is told this share of its limit, to finish in time
KILL_GRACE_S = 5.0  # between SIGTERM (rows dumped) and SIGKILL
MIN_START_S = 3.0  # a section with less time than this left is skipped, not started
SERVE_EXTRA = ("fastapi", "uvicorn", "openai", "pydantic")  # absent from the GPU image


@dataclass
class Outcome:
    """What one section did: status is "pending", "ok", "failed (exit N)", "timeout after N s"
    or "skipped (why)"; rows as the section left them."""

    name: str
    status: str = "pending"
    seconds: float = 0.0
    budget_s: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    headlines: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok" or self.status.startswith("skipped")


@dataclass
class RunOptions:
    """How sections run: where results go, dry run (the `dry` targets, CPU), a stall to inject
    (section, after N rows; dry runs only), and environment added for every child."""

    results_dir: Path
    dry_run: bool = False
    stall: tuple[str, int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable


def blocked_imports_dir(names: tuple[str, ...] = SERVE_EXTRA) -> Path:
    """A throwaway folder of modules that raise ImportError: first on PYTHONPATH, it makes a
    process see these packages as absent (as on the GPU image)."""
    path = Path(tempfile.mkdtemp(prefix="spaceserve-blocked-"))
    for name in names:
        (path / f"{name}.py").write_text(
            f"raise ImportError('{name} is blocked: not on the GPU image')\n")
    return path


def _pump(stream, log, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def read_rows(path: Path) -> tuple[list[dict[str, Any]], str]:
    """(rows, status) of a section's rows file; ([], "") when absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], ""
    if isinstance(data, list):
        return data, ""
    return list(data.get("rows", [])), str(data.get("status", ""))


def _collect(out: Outcome, rows: list[dict[str, Any]]) -> None:
    out.rows = rows
    out.headlines = [str(r["headline"]) for r in rows if r.get("headline")]
    for r in rows:
        if isinstance(r.get("figures"), dict):
            out.figures.update(r["figures"])


def run_section(name: str, section: Section, opts: RunOptions, limit_s: float) -> Outcome:
    """Run one section in a subprocess killed after `limit_s` seconds."""
    out = Outcome(name, budget_s=limit_s)
    why = section.missing()
    if why:
        out.status = f"skipped ({why})"
        return out
    if limit_s < MIN_START_S:
        out.status = "skipped (no time left)"
        return out
    results_dir = opts.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    rows_path = results_dir / f"{name}.json"
    rows_path.unlink(missing_ok=True)
    soft = limit_s * SOFT_FRACTION
    if section.command is not None:
        cmd = section.argv(opts.python, str(results_dir), soft)
    else:
        target = section.dry if opts.dry_run and section.dry else section.target
        cmd = [opts.python, "-m", "bench.gpu.harness", "--child", name, "--target", target or "",
               "--budget", f"{soft:.1f}", str(results_dir)]
        if opts.stall and opts.stall[0] == name:
            cmd += ["--stall-after", str(opts.stall[1])]
    env = {**os.environ, **opts.env, **section.env, "SPACESERVE_SECTION": name,
           "SPACESERVE_ROWS_PATH": str(rows_path)}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [opts.env.get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH")]))
    log_path = results_dir / f"{name}.log"
    print(f"== {name} (budget {limit_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, f"[{name}] "), daemon=True)
        pump.start()
        try:
            rc = proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
        pump.join(timeout=5)
    out.seconds = time.perf_counter() - t0
    if timed_out:
        out.status = f"timeout after {limit_s:.0f} s"
    else:
        out.status = "ok" if rc in section.ok_codes else f"failed (exit {rc})"
    rows, _ = read_rows(rows_path)
    _collect(out, rows)
    last = _last_line(log_path) if log_path.exists() else ""
    if not out.ok or (section.command is not None and not out.headlines):
        out.note = last
    if section.command is not None and not out.headlines and last:
        out.headlines = [last]
    return out


def run_all(names: list[str], results_dir: Path, total_s: float,
            sections: dict[str, Section] | None = None, *, options: RunOptions | None = None,
            budgets: dict[str, float] | None = None,
            on_done: Callable[[list[Outcome]], None] | None = None) -> list[Outcome]:
    """Run `names` in order; each gets min(its budget, time left of `total_s`). `on_done` sees
    every outcome (the ones still to run "pending") after each section."""
    table = SECTIONS if sections is None else sections
    opts = options or RunOptions(Path(results_dir))
    budgets = budgets or {n: table[n].budget_s for n in names}
    start = time.perf_counter()
    outcomes = [Outcome(n, budget_s=budgets[n]) for n in names]
    for i, name in enumerate(names):
        left = total_s - (time.perf_counter() - start)
        outcomes[i] = run_section(name, table[name], opts, min(budgets[name], left))
        if on_done is not None:
            on_done(outcomes)
    return outcomes


def _stall(rows: Any) -> None:
    print(f"stalling after {len(rows)} rows (fault injected by --stall)", flush=True)
    while True:
        time.sleep(1)


def child_main(name: str, target: str, budget_s: float, results_dir: Path,
               stall_after: int | None = None) -> int:
    """Inside a section's process: call its function, its rows saved as they come (and once
    more on SIGTERM); the returned rows are saved last, with a table on the console."""
    from bench.rows import bind_section_rows  # torch-free: the section imports what it needs
    from spaceserve.bench.measure import format_table

    rows = bind_section_rows(results_dir / f"{name}.json", name)

    def on_term(signum: int, frame: Any) -> None:
        rows.save(f"terminated ({signal.Signals(signum).name})")
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if stall_after:
        rows.on_row = lambda r: _stall(r) if len(r) >= stall_after else None
    module, _, func = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), func or "run")
        result: list[dict[str, Any]] = list(fn(results_dir, budget_s) or [])
    except Exception:
        traceback.print_exc()
        rows.save("error")
        return 1
    if stall_after:
        _stall(rows)
    rows.save("done", result)
    if result:
        cols = list(dict.fromkeys(k for r in result for k in r if k not in ("headline",
                                                                             "figures")))
        print(format_table(result, cols[:14]))
    return 0
