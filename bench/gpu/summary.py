"""What comes back from a GPU run: the summary JSON, the console log and one archive of the
results folder, all refreshed after every section (so a run cut short still returns what it
measured) and together at most a handful of files in the output folder.

Summary format (``summary.json``, ``"format": "spaceserve-gpu-harness/1"``)::

    run          started / updated (ISO), finished, wall_s, total_s, dry_run, argv,
                 results_dir, archive, log, left_out (files too big for the archive)
    environment  python, packages {torch, triton, transformers, cuda-bindings, ...}, gpu,
                 env {TRITON_CACHE_DIR, CUDA_DEVICE_MAX_CONNECTIONS, ...}
    sections     one entry per section, in run order: name, status, ok, seconds, budget_s,
                 row_count, headlines, figures (merged from the rows' "figures" dicts),
                 columns (every key its rows use), rows, note (last log line when not ok)

A section adds a figure by putting ``"figures": {name: value}`` in any row, a headline by a
``"headline"`` string; new row columns appear in ``columns`` by themselves.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.runner import Outcome

FORMAT = "spaceserve-gpu-harness/1"
ARCHIVE_NAME = "results.tar.gz"
SUMMARY_NAME = "summary.json"
LOG_NAME = "harness.log"
MAX_MEMBER_BYTES = 6 << 20  # a file past this stays out of the archive (listed in left_out)
MAX_LOG_BYTES = 8 << 20
MAX_ROWS = 400  # per section in the summary (all of them are in the archive)
PACKAGES = ("torch", "triton", "transformers", "cuda-bindings", "cuda-python", "numpy",
            "pytest", "pytest-timeout", "pytest-benchmark", "matplotlib")
ENV_KEYS = ("TRITON_CACHE_DIR", "CUDA_DEVICE_MAX_CONNECTIONS", "TRITON_DEFAULT_FP_FUSION",
            "CUDA_VISIBLE_DEVICES", "SPACESERVE_NUM_SMS", "SPACESERVE_KERNEL_CONFIGS")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def environment(gpu: str | None) -> dict[str, Any]:
    """Versions (read from package metadata: nothing imported), the GPU, the relevant env."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"python": platform.python_version(), "packages": versions, "gpu": gpu,
            "env": {k: os.environ.get(k) for k in ENV_KEYS}}


def section_entry(o: Outcome) -> dict[str, Any]:
    columns = list(dict.fromkeys(k for r in o.rows for k in r))
    entry = {"name": o.name, "status": o.status, "ok": o.ok, "seconds": round(o.seconds, 2),
             "budget_s": round(o.budget_s, 1), "row_count": len(o.rows),
             "headlines": o.headlines, "figures": o.figures, "columns": columns,
             "rows": o.rows[:MAX_ROWS]}
    if o.note:
        entry["note"] = o.note
    return entry


def format_summary(outcomes: list[Outcome]) -> str:
    width = max([len(o.name) for o in outcomes] + [7])
    lines = [f"{'section':{width}}  {'status':44}  {'s':>6}  rows", "-" * (width + 60)]
    for o in outcomes:
        lines.append(f"{o.name:{width}}  {o.status[:44]:44}  {o.seconds:6.1f}  {len(o.rows)}")
        lines += [f"{'':{width}}    {h}" for h in o.headlines]
        if o.note and not o.ok:
            lines.append(f"{'':{width}}    last line: {o.note}")
    return "\n".join(lines)


def archive(results_dir: Path, path: Path, max_member_bytes: int = MAX_MEMBER_BYTES
            ) -> list[str]:
    """Pack `results_dir` into the gzipped tarball `path` (members under the folder's name),
    replacing it whole; returns the files left out for their size."""
    left_out: list[str] = []

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.isfile() and info.size > max_member_bytes:
            left_out.append(f"{info.name} ({info.size} bytes)")
            return None
        return None if Path(info.name).name.startswith(".") else info

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(results_dir, arcname=results_dir.name, filter=keep)
    os.replace(tmp, path)
    return left_out


class Tee:
    """Console output copied into a log file (up to `limit` bytes, then one line saying so)."""

    def __init__(self, stream: Any, path: Path, limit: int = MAX_LOG_BYTES) -> None:
        self.stream, self.limit, self.written = stream, limit, 0
        self.file = open(path, "a", buffering=1, errors="replace")  # noqa: SIM115

    def write(self, text: str) -> int:
        self.stream.write(text)
        if self.written < self.limit:
            self.written += len(text)
            self.file.write(text if self.written < self.limit else
                            text + "\n[log truncated here: the full output is in the archive's"
                            " per-section logs]\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Publisher:
    """Keeps the summary (in the results folder and the output folder), the archive and the log
    up to date. `out_dir` None: only the results folder's summary (and `archive_path` if set)."""

    def __init__(self, results_dir: Path, out_dir: Path | None, run: dict[str, Any],
                 gpu: str | None, archive_path: Path | None = None) -> None:
        self.results_dir, self.out_dir = results_dir, out_dir
        self.archive_path = archive_path or (out_dir / ARCHIVE_NAME if out_dir else None)
        self.started = time.perf_counter()
        self.run = {"format": FORMAT, "started": _now(), **run, "results_dir": str(results_dir),
                    "archive": self.archive_path.name if self.archive_path else None,
                    "log": LOG_NAME if out_dir else None}
        self.env = environment(gpu)
        self.tee: Tee | None = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / LOG_NAME).unlink(missing_ok=True)
            self.tee = Tee(sys.stdout, out_dir / LOG_NAME)
            sys.stdout = self.tee

    def update(self, outcomes: list[Outcome], finished: bool = False) -> dict[str, Any]:
        from bench.common import write_json

        self.results_dir.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT,
                "run": {**self.run, "updated": _now(), "finished": finished,
                        "wall_s": round(time.perf_counter() - self.started, 1)},
                "environment": self.env,
                "sections": [section_entry(o) for o in outcomes]}
        write_json(self.results_dir / SUMMARY_NAME, data)
        if self.archive_path is not None:
            data["run"]["left_out"] = archive(self.results_dir, self.archive_path)
        if self.out_dir is not None:
            write_json(self.out_dir / SUMMARY_NAME, data)
        if self.tee is not None:
            self.tee.flush()
        return data

    def close(self) -> None:
        if self.tee is not None:
            sys.stdout = self.tee.stream
            self.tee.close()
            self.tee = None
