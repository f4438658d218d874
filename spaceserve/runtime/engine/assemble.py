"""Engine assembly: the one path from settings and a runner maker to a running engine.

`assemble_engine` is used by every place that builds an engine (`Engine.from_pretrained`, the
server's `load_engine`, the benchmark's random-weight models; each passes the engine class, so
this module imports no engine): it resolves the device, picks the attention backend by the one
rule (`config.default_attention_backend`), refuses ``green_contexts="on"`` where the driver
has no green contexts, makes the runner, and builds the engine, closing the runner (a
tensor-parallel group's workers) if that fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.engine.config import (
    ATTENTION_BACKENDS,
    EngineConfig,
    default_attention_backend,
)
from spaceserve.runtime.modes import COLOCATED_MODES

if TYPE_CHECKING:
    import torch


def resolve_device(device: Any = None) -> torch.device:
    """`device` as a torch device; None: CUDA when present, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def attention_backend_for(mode: str, device: torch.device, requested: str | None = None
                          ) -> str:
    """`requested`, checked, or the default backend of `mode` on `device`."""
    backend = requested or default_attention_backend(mode, device.type)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return backend


def check_green_contexts(config: EngineConfig, device: torch.device) -> None:
    """``green_contexts="on"`` (``--green-contexts on``) in a partitioned mode requires them:
    ValueError saying why when the device or driver has none."""
    if config.green_contexts != "on" or config.mode not in COLOCATED_MODES or \
            config.mode == "shared":
        return
    from spaceserve.runtime.spatial.green_context import green_context_support

    why = green_context_support(device)
    if why is not None:
        raise ValueError(f"green_contexts='on' (--green-contexts on) but {device} has no green "
                         f"contexts: {why}; use auto (kernel budgets where they are missing) "
                         "or off")


def assemble_engine(engine_cls: Any, config: EngineConfig,
                    make_runner: Callable[[str, torch.device], Any], *,
                    attention_backend: str | None = None, device: Any = None,
                    processors: Callable[[Any], tuple[Any, Any]] | None = None) -> Any:
    """An `engine_cls` (`Engine`) of `config` on the runner ``make_runner(backend, device)``;
    `processors(runner)` gives its (tokenizer, processor). The runner is closed if anything
    after it fails."""
    dev = resolve_device(device)
    backend = attention_backend_for(config.mode, dev, attention_backend)
    check_green_contexts(config, dev)
    runner = make_runner(backend, dev)
    try:
        tokenizer, processor = processors(runner) if processors is not None else (None, None)
        engine = engine_cls(runner, config, tokenizer=tokenizer, processor=processor)
    except BaseException:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        raise
    try:
        check_green_partitions(config, engine)
    except ValueError:
        engine.close()
        raise
    return engine


def check_green_partitions(config: EngineConfig, engine: Any) -> None:
    """``green_contexts="on"``: the engine's partitions must be green contexts; ValueError with
    the reason when the driver refused them (every split fell back to kernel budgets)."""
    if config.green_contexts != "on":
        return
    pset = getattr(getattr(engine, "spatial", None), "partitions", None)
    if pset is None or getattr(pset, "shared", False) or pset.green:
        return
    raise ValueError(f"green_contexts='on' (--green-contexts on) but no split became a green "
                     f"context: {pset.reason or 'refused'}; use auto (kernel budgets where "
                     "they are missing) or off")


__all__ = ["assemble_engine", "attention_backend_for", "check_green_contexts",
           "check_green_partitions", "resolve_device"]
