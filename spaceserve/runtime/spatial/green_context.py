"""Green contexts through ``cuda.bindings``: whether the driver has them, SM splits, streams.

The driver calls behind `PartitionSet` (partition.py), kept apart so that the partitions read
as policy and these as the one place that talks to the CUDA driver: ``cuDeviceGetDevResource ->
cuDevSmResourceSplitByCount -> cuDevResourceGenerateDesc -> cuGreenCtxCreate ->
cuGreenCtxStreamCreate``. Every function imports ``cuda.bindings`` when called, so nothing here
needs it (or a GPU) at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MIN_DRIVER_VERSION = 12040  # green context streams arrived in CUDA 12.4


def green_context_support(device: torch.device | str | None = None) -> str | None:
    """Why green contexts cannot be used on `device` (None when they can)."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from cuda.bindings import driver
    except ImportError:
        return "cuda.bindings is not installed"
    if not hasattr(driver, "cuGreenCtxStreamCreate"):
        return "cuda.bindings has no green-context streams"
    torch.cuda.init()
    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuDriverGetVersion failed ({err})"
    if version < MIN_DRIVER_VERSION:
        return f"driver CUDA {version // 1000}.{version % 1000 // 10} < 12.4"
    return None


def _check(result: tuple, what: str) -> Any:
    """Unwrap a cuda.bindings (CUresult, value...) tuple; RuntimeError with the error name."""
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if len(result) == 2 else result[1:]


def sm_resource(index: int) -> tuple[Any, Any]:
    """(CUdevice, its whole SM resource) of CUDA device `index`, through cuda.bindings."""
    from cuda.bindings import driver

    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    whole = _check(driver.cuDeviceGetDevResource(
        dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    return dev, whole


def split_sm_resource(whole: Any, count: int) -> tuple[Any, Any]:
    """(a group of about `count` SMs, the remaining SMs) split off an SM resource; the driver
    may round the group (on Hopper to a multiple of 8)."""
    from cuda.bindings import driver

    groups, _, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, count),
                             "cuDevSmResourceSplitByCount")
    return groups[0], rest


def green_context_stream(dev: Any, resource: Any) -> tuple[Any, Any, int]:
    """A green context over an SM `resource` of `dev` and a non-blocking stream in it: (context,
    raw stream, SMs the context was granted). On failure nothing created is left behind; the
    caller destroys both (cuStreamDestroy, then cuGreenCtxDestroy) when done."""
    from cuda.bindings import driver

    desc = _check(driver.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
    ctx = _check(driver.cuGreenCtxCreate(
        desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
    raw = None
    try:
        raw = _check(driver.cuGreenCtxStreamCreate(
            ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate")
        granted = _check(driver.cuGreenCtxGetDevResource(
            ctx, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
            "cuGreenCtxGetDevResource").sm.smCount
    except Exception:
        if raw is not None:
            driver.cuStreamDestroy(raw)
        driver.cuGreenCtxDestroy(ctx)
        raise
    return ctx, raw, int(granted)


def destroy_handles(handles: Sequence[tuple[str, Any]]) -> None:
    """Destroy ("stream", raw stream) and ("ctx", green context) handles in reverse order of
    creation (each stream before its context); the caller synchronises the device first."""
    if not handles:
        return
    from cuda.bindings import driver

    for kind, handle in reversed(handles):
        if kind == "stream":
            driver.cuStreamDestroy(handle)
        else:
            driver.cuGreenCtxDestroy(handle)
