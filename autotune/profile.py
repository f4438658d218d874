"""The profiler: measured resource-utility curves of a model on the current device.

For every stage (`policy.curves.STAGE_AXES`), every workload point of a `Grid` and
every SM count (multiples of 8 and the whole device, as green contexts hand them out), it times
one unit of work alone and while the other stage runs at the complementary budget
(``max(min_other_sms, device SMs - sms)``), and writes

- ``<out>/curves.json``: a `CurveSet` in the scheduling core's format (source "measured"): the
  isolated grids, and a contention table with one (encoder SMs, decoder SMs) pair per co-running
  measurement (`contention_table`); where the timer knows each point's host time
  (`CudaTimer.host_bound`), every stage lists its host-bound points, isolated and co-running
  (eager host time >= device time), in ``host_bound``;
- ``<out>/curves.png``: latency against SMs per stage (isolated solid, co-running dashed);
- ``<out>/curves.checkpoint.json``: every finished point, written after each one. A run that
  was interrupted (or ran out of its time budget) resumes from it, and the final files depend
  only on its contents, so a resumed run writes the same bytes as an uninterrupted one.

    spaceserve profile --model tiny|PATH|qwen2-vl-7b --out DIR [--quick]
    python -m autotune.profile ...          (the same)

`--quick` picks the small grid the GPU harness section affords for Qwen2-VL-7B on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.policy.contention import Contention, from_measurements
from spaceserve.runtime.policy.curves import STAGE_AXES, Curve, CurveSet

from .points import STAGES, Point

if TYPE_CHECKING:  # torch-heavy: imported by main() when it measures
    from .timers import Timer
    from .workload import Workload

CHECKPOINT_FORMAT = "spaceserve-profile-checkpoint-v1"
MIN_OTHER_SMS = 8


def sms_points(num_sms: int, step: int = 8) -> tuple[int, ...]:
    """SM counts to measure: every multiple of `step` below the device's, and the device's."""
    return tuple(sorted({*range(step, num_sms, step), num_sms}))


@dataclass(frozen=True)
class Grid:
    """SM counts and workload axes (in `STAGE_AXES` order) to measure."""

    sms: tuple[int, ...]
    patches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_context: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]

    @classmethod
    def full(cls, num_sms: int) -> Grid:
        """The offline grid: every multiple of 8 SMs; up to ~4 1080p images, 4k-token chunks,
        batch 256 and 4k contexts. Tens of minutes for a 7B model on an H200; resumable."""
        return cls(sms_points(num_sms), (256, 1024, 4096, 16384), (64, 256, 1024, 4096),
                   (0, 4096), (1, 4, 16, 64, 256), (256, 1024, 4096))

    @classmethod
    def quick(cls, num_sms: int) -> Grid:
        """What a ~1-minute harness section affords for Qwen2-VL-7B on an H200."""
        return cls(tuple(s for s in (16, 64) if s < num_sms) + (num_sms,), (1024, 4096),
                   (256, 1024), (0,), (1, 32), (512, 2048))

    @classmethod
    def tiny(cls, num_sms: int) -> Grid:
        """Small workloads for smoke runs of tiny models (any device)."""
        return cls(tuple(s for s in (8, 32) if s < num_sms) + (num_sms,), (64, 256), (16, 64),
                   (0, 32), (1, 4), (16, 64))

    def axes(self, stage: str) -> list[tuple[int, ...]]:
        return {"encoder": [self.patches], "prefill": [self.prefill_tokens, self.prefill_context],
                "decode": [self.decode_batch, self.decode_context]}[stage]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sms": list(self.sms)}
        for stage in STAGES:
            out[stage] = {a: list(v) for a, v in zip(STAGE_AXES[stage], self.axes(stage),
                                                       strict=True)}
        return out

    def validate(self, num_sms: int) -> None:
        """ValueError naming the first bad field."""
        for f in dataclasses.fields(self):
            values = getattr(self, f.name)
            low = 0 if f.name.endswith("context") else 1
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low
                                 for v in values):
                raise ValueError(f"grid.{f.name}={values!r}: expected integers >= {low}")
            if any(b <= a for a, b in zip(values, values[1:], strict=False)):
                raise ValueError(f"grid.{f.name}={values!r} must increase strictly")
        if self.sms[-1] > num_sms:
            raise ValueError(f"grid.sms={self.sms!r} exceeds the device's {num_sms} SMs")


def _nested(fn, sms: tuple[int, ...], axes: list[tuple[int, ...]]) -> list:
    def rec(prefix: tuple, rest: list) -> Any:
        if not rest:
            return fn(*prefix)
        return [rec((*prefix, v), rest[1:]) for v in rest[0]]

    return [rec((s,), axes) for s in sms]


@dataclass
class ProfileResult:
    """Outcome of a run: finished points, and the curves once every point is measured."""

    measured: dict[str, float]
    total: int
    out_dir: Path
    curves: CurveSet | None = None
    seconds: float = 0.0
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.measured) == self.total


class Profiler:
    """Measures `grid` on `workload` with `timer` into `out_dir` (see the module docstring)."""

    def __init__(self, workload: Workload, grid: Grid, out_dir: str | os.PathLike, *,
                 timer: Timer, progress: bool = True, min_other_sms: int = MIN_OTHER_SMS,
                 name: str = "curves") -> None:
        grid.validate(workload.num_sms)
        self.workload, self.grid, self.timer = workload, grid, timer
        self.out_dir = Path(out_dir)
        self.progress, self.min_other_sms = progress, min_other_sms
        self.json_path = self.out_dir / f"{name}.json"
        self.png_path = self.out_dir / f"{name}.png"
        self.checkpoint_path = self.out_dir / f"{name}.checkpoint.json"
        # keys of host-bound points; None while no timer that knows host time has run
        self.host_bound: set[str] | None = None

    def other_sms(self, sms: int) -> int:
        """The co-running stage's budget: the rest of the device, at least `min_other_sms`."""
        total = self.workload.num_sms
        return min(total, max(self.min_other_sms, total - sms))

    def points(self) -> list[Point]:
        """Every measurement, grouped by workload point (one setup each)."""
        out = []
        for stage in STAGES:
            for work in self._works(stage):
                for sms in self.grid.sms:
                    for corun in (False, True):
                        out.append(Point(stage, work, sms, corun,
                                         self.other_sms(sms) if corun else 0))
        return out

    def _works(self, stage: str) -> list[tuple[int, ...]]:
        works: list[tuple[int, ...]] = [()]
        for axis in self.grid.axes(stage):
            works = [(*w, v) for w in works for v in axis]
        return works

    def plan(self) -> dict[str, Any]:
        """What the checkpoint was measured for; a checkpoint for another plan is refused."""
        w = self.workload
        plan = {"device": {"name": w.device_name, "num_sms": w.num_sms},
                "model": w.model_meta(), "dtype": w.dtype, "grid": self.grid.to_dict(),
                "background": w.background_meta(), "min_other_sms": self.min_other_sms}
        return json.loads(json.dumps(plan))

    def _load_checkpoint(self, plan: dict[str, Any]) -> dict[str, float]:
        if not self.checkpoint_path.exists():
            return {}
        try:
            data = json.loads(self.checkpoint_path.read_text())
        except ValueError as exc:
            raise ValueError(f"{self.checkpoint_path}: not valid JSON ({exc}); remove it to "
                             "start over") from None
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{self.checkpoint_path}: not a {CHECKPOINT_FORMAT} file")
        if data.get("plan") != plan:
            diff = [k for k in plan if data.get("plan", {}).get(k) != plan[k]]
            raise ValueError(f"{self.checkpoint_path} was written for another profile (differs "
                             f"in {diff}); remove it or choose another output directory")
        points = data.get("points")
        if not isinstance(points, dict):
            raise ValueError(f"{self.checkpoint_path}: 'points' must be an object")
        host = data.get("host_bound")
        if host is not None:
            if not isinstance(host, list) or not set(map(str, host)) <= set(points):
                raise ValueError(f"{self.checkpoint_path}: 'host_bound' must list measured "
                                 "points")
            self.host_bound = set(map(str, host))
        return {str(k): float(v) for k, v in points.items()}

    def _save_checkpoint(self, plan: dict[str, Any], measured: dict[str, float]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        data: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "plan": plan, "points": measured}
        if self.host_bound is not None:
            data["host_bound"] = sorted(self.host_bound)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.checkpoint_path)

    def run(self, time_budget_s: float | None = None) -> ProfileResult:
        """Measure every point not in the checkpoint (stopping once `time_budget_s` is spent),
        then, when all are done, write the curves and the plot."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        plan = self.plan()
        measured = self._load_checkpoint(plan)
        points = self.points()
        todo = [p for p in points if p.key not in measured]
        bar = tqdm(total=len(points), initial=len(points) - len(todo), unit="pt",
                   desc=f"profile {self.workload.device_name}", disable=not self.progress,
                   file=sys.stderr)
        try:
            self._measure(todo, plan, measured, bar, t0, time_budget_s)
        finally:
            bar.close()
        result = ProfileResult(measured, len(points), self.out_dir)
        if result.complete:
            result.curves = self.curves(measured)
            result.files = {"json": result.curves.save(self.json_path),
                            "checkpoint": self.checkpoint_path}
            from .plot import plot_curves

            png = plot_curves(result.curves, self.png_path)
            if png is not None:
                result.files["png"] = png
        result.seconds = time.perf_counter() - t0
        return result

    def _measure(self, todo: list[Point], plan: dict[str, Any], measured: dict[str, float],
                 bar: Any, t0: float, time_budget_s: float | None) -> None:
        i = 0
        while i < len(todo):
            stage, work = todo[i].stage, todo[i].work
            group = []
            while i < len(todo) and (todo[i].stage, todo[i].work) == (stage, work):
                group.append(todo[i])
                i += 1
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                return
            prepared = self.workload.prepare(stage, work)
            try:
                for p in group:
                    if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                        return
                    p = dataclasses.replace(p, units=prepared.units)
                    bg = self.workload.background(stage, p.other_sms) if p.corun else None
                    seconds = self.timer(lambda p=p, r=prepared.run: r(p.sms), bg, p)
                    value = seconds / prepared.units
                    if not (value > 0 and value < float("inf")):
                        raise ValueError(f"{p.key}: timer returned {seconds!r} seconds")
                    measured[p.key] = value
                    self._mark_host_bound(p.key)
                    self._save_checkpoint(plan, measured)
                    bar.set_postfix_str(p.key, refresh=False)
                    bar.update(1)
            finally:
                prepared.close()

    def _mark_host_bound(self, key: str) -> None:
        """Record whether the point just timed is host-bound, when the timer can tell."""
        check = getattr(self.timer, "host_bound", None)
        if not callable(check):
            return
        if self.host_bound is None:
            self.host_bound = set()
        if check(key):
            self.host_bound.add(key)
        else:
            self.host_bound.discard(key)

    def _host_bound_points(self, stage: str) -> list[dict[str, Any]] | None:
        """The stage's host-bound points as the curve file lists them (grid order)."""
        if self.host_bound is None:
            return None
        names = STAGE_AXES[stage]
        out = []
        for sms in self.grid.sms:
            for work in self._works(stage):
                for corun in (False, True):
                    p = Point(stage, work, sms, corun, self.other_sms(sms) if corun else 0)
                    if p.key in self.host_bound:
                        out.append({"sms": sms, **dict(zip(names, work, strict=True)),
                                    "corun": corun})
        return out

    def curves(self, measured: dict[str, float]) -> CurveSet:
        """The `CurveSet` of a complete set of measurements (validated like a loaded file)."""
        w, built = self.workload, {}
        for stage in STAGES:
            axes = self.grid.axes(stage)

            def value(sms: int, *work: int, stage: str = stage) -> float:
                return measured[Point(stage, work, sms, False).key]

            built[stage] = Curve(STAGE_AXES[stage],
                                 {a: list(v) for a, v in zip(STAGE_AXES[stage], axes,
                                                             strict=True)},
                                 list(self.grid.sms), _nested(value, self.grid.sms, axes),
                                 host_bound=self._host_bound_points(stage))
        cs = CurveSet(w.device_name, w.num_sms, w.model_meta(), w.dtype, "measured",
                      built["encoder"], built["prefill"], built["decode"],
                      self.contention_table(measured))
        return CurveSet.from_dict(json.loads(json.dumps(cs.to_dict())))

    def contention_table(self, measured: dict[str, float]) -> Contention:
        """Co-running slowdown per (encoder SMs, decoder SMs) pair from the co-running points:
        encoder points are the compute side at (their SMs, the background decode's); decode
        points, and prefill points (run beside an encoder pass), the decode side at (the
        background encoder's SMs, theirs). Per pair, the median over the workload grid."""
        rows = []
        for p in self.points():
            if not p.corun:
                continue
            iso = measured[Point(p.stage, p.work, p.sms, False).key]
            cor = measured[p.key]
            if p.stage == "encoder":
                rows.append(("encoder", p.sms, p.other_sms, iso, cor))
            else:
                rows.append(("decoder", p.other_sms, p.sms, iso, cor))
        w = self.workload
        return from_measurements(rows, note=f"measured on {w.device_name}: median over the "
                                            "workload grid per pair")


def build_parser() -> argparse.ArgumentParser:
    from spaceserve.cli_args import HelpFormatter

    p = argparse.ArgumentParser(prog="spaceserve profile", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True,
                   help="tiny | qwen2-vl-7b (random weights) | a checkpoint directory")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--quick", action="store_true", help="the small harness grid")
    p.add_argument("--sms", help="comma-separated SM counts instead of the grid's "
                                 "(default: the grid's)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop after this many seconds; rerun to resume (default: no limit)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from .timers import CudaTimer, WallTimer
    from .workload import Qwen2VLWorkload, load_model

    model, name = load_model(args.model, args.device)
    workload = Qwen2VLWorkload(model, name=name)
    n = workload.num_sms
    grid = (Grid.tiny(n) if args.model == "tiny" else Grid.quick(n) if args.quick
            else Grid.full(n))
    if args.sms:
        grid = dataclasses.replace(grid, sms=tuple(int(s) for s in args.sms.split(",")))
    timer = CudaTimer(model.device) if model.device.type == "cuda" else WallTimer()
    if not torch.cuda.is_available():
        print("no CUDA device: timing on the CPU, co-running points timed alone",
              file=sys.stderr)
    profiler = Profiler(workload, grid, args.out, timer=timer, progress=not args.no_progress)
    result = profiler.run(args.time_budget)
    workload.close()
    print(f"{len(result.measured)}/{result.total} points in {result.seconds:.1f} s -> "
          f"{args.out}")
    if not result.complete:
        print("incomplete: run the same command again to resume")
        return 2
    for kind, path in result.files.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
