"""The GPU harness: runs the registered benchmark sections, each in its own process and under its
own time budget, and prints a short summary table last.

    bash bench/gpu/run.sh [RESULTS_DIR] [--only SECTION ...] [--list] [--total-s S]

A section is either a function ``run(results_dir, time_budget_s) -> list[dict]`` (given as
"module:function"; the rows go to ``RESULTS_DIR/<section>.json``) or a command. Each runs in a
subprocess killed at its budget, so a slow or hung section cannot starve the others, and the
whole run stays under `--total-s` (default 460 s). Rows carrying a "headline" string are
repeated in the final summary. A later section is one line in `SECTIONS`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOTAL_S = 460.0
SOFT_FRACTION = 0.85  # a function section is told this share of its budget, to finish in time


@dataclass(frozen=True)
class Section:
    """A benchmark section: a "module:function" target or a command, and its time budget."""

    budget_s: float
    target: str | None = None
    command: tuple[str, ...] | None = None
    help: str = ""
    env: dict[str, str] = field(default_factory=dict)
    ok_codes: tuple[int, ...] = (0,)

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


PY = sys.executable
SECTIONS: dict[str, Section] = {
    "facts": Section(35, "bench.gpu.facts:run", help="SMs, copy GB/s, matmul TFLOP/s, green "
                     "contexts, HBM GB/s vs programs, launch overhead, compile times"),
    "gpu-tests": Section(70, command=(PY, "-m", "pytest", "-m", "gpu", "-q", "-p",
                                      "no:cacheprovider", "tests"),
                         help="the bf16/CUDA tests (pytest -m gpu)", ok_codes=(0, 5)),
    "kernels": Section(50, "bench.gpu.bench_kernels:run",
                       help="linear, gated_mlp, norms vs torch; SM sweeps"),
    "vit-attention": Section(30, "bench.bench_vit_attention:run", help="ViT varlen attention"),
    "paged-attention": Section(30, "bench.bench_paged_attention:run",
                               help="paged decode / prefill attention"),
    "models": Section(40, "bench.bench_models:run",
                      help="Qwen2-VL-7B vision pass and decode step vs transformers"),
    "qwen25-vision": Section(25, "bench.bench_qwen25_vision:run", help="Qwen2.5-VL-7B ViT vs HF"),
    "colocation": Section(80, "bench.bench_colocation:run",
                          help="decode beside an image stream, per engine mode, vs the simulator"),
    "autotune": Section(45, "bench.bench_autotune:run", help="measured curves, tuned configs"),
    "serving": Section(40, "bench.bench_serving:run", help="TPOT, ITL, TTFT vs rate; vs sim"),
}


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    rows: int = 0
    headlines: list[str] = field(default_factory=list)


def default_results_dir() -> Path:
    """bench/results/<date>-<gpu>/, e.g. 2026-11-02-h200."""
    tag = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            tag = next((w for w in name.replace("-", " ").split() if any(c.isdigit() for c in w)),
                       "gpu")
    except Exception:
        tag = "gpu"
    return ROOT / "bench" / "results" / f"{_dt.date.today().isoformat()}-{tag}"


def _pump(stream, log, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def run_section(name: str, section: Section, results_dir: Path, limit_s: float) -> Outcome:
    """Run one section in a subprocess killed after `limit_s` seconds."""
    why = section.missing()
    if why:
        return Outcome(name, f"skipped ({why})", 0.0)
    if limit_s < 2:
        return Outcome(name, "skipped (no time left)", 0.0)
    results_dir.mkdir(parents=True, exist_ok=True)
    if section.command is not None:
        cmd = list(section.command)
    else:
        cmd = [PY, "-m", "bench.gpu.harness", "--child", name, "--target", section.target or "",
               "--budget", f"{limit_s * SOFT_FRACTION:.1f}", str(results_dir)]
    env = {**os.environ, **section.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
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
    seconds = time.perf_counter() - t0
    if timed_out:
        status = f"timeout after {limit_s:.0f} s"
    else:
        status = "ok" if rc in section.ok_codes else f"failed (exit {rc})"
    out = Outcome(name, status, seconds)
    if section.command is not None:
        last = _last_line(log_path) if log_path.exists() else ""
        out.headlines = [last] if last else []
    else:
        data_path = results_dir / f"{name}.json"
        if data_path.exists():
            import json

            rows = json.loads(data_path.read_text()).get("rows", [])
            out.rows = len(rows)
            out.headlines = [str(r["headline"]) for r in rows if r.get("headline")]
    return out


def run_all(names: list[str], results_dir: Path, total_s: float = DEFAULT_TOTAL_S,
            sections: dict[str, Section] | None = None) -> list[Outcome]:
    """Run `names` in order; each gets min(its budget, time left of `total_s`)."""
    table = SECTIONS if sections is None else sections
    start = time.perf_counter()
    outcomes = []
    for name in names:
        left = total_s - (time.perf_counter() - start)
        outcomes.append(run_section(name, table[name], results_dir,
                                    min(table[name].budget_s, left)))
    return outcomes


def format_summary(outcomes: list[Outcome]) -> str:
    width = max([len(o.name) for o in outcomes] + [7])
    lines = [f"{'section':{width}}  {'status':44}  {'s':>6}  rows", "-" * (width + 60)]
    for o in outcomes:
        lines.append(f"{o.name:{width}}  {o.status[:44]:44}  {o.seconds:6.1f}  {o.rows}")
        lines += [f"{'':{width}}    {h}" for h in o.headlines]
    return "\n".join(lines)


def child_main(name: str, target: str, budget_s: float, results_dir: Path) -> int:
    """Inside a section's process: call its run() and save the rows as JSON."""
    from bench.common import format_table, write_json

    module, _, func = target.partition(":")
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(module), func or "run")
        rows: list[dict[str, Any]] = list(fn(results_dir, budget_s) or [])
    except Exception:
        traceback.print_exc()
        return 1
    write_json(results_dir / f"{name}.json", {"section": name, "seconds":
                                              time.perf_counter() - t0, "rows": rows})
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k in r if k != "headline"))
        print(format_table(rows, cols))
    return 0


def archive(results_dir: Path, path: Path) -> Path:
    """Pack `results_dir` into the gzipped tarball `path` (members relative to its name)."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(results_dir, arcname=results_dir.name)
    return path


def build_parser(sections: dict[str, Section] | None = None) -> argparse.ArgumentParser:
    table = SECTIONS if sections is None else sections
    p = argparse.ArgumentParser(prog="bench/gpu/run.sh", description="SpaceServe GPU harness")
    p.add_argument("results_dir", nargs="?", type=Path,
                   help="where JSON, PNGs and logs go (default bench/results/<date>-<gpu>/)")
    p.add_argument("--only", nargs="+", choices=list(table), metavar="SECTION",
                   help=f"run only these sections: {', '.join(table)}")
    p.add_argument("--list", action="store_true", help="list the sections and exit")
    p.add_argument("--total-s", type=float, default=DEFAULT_TOTAL_S,
                   help="wall-clock cap for the whole run")
    p.add_argument("--archive", type=Path,
                   help="also pack the results folder into this .tar.gz (one file to carry back)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None, sections: dict[str, Section] | None = None) -> int:
    table = SECTIONS if sections is None else sections
    args = build_parser(table).parse_args(argv)
    if args.child:
        return child_main(args.child, args.target, args.budget, args.results_dir)
    if args.list:
        for name, s in table.items():
            print(f"{name:16} {s.budget_s:5.0f} s  {s.help}")
        return 0
    results_dir = (args.results_dir or default_results_dir()).resolve()
    names = args.only or list(table)
    print(f"SpaceServe GPU harness -> {results_dir}; sections: {', '.join(names)}", flush=True)
    outcomes = run_all(names, results_dir, args.total_s, table)
    from bench.common import write_json

    write_json(results_dir / "summary.json", [o.__dict__ for o in outcomes])
    if args.archive:
        archive(results_dir, args.archive)
    print("\n=== SpaceServe GPU harness summary ===")
    print(format_summary(outcomes))
    return 0 if all(o.status.startswith(("ok", "skipped")) for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
