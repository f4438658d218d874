"""Field checks of the curve file (`curves.py`): each malformed field raises a ValueError that
names its JSON path (``curves: $.curves.decode.sms[1]: ...``)."""

from __future__ import annotations

import math
from typing import Any


def fail(path: str, msg: str) -> ValueError:
    return ValueError(f"curves: {path}: {msg}")


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_axis(values: Any, path: str, *, integer: bool, minimum: float) -> list:
    if not isinstance(values, list) or not values:
        raise fail(path, "expected a non-empty list")
    for i, v in enumerate(values):
        if not is_num(v) or (integer and int(v) != v) or v < minimum:
            kind = "an integer" if integer else "a number"
            raise fail(f"{path}[{i}]", f"expected {kind} >= {minimum}, got {v!r}")
        if i and v <= values[i - 1]:
            raise fail(f"{path}[{i}]", f"values must increase strictly ({values[i - 1]} -> {v})")
    return [int(v) if integer else float(v) for v in values]


def check_grid(data: Any, shape: tuple[int, ...], path: str) -> Any:
    if len(shape) == 0:
        if not is_num(data) or data <= 0:
            raise fail(path, f"expected a positive finite latency in seconds, got {data!r}")
        return float(data)
    if not isinstance(data, list) or len(data) != shape[0]:
        got = len(data) if isinstance(data, list) else type(data).__name__
        raise fail(path, f"expected a list of {shape[0]} entries, got {got}")
    return [check_grid(v, shape[1:], f"{path}[{i}]") for i, v in enumerate(data)]


def check_host_bound(data: Any, axes: tuple[str, ...], sms: list, grid: dict[str, list],
                     path: str) -> list[dict[str, Any]]:
    """Host-bound points: objects naming a grid point ({"sms", *axes, "corun"})."""
    if not isinstance(data, list):
        raise fail(path, "expected a list")
    keys = ["sms", *axes, "corun"]
    for i, p in enumerate(data):
        if not isinstance(p, dict) or sorted(p) != sorted(keys):
            raise fail(f"{path}[{i}]", f"expected an object with keys {keys}, got {p!r}")
        if not isinstance(p["corun"], bool):
            raise fail(f"{path}[{i}].corun", f"expected true or false, got {p['corun']!r}")
        for name, values in (("sms", sms), *((a, grid[a]) for a in axes)):
            if isinstance(p[name], bool) or p[name] not in values:
                raise fail(f"{path}[{i}].{name}", f"{p[name]!r} is not in the grid {values}")
    return [{k: p[k] for k in keys} for p in data]
