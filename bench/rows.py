"""Result rows of the benchmarks and GPU-harness sections, saved as JSON after every row.

Kept free of torch (it is imported nowhere here), so a section's process that only needs its
rows file, such as the harness's own child before the section's module is imported, starts in
a fraction of a second. `bench.common` re-exports everything here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Rows", "bind_section_rows", "section_rows", "write_json"]


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    torch = sys.modules.get("torch")  # a torch object exists only once torch was imported
    if torch is not None:
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu().tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return repr(obj)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON (dtypes, devices, dataclasses turned into plain values).
    The file is replaced whole (written beside it, then renamed): a reader, or a process killed
    mid-write, never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_jsonable, allow_nan=True))
    os.replace(tmp, path)
    return path


class Rows(list):
    """Result rows, written to `path` (JSON) after every added row, so a section killed at its
    hard limit still leaves what it measured. The file holds ``{"section", "status", "seconds",
    "rows"}``; `on_row` (if set) is called after each write."""

    def __init__(self, path: str | Path | None = None, section: str = "") -> None:
        super().__init__()
        self.path = None if path is None else Path(path)
        self.section = section
        self.started = time.perf_counter()
        self.on_row: Callable[[Rows], None] | None = None

    def save(self, status: str = "running", rows: Sequence[dict] | None = None) -> None:
        """Write the rows (or `rows` in their place) with `status`; no-op without a path."""
        if self.path is None:
            return
        write_json(self.path, {"section": self.section, "status": status,
                               "seconds": time.perf_counter() - self.started,
                               "rows": list(self if rows is None else rows)})

    def _added(self) -> None:
        self.save()
        if self.on_row is not None:
            self.on_row(self)

    def append(self, row: dict) -> None:
        super().append(row)
        self._added()

    def extend(self, rows) -> None:  # type: ignore[override]
        for r in rows:
            self.append(r)

    def __iadd__(self, rows):  # type: ignore[override]
        self.extend(rows)
        return self


_SECTION_ROWS: Rows | None = None


def bind_section_rows(path: str | Path, section: str) -> Rows:
    """Make `section_rows()` return rows written to `path` (the GPU harness does this in a
    section's own process, before calling the section)."""
    global _SECTION_ROWS
    _SECTION_ROWS = Rows(path, section)
    _SECTION_ROWS.save()
    return _SECTION_ROWS


def section_rows() -> Rows:
    """The rows of the section this process runs for the GPU harness, saved as they come;
    outside the harness a new in-memory `Rows`. A section calls it once, for its top-level
    row list."""
    return _SECTION_ROWS if _SECTION_ROWS is not None else Rows()
