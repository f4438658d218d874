"""Offline per-budget kernel tuning: candidates timed on the GPU, checked, written as JSON.

For each kernel config name (`cases.CASES`) the tuner builds a case of the model's shapes and
tries the launcher's default plus curated candidates (`cases.candidates`), each checked against
the kernel's fp64 ``ref_*`` (relative error within `spaceserve.kernels.testing.RTOL`) and timed
with ``triton.testing.do_bench``. Only keys the launcher honours are searched, where it honours
them (`spaceserve.kernels.configs.HONOURED`):

- whole-device keys (tile sizes and warps of norms and attention: they set the reduction
  order) are tuned once, at the whole device, and stored in its bucket;
- per-budget keys (GEMM tiles and warps, stages) are tuned at every budget bucket.

The finished table is then verified: outputs at every bucket (and between buckets) must be
bitwise equal to the whole-device output. A bucket that breaks this falls back to the
whole-device config. The table is written with `save_kernel_configs`; launchers read it through
``SPACESERVE_KERNEL_CONFIGS`` or `load_kernel_configs`.

    python -m autotune.tune_kernels --out FILE [--kernels linear,paged_decode]
        [--budgets 32,66,132] [--time-budget S]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cases import CASES, Case, CaseFn, TuneShapes, candidates

DEFAULT_BUDGETS = (32, 66, 132)
Bench = Callable[[Callable[[], Any]], float]


def default_bench(device: torch.device) -> Bench:
    """Milliseconds of one call: do_bench's median on CUDA, one wall-clock call on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=5, rep=25, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return wall


@dataclass
class KernelResult:
    """What tuning one kernel found: its table entry, every trial, timings and the identity
    check's outcome."""

    name: str
    case: str = ""
    entry: dict[int, dict[str, Any]] = field(default_factory=dict)
    trials: list[dict[str, Any]] = field(default_factory=list)
    default_ms: dict[int, float | None] = field(default_factory=dict)
    tuned_ms: dict[int, float | None] = field(default_factory=dict)
    identity: str = ""
    skipped: str | None = None


class Tuner:
    """Tunes kernels for `budgets` (clamped to the device, whole device always included)."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype, shapes: TuneShapes,
                 budgets: Sequence[int] = DEFAULT_BUDGETS, *, bench: Bench | None = None,
                 cases: dict[str, CaseFn] | None = None,
                 candidates_fn: Callable[[str, Case, torch.device], list[dict]] | None = None,
                 time_budget_s: float | None = None, log: Callable[[str], None] | None = None
                 ) -> None:
        from spaceserve.kernels.budget import device_num_sms

        self.device = torch.device(device)
        self.full = device_num_sms(self.device)
        if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                              for b in budgets):
            raise ValueError(f"budgets={list(budgets)!r} must be positive integers")
        self.buckets = sorted({min(b, self.full) for b in budgets} | {self.full})
        self.dtype, self.shapes = dtype, shapes
        self.bench = bench or default_bench(self.device)
        self.cases = dict(CASES if cases is None else cases)
        self.candidates_fn = candidates_fn or candidates
        self.deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.table: dict[str, dict[int, dict[str, Any]]] = {}

    def _late(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def _run(self, name: str, entry: dict[int, dict] | None, case: Case, budget: int
             ) -> torch.Tensor:
        from spaceserve.kernels.configs import using_kernel_configs

        table = {k: v for k, v in self.table.items() if k != name}
        if entry is not None:
            table[name] = entry
        with using_kernel_configs(table):
            case.setup()
            return case.run(budget)

    def _time(self, name: str, entry: dict[int, dict] | None, case: Case, budget: int) -> float:
        from spaceserve.kernels.configs import using_kernel_configs

        table = {k: v for k, v in self.table.items() if k != name}
        if entry is not None:
            table[name] = entry
        with using_kernel_configs(table):
            case.setup()
            timed = case.timed or case.run
            return self.bench(lambda: timed(budget))

    def _trial(self, res: KernelResult, entry: dict[int, dict], case: Case, ref: torch.Tensor,
               budget: int, bucket: int, cfg: dict) -> float | None:
        from spaceserve.kernels.testing import RTOL, rel_error

        row: dict[str, Any] = {"bucket": bucket, "budget": budget, "config": dict(cfg)}
        res.trials.append(row)
        try:
            err = rel_error(self._run(res.name, entry, case, budget), ref)
            tol = RTOL[case.dtype]
            if not err <= tol:
                row["rejected"] = f"relative error {err:.2e} > {tol:.1e}"
                return None
            row["rel_err"] = err
            row["ms"] = self._time(res.name, entry, case, budget)
        except Exception as exc:  # a candidate that does not compile or run is rejected
            row["rejected"] = f"{type(exc).__name__}: {exc}"[:300]
            return None
        return row["ms"]

    def _best(self, res: KernelResult, cands: list[dict], make_entry: Callable[[dict], dict],
              case: Case, ref: torch.Tensor, budget: int, bucket: int) -> dict:
        best, best_ms = {}, None
        for cfg in cands:
            if self._late() and best_ms is not None:
                break
            ms = self._trial(res, make_entry(cfg), case, ref, budget, bucket, cfg)
            if ms is not None and (best_ms is None or ms < best_ms):
                best, best_ms = cfg, ms
        return best

    def tune_kernel(self, name: str) -> KernelResult:
        """Search, verify and time one kernel; its entry joins `self.table`."""
        from spaceserve.kernels.configs import HONOURED

        res = KernelResult(name)
        if name not in self.cases or name not in HONOURED:
            raise ValueError(f"kernels: no tuning case for {name!r}; known: {sorted(self.cases)}")
        if self._late():
            res.skipped = "time budget spent"
            return res
        per_budget, whole = HONOURED[name]
        case = self.cases[name](self.shapes, self.device, self.dtype)
        res.case = case.name
        ref = case.reference()
        keys = set(per_budget) | set(whole)
        cands = [{}] + [{k: v for k, v in c.items() if k in keys}
                        for c in self.candidates_fn(name, case, self.device)]
        full = self.full
        self.log(f"tune {case.name}: {len(cands)} configs x buckets {self.buckets}")
        entry: dict[int, dict] = {}
        if whole:
            entry[full] = self._best(res, cands, lambda c: {full: c}, case, ref, full, full)
            stage_cands = [dict(t) for t in dict.fromkeys(
                tuple(sorted((k, v) for k, v in c.items() if k in per_budget)) for c in cands)]
            for b in self.buckets[:-1]:
                if per_budget:
                    top = entry[full]
                    entry[b] = self._best(res, stage_cands, lambda c, top=top, b=b:
                                          {full: top, b: c}, case, ref, b, b)
        else:
            for b in self.buckets:
                entry[b] = self._best(res, cands, lambda c, b=b: {b: c}, case, ref, b, b)
        res.identity = self._verify(name, entry, case, per_budget)
        res.entry = entry
        self.table[name] = entry
        for b in self.buckets:
            res.default_ms[b] = self._safe_time(name, None, case, b)
            res.tuned_ms[b] = self._safe_time(name, entry, case, b)
        return res

    def _safe_time(self, name: str, entry: dict | None, case: Case, budget: int) -> float | None:
        try:
            return self._time(name, entry, case, budget)
        except Exception:
            return None

    def _check_budgets(self) -> list[int]:
        extra = {1} | {b + 1 for b in self.buckets[:-1]}
        return sorted({b for b in extra if b <= self.full} | set(self.buckets))

    def _differing(self, name: str, entry: dict[int, dict], case: Case) -> list[int]:
        base = self._run(name, entry, case, self.full)
        return [b for b in self._check_budgets()
                if not torch.equal(self._run(name, entry, case, b), base)]

    def _verify(self, name: str, entry: dict[int, dict], case: Case,
                per_budget: tuple[str, ...]) -> str:
        """Bitwise identity across budgets; buckets that break it get the whole-device config."""
        from spaceserve.kernels.configs import budget_bucket

        bad = self._differing(name, entry, case)
        if not bad:
            return "ok"
        reverted = sorted({budget_bucket(b, list(entry)) for b in bad})
        for bucket in reverted:
            entry[bucket] = {k: v for k, v in entry[self.full].items() if k in per_budget}
        if self._differing(name, entry, case):
            raise RuntimeError(f"{name}: outputs differ across budgets under one config; the "
                               "launcher breaks the budget-independence contract")
        self.log(f"tune {name}: buckets {reverted} differed bitwise; reverted to the "
                 "whole-device config")
        return f"reverted buckets {reverted}"

    def tune(self, names: Sequence[str]) -> list[KernelResult]:
        return [self.tune_kernel(n) for n in names]

    def meta(self) -> dict[str, Any]:
        import triton

        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"device": {"name": name, "num_sms": self.full},
                "dtype": str(self.dtype).removeprefix("torch."), "triton": triton.__version__,
                "budgets": self.buckets, "shapes": dataclasses.asdict(self.shapes)}

    def save(self, path: str | os.PathLike) -> Path:
        from spaceserve.kernels.configs import save_kernel_configs

        return save_kernel_configs(path, self.table, self.meta())


def result_rows(results: list[KernelResult]) -> list[dict[str, Any]]:
    """Tuned against default, one row per kernel and budget bucket."""
    from spaceserve.kernels.configs import budget_bucket

    rows = []
    for r in results:
        if r.skipped:
            rows.append({"kernel": r.name, "skipped": r.skipped})
            continue
        for b in sorted(r.tuned_ms):
            d, t = r.default_ms.get(b), r.tuned_ms.get(b)
            rows.append({"kernel": r.name, "budget": b, "default_ms": d, "tuned_ms": t,
                         "speedup": (d / t) if d and t else None,
                         "config": r.entry[budget_bucket(b, list(r.entry))],
                         "identity": r.identity})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autotune.tune_kernels",
                                description="Tune SpaceServe kernel configs per SM budget.")
    p.add_argument("--out", required=True, type=Path, help="JSON table to write")
    p.add_argument("--kernels", default=",".join(CASES), help="comma-separated config names")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="comma-separated budget buckets (the whole device is always added)")
    p.add_argument("--shapes", choices=("qwen2-vl-7b", "tiny"), default=None,
                   help="case shapes (default: qwen2-vl-7b on CUDA, tiny on CPU)")
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    p.add_argument("--time-budget", type=float, default=None, help="stop searching after S s")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:  # the interpreter must be chosen before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("no CUDA device: tuning through the Triton interpreter (exercises the tuner; "
              "its timings mean nothing)", file=sys.stderr)
    device = torch.device("cuda" if cuda else "cpu")
    shapes = TuneShapes.qwen2_vl_7b() if (args.shapes or ("qwen2-vl-7b" if cuda else "tiny")) \
        == "qwen2-vl-7b" else TuneShapes.tiny()
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    tuner = Tuner(device, dtype, shapes, [int(b) for b in args.budgets.split(",")],
                  time_budget_s=args.time_budget)
    results = tuner.tune([k for k in args.kernels.split(",") if k])
    path = tuner.save(args.out)
    for row in result_rows(results):
        print(row)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
