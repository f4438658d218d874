"""Validation helpers for settings and request fields: one place for "an int >= 1" and its
friends, so every message reads the same and names the field. A leaf module."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int) -> int:
    """An int >= `low`, as an int; ValueError names `name` (the request-field wording)."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return int(value)


def require_int(name: str, value: Any, low: int = 1, *, optional: bool = False) -> int | None:
    """A setting that must be an int >= `low` (None passes when `optional`); ValueError reads
    ``"name=value must be an int >= low"``."""
    if value is None and optional:
        return None
    if not is_int(value) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return int(value)


def require_ints(name: str, values: Any, low: int = 1) -> tuple[int, ...]:
    """A non-empty sequence of ints >= `low`, as a tuple."""
    if not isinstance(values, Sequence) or isinstance(values, str) or not values or any(
            not is_int(v) or v < low for v in values):
        raise ValueError(f"{name}={values!r} must be a non-empty tuple of ints >= {low}")
    return tuple(int(v) for v in values)


def check_bool(name: str, value: Any) -> bool:
    """A bool; ValueError names `name` (the request-field wording, as `check_int`)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool")
    return value


def require_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False
                ) -> float:
    """A finite number in [low, high] (``(low, high]`` with `low_open`), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")
    if value < low or (low_open and value == low) or value > high:
        where = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise ValueError(f"{name}={value:g} must be in {where}")
    return value


def require_number(name: str, value: Any, *, zero_ok: bool = False, optional: bool = False
                   ) -> float | None:
    """A number > 0 (>= 0 with `zero_ok`; None passes when `optional`), as a float."""
    if value is None and optional:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (value >= 0 if zero_ok else value > 0):
        raise ValueError(f"{name}={value!r} must be a number {'>=' if zero_ok else '>'} 0")
    return float(value)
