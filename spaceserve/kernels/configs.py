"""Per-budget kernel configurations: a lookup the launchers call, filled offline by autotune.

Launchers ask `kernel_config(name, num_sms, default)` for their block sizes, warps and stages.
Without a tuned table (always on CPU) the launcher's own default comes back unchanged.

Tables map ``{kernel: {bucket: config}}``; a budget uses the smallest bucket >= it. A config is
a partial override merged over the launcher's default. Which keys a launcher honours, and at
which bucket, is listed in `HONOURED`: keys that set the reduction order (BLOCK_K of the GEMMs,
tile sizes and warps of norms and attention) are read at the whole-device bucket only, so a
table can never make results depend on the budget.

`autotune/tune_kernels.py` writes tables as JSON (`save_kernel_configs`); `load_kernel_configs`
installs one, and the environment variable ``SPACESERVE_KERNEL_CONFIGS`` names a file read once,
at the first lookup. Loading validates every entry: a malformed one, or a kernel the loaded file
lacks, falls back to the launcher's defaults with one logged line (logger
``spaceserve.kernels``) naming it. `set_kernel_configs` installs a table as given (tests, the
tuner).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMAT = "spaceserve-kernel-configs-v1"
ENV = "SPACESERVE_KERNEL_CONFIGS"
log = logging.getLogger("spaceserve.kernels")

# GEMM tile shape and warps pick the tensor-core instructions: whole-device bucket only.
_GEMM = (("GROUP_M", "num_stages"), ("BLOCK_M", "BLOCK_N", "num_warps"))
# kernel -> (keys read at the budget's bucket, keys read at the whole-device bucket only)
HONOURED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": _GEMM,
    "linear_skinny": _GEMM,
    "gated_mlp": _GEMM,
    "gated_mlp_skinny": _GEMM,
    "splitk_reduce": (("BLOCK", "num_warps", "num_stages"), ()),
    "rms_norm": (("num_stages",), ("BLOCK_M", "num_warps")),
    "layer_norm": (("num_stages",), ("BLOCK_M", "num_warps")),
    # BLOCK_HALF must cover head_dim / 2 (the launcher's default does): never from a table.
    "rotary": (("BLOCK_T", "BLOCK_H", "num_warps", "num_stages"), ()),
    "vit_attention": ((), ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")),
    "paged_decode": (("num_stages",), ("BLOCK_N", "num_warps")),
    "paged_decode_merge": (("num_stages",), ("num_warps",)),
    "paged_prefill": (("num_stages",), ("BLOCK_M", "BLOCK_N", "num_warps")),
    "store_kv": (("BLOCK_ELEMS", "num_warps", "num_stages"), ()),
}
WARPS = (1, 2, 4, 8, 16, 32)
MAX_STAGES = 8

_TABLE: dict[str, dict[int, dict[str, Any]]] = {}
_STATE: dict[str, Any] = {"env_read": False, "source": None, "warned": set()}


def budget_bucket(num_sms: int, buckets: list[int]) -> int:
    """The smallest tuned bucket >= num_sms (the largest if none is)."""
    for b in sorted(buckets):
        if num_sms <= b:
            return b
    return max(buckets)


def kernel_config(name: str, num_sms: int, default: dict[str, Any]) -> dict[str, Any]:
    """The tuned config of kernel `name` for a budget of `num_sms`, else `default`."""
    if not _STATE["env_read"]:
        _load_from_env()
    per_budget = _TABLE.get(name)
    if not per_budget:
        if _STATE["source"] is not None and name not in _STATE["warned"]:
            _STATE["warned"].add(name)
            log.warning("kernel configs %s: no entry for kernel %r; using its defaults",
                        _STATE["source"], name)
        return default
    cfg = per_budget[budget_bucket(num_sms, list(per_budget))]
    return {**default, **cfg}


def set_kernel_configs(table: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Install `table` {kernel: {bucket: config}} as given (no validation, no file)."""
    _TABLE.clear()
    _TABLE.update({k: {int(b): dict(c) for b, c in v.items()} for k, v in table.items()})
    _STATE.update(env_read=True, source=None, warned=set())


def clear_kernel_configs() -> None:
    """Back to the launchers' defaults (the environment variable is not read again)."""
    set_kernel_configs({})


def reset_kernel_configs() -> None:
    """Back to the start-up state: no table, the environment variable read at the next lookup."""
    clear_kernel_configs()
    _STATE["env_read"] = False


def kernel_configs() -> dict[str, dict[int, dict[str, Any]]]:
    """A copy of the installed table."""
    return {k: {b: dict(c) for b, c in v.items()} for k, v in _TABLE.items()}


@contextmanager
def using_kernel_configs(table: dict[str, dict[int, dict[str, Any]]]) -> Iterator[None]:
    """Install `table` inside the block, then restore what was installed before."""
    saved, state = kernel_configs(), dict(_STATE)
    set_kernel_configs(table)
    try:
        yield
    finally:
        set_kernel_configs(saved)
        _STATE.update(state)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_config(name: str, cfg: Any) -> str | None:
    """Why `cfg` is not a valid config of kernel `name` (None when it is)."""
    if not isinstance(cfg, dict):
        return f"expected an object, got {type(cfg).__name__}"
    known = HONOURED.get(name)
    allowed = set(known[0]) | set(known[1]) if known else None
    for key, v in cfg.items():
        if allowed is not None and key not in allowed:
            return f"key {key!r} is not read by the launcher (honoured: {sorted(allowed)})"
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{key}={v!r} must be a positive integer"
        if key == "num_warps" and v not in WARPS:
            return f"num_warps={v} must be one of {WARPS}"
        if key == "num_stages" and v > MAX_STAGES:
            return f"num_stages={v} must be <= {MAX_STAGES}"
        if key.startswith("BLOCK") and not _is_pow2(v):
            return f"{key}={v} must be a power of two"
    return None


def parse_kernel_configs(data: Any, source: str = "<data>") -> dict[str, dict[int, dict]]:
    """Validate a decoded JSON table. Malformed entries fall back to the defaults (a bad bucket
    becomes an empty override, a bad kernel is dropped), each with one logged line."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        log.warning("kernel configs %s: expected format %r, got %r; using defaults", source,
                    FORMAT, got)
        return {}
    kernels = data.get("kernels")
    if not isinstance(kernels, dict):
        log.warning("kernel configs %s: 'kernels' must be an object; using defaults", source)
        return {}
    table: dict[str, dict[int, dict]] = {}
    for name, buckets in kernels.items():
        if not isinstance(buckets, dict) or not buckets:
            log.warning("kernel configs %s: entry %r must be a non-empty object of buckets; "
                        "using its defaults", source, name)
            continue
        entry: dict[int, dict] = {}
        for key, cfg in buckets.items():
            try:
                bucket = int(key)
            except (TypeError, ValueError):
                bucket = 0
            if bucket < 1 or str(bucket) != str(key).strip():
                log.warning("kernel configs %s: entry %r has bucket %r, not a positive SM "
                            "count; ignored", source, name, key)
                continue
            why = check_config(name, cfg)
            if why:
                log.warning("kernel configs %s: entry %r bucket %d is malformed (%s); using "
                            "defaults there", source, name, bucket, why)
                cfg = {}
            entry[bucket] = dict(cfg)
        if entry:
            table[name] = entry
    return table


def load_kernel_configs(path: str | os.PathLike) -> dict[str, dict[int, dict]]:
    """Read, validate and install the table in `path`; returns what was installed. A missing or
    unreadable file installs no table (defaults everywhere) with one logged line."""
    source = os.fspath(path)
    try:
        data = json.loads(Path(source).read_text())
    except (OSError, ValueError) as exc:
        log.warning("kernel configs %s: cannot be read (%s); using defaults", source,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        data = None
    table = parse_kernel_configs(data, source) if data is not None else {}
    set_kernel_configs(table)
    if data is not None:
        _STATE["source"] = source
    return kernel_configs()


def _load_from_env() -> None:
    _STATE["env_read"] = True
    path = os.environ.get(ENV)
    if path:
        load_kernel_configs(path)


def dump_kernel_configs(table: dict[str, dict[int, dict[str, Any]]],
                        meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of `table` (buckets ascending, keys sorted) with `meta` fields."""
    doc: dict[str, Any] = {"format": FORMAT, **(meta or {})}
    doc["kernels"] = {name: {str(b): dict(sorted(table[name][b].items()))
                             for b in sorted(table[name])} for name in sorted(table)}
    return doc


def save_kernel_configs(path: str | os.PathLike, table: dict[str, dict[int, dict[str, Any]]],
                        meta: dict[str, Any] | None = None) -> Path:
    """Write `table` (validated first: ValueError naming the bad entry) as JSON to `path`."""
    for name, buckets in table.items():
        for bucket, cfg in buckets.items():
            why = check_config(name, cfg)
            if why or isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
                raise ValueError(f"table: entry {name!r} bucket {bucket!r}: {why or 'bad bucket'}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dump_kernel_configs(table, meta), indent=1) + "\n")
    return out
