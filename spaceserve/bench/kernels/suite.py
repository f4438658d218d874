"""`spaceserve bench kernels`: run the kernel benchmark suite (pytest-benchmark) from a checkout.

    spaceserve bench kernels [--json FILE] [-k EXPR] [--gpu-profile | --cpu-profile]
                             [--deadline S] [--source DIR] [-- PYTEST_ARGS...]

The suite lives in the source tree (bench/kernel_suite/), not in the installed package, so this
command finds it next to the package (an editable install or `PYTHONPATH=.` in a checkout) or
under `--source DIR`, and runs ``python -m pytest bench/kernel_suite --benchmark-only`` there
with the options translated. Its output is pytest-benchmark's own: the terminal tables and, with
`--json`, the standard JSON (compare runs with ``--benchmark-compare``, plot them with
``spaceserve bench plot-kernels``). Arguments after ``--`` go to pytest unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SUITE = Path("bench") / "kernel_suite"


def find_source(explicit: str | None = None) -> Path | None:
    """The checkout holding the suite: `explicit`, else the directory above the package."""
    if explicit is not None:
        roots = [Path(explicit)]
    else:
        roots = [Path(__file__).resolve().parents[3]]
    for root in roots:
        if (root / SUITE / "conftest.py").is_file():
            return root.resolve()
    return None


def pytest_command(source: Path, *, json_path: str | None = None, select: str | None = None,
                   profile: str | None = None, deadline_s: float | None = None,
                   extra: list[str] | None = None) -> list[str]:
    """The pytest command line that runs the suite in `source` (cwd = `source`)."""
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "--benchmark-only", "-p",
           "no:cacheprovider"]
    if json_path is not None:
        cmd.append(f"--benchmark-json={Path(json_path).resolve()}")
    if select:
        cmd += ["-k", select]
    if profile is not None:
        cmd.append(f"--{profile}-profile")
    if deadline_s is not None:
        cmd.append(f"--kernel-deadline={deadline_s:g}")
    return cmd + list(extra or [])


def suite_env(source: Path) -> dict[str, str]:
    """The environment for the suite's process: `source` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spaceserve bench kernels",
        description="Run the kernel benchmark suite (pytest-benchmark; every kernel and "
                    "attention backend over Qwen2-VL shapes, dtypes and SM budgets).",
        epilog="Arguments after -- go to pytest (e.g. -- --benchmark-compare "
               "--benchmark-autosave).")
    p.add_argument("--json", metavar="FILE", help="write pytest-benchmark's JSON here")
    p.add_argument("-k", dest="select", metavar="EXPR",
                   help='pytest -k expression, e.g. "paged and budget66"')
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--gpu-profile", action="store_const", const="gpu", dest="profile",
                      help="Qwen2-VL-7B / 72B shapes in bf16 (needs a CUDA device; its default)")
    prof.add_argument("--cpu-profile", action="store_const", const="cpu", dest="profile",
                      help="small shapes, fp16 and fp32 (on CPU through the Triton "
                           "interpreter: the default there)")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="skip the benchmarks left after S seconds (the JSON keeps the rest)")
    p.add_argument("--source", metavar="DIR",
                   help="a SpaceServe checkout holding bench/kernel_suite/ (default: the one "
                        "this package was imported from)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    source = find_source(args.source)
    if source is None:
        where = args.source or Path(__file__).resolve().parents[3]
        print(f"spaceserve bench kernels: no kernel suite at {Path(where) / SUITE}. The suite "
              "lives in SpaceServe's source tree, not in an installed wheel: run this from a "
              "checkout (pip install -e . or PYTHONPATH=.), pass --source CHECKOUT, or run "
              "`pytest bench/kernel_suite --benchmark-only` in the checkout.", file=sys.stderr)
        return 2
    if importlib.util.find_spec("pytest_benchmark") is None:
        print("spaceserve bench kernels: pytest-benchmark is not installed (pip install "
              "'spaceserve[dev]' or pip install pytest-benchmark)", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).resolve().parent.mkdir(parents=True, exist_ok=True)
    cmd = pytest_command(source, json_path=args.json, select=args.select, profile=args.profile,
                         deadline_s=args.deadline, extra=extra)
    print("running:", " ".join(cmd[1:]), f"(in {source})", flush=True)
    return subprocess.call(cmd, cwd=source, env=suite_env(source))


if __name__ == "__main__":
    sys.exit(main())
