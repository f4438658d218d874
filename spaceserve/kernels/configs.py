"""Per-budget kernel configurations: a lookup the launchers call, filled offline by autotune.

Launchers ask `kernel_config(name, num_sms, default)` for their block sizes, warps and stages.
Without a tuned table (always on CPU) the launcher's own default comes back unchanged.
`autotune/` writes the tables; `load_kernel_configs` installs one.
"""

from __future__ import annotations

from typing import Any

_TABLE: dict[str, dict[int, dict[str, Any]]] = {}


def budget_bucket(num_sms: int, buckets: list[int]) -> int:
    """The smallest tuned bucket >= num_sms (the largest if none is)."""
    for b in sorted(buckets):
        if num_sms <= b:
            return b
    return max(buckets)


def kernel_config(name: str, num_sms: int, default: dict[str, Any]) -> dict[str, Any]:
    """The tuned config of kernel `name` for a budget of `num_sms`, else `default`."""
    per_budget = _TABLE.get(name)
    if not per_budget:
        return default
    cfg = per_budget[budget_bucket(num_sms, list(per_budget))]
    return {**default, **cfg}


def set_kernel_configs(table: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Install a validated table {kernel: {bucket: config}} (autotune does the validating)."""
    _TABLE.clear()
    _TABLE.update(table)


def clear_kernel_configs() -> None:
    _TABLE.clear()
