"""Kernel demo: every available SpaceServe kernel at several SM budgets, checked against its
torch reference.

    spaceserve demo [--quick] [--only NAME ...]      (from the source tree: python -m bench.kernels)

On CPU the kernels run in the Triton interpreter on small fp16 shapes (under a minute on two
cores); on a GPU in bf16 on Qwen2-VL-7B-like shapes. For each kernel and budget the table shows
the programs launched (from the launch recorder), the relative error against an fp64 reference,
whether the output is bitwise identical to the first budget's, and the time of one call. Kernels
whose module is not in the tree yet are listed as "not available". Exit status 1 when any
available kernel fails a check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from spaceserve.cli_args import HelpFormatter


def default_budgets(total: int, quick: bool) -> list[int]:
    wanted = [1, total] if quick else [1, 8, 66, total]
    return sorted({min(b, total) for b in wanted})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spaceserve demo", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="budgets 1 and the whole device only")
    parser.add_argument("--only", nargs="+", metavar="KERNEL",
                        help="run only these kernels, named as in the table (default: all)")
    parser.add_argument("--budgets", type=int, nargs="+",
                        help="SM budgets to run (default: 1, 8, 66 and the whole device; "
                             "--quick: 1 and the whole device)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from spaceserve.bench.kernels.cases import CASES, run_case
    from spaceserve.bench.measure import format_table
    from spaceserve.kernels import device_num_sms

    names = [c.name for c in CASES]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"--only: unknown kernel(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(names)}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    big = device.type == "cuda"
    dtype = torch.bfloat16 if big else torch.float16
    total = device_num_sms(device)
    budgets = args.budgets or default_budgets(total, args.quick)
    mode = "GPU, Qwen2-VL-7B-like shapes" if big else "CPU, Triton interpreter, small shapes"
    print(f"SpaceServe kernel demo on {device} ({mode}); device SMs {total}; budgets {budgets}")
    rows: list[dict] = []
    t0 = time.perf_counter()
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        rows.extend(run_case(case, budgets, device, dtype, big))
        print(f"  {case.name}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    cols = ["kernel", "shape", "dtype", "budget", "programs", "rel_err", "bitwise_same", "ms",
            "status"]
    print(format_table(rows, cols))
    ran = [r for r in rows if "budget" in r]
    bad = [r for r in ran if r.get("status") != "ok"]
    missing = sorted({r["kernel"] for r in rows if "budget" not in r})
    print(f"{len(ran) - len(bad)} of {len(ran)} kernel runs ok"
          + (f"; not run: {', '.join(missing)}" if missing else "")
          + f"; {time.perf_counter() - t0:.1f} s")
    return 1 if bad or any(r["status"].startswith(("import", "setup")) for r in rows
                           if "budget" not in r) else 0


if __name__ == "__main__":
    sys.exit(main())
