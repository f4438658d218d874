"""The split set of a co-located mode, chosen once at start-up from an `EngineConfig`.

The split set is the encoder SM counts SM partitions are made for (and decode CUDA graphs are
captured for, once per partition). ``spatial`` chooses it from the resource-utility curves and
the SLO (`policy.scheduling_policy`, through `engine_policy`) unless ``encoder_splits`` names
it; ``spatial-static`` has its one ``encoder_sms``; ``shared`` has none.

A tensor-parallel group builds the same set on every rank, so it is chosen before any worker
starts: `chosen_splits` reads the same curves from the model's config that the engine later
reads from rank 0's runner (`load_curves`; without a curves file, one rank's analytic curves,
those ``spaceserve sim --tp`` simulates), and the workers get the result in their
`tp.PartitionSpec` (whose fields mirror the `EngineConfig` ones `make_partitions` reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spaceserve.kernels.budget import device_num_sms
from spaceserve.runtime.modes import COLOCATED_MODES
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.model_curves import model_curves
from spaceserve.runtime.policy.scheduling import SchedulingPolicy, scheduling_policy
from spaceserve.runtime.spatial.partition import Partition, PartitionSet, default_splits


def engine_policy(curves: CurveSet, config: Any, total_sms: int) -> SchedulingPolicy:
    """The scheduling policy of an `EngineConfig` (`policy.py`): what `sim.sim_policy` builds
    for a simulated GPU with the same curves, SLO, knobs and reference decode load."""
    splits = config.encoder_splits
    if splits and not all(0 < e < total_sms for e in splits):
        raise ValueError(f"encoder_splits={tuple(splits)} must be in 1..{total_sms - 1}")
    batch, context = config.sis_load
    return scheduling_policy(
        curves, config.slo, objective=config.sis_objective, total_sms=total_sms,
        splits=config.encoder_splits, batch=batch, context=context,
        window_s=config.encoder_window_s, launch_budget_s=config.encoder_launch_budget_s)


def chosen_splits(config: Any, model_config: Any, device: torch.device | str
                  ) -> tuple[int, ...] | None:
    """The encoder splits an engine of `config` on `device` makes partitions for, before it
    exists: in ``spatial`` `engine_policy`'s (curves from ``config.curves``, else the analytic
    roofline of one rank of `model_config` at ``config.tensor_parallel_size``), otherwise
    ``config.encoder_splits`` as given."""
    if config.mode != "spatial":
        return config.encoder_splits
    curves = model_curves(config.curves, model_config, tp=config.tensor_parallel_size,
                          mm_encoder_tp_mode=config.mm_encoder_tp_mode)
    return engine_policy(curves, config, device_num_sms(torch.device(device))).splits


def encoder_split_set(config: Any, total: int, splits: Sequence[int] | None = None
                      ) -> tuple[int, ...]:
    """The encoder SM counts a co-located mode makes partitions for on a `total`-SM device
    (``shared``: none); `splits` is ``spatial``'s set when chosen elsewhere. ValueError for a
    mode that is not co-located or a split outside ``1..total - 1``."""
    mode = config.mode
    if mode not in COLOCATED_MODES:
        raise ValueError(f"mode={mode!r} is not a co-located mode ({', '.join(COLOCATED_MODES)})")
    if mode == "shared":
        return ()
    if mode == "spatial-static":
        e = config.encoder_sms
        if e is None:
            default = default_splits(total)
            e = default[len(default) // 2]
        if not 0 < e < total:
            raise ValueError(f"encoder_sms={e} must be in 1..{total - 1} (SMs of this device)")
        return (e,)
    chosen = tuple(splits or config.encoder_splits or default_splits(total))
    if not all(0 < e < total for e in chosen):
        raise ValueError(f"encoder_splits={chosen} must be in 1..{total - 1}")
    return tuple(sorted(set(chosen)))


def make_partitions(config: Any, device: torch.device, splits: Sequence[int] | None = None
                    ) -> tuple[PartitionSet, list[Partition]]:
    """The partition set of a co-located mode and the partitions it uses, from an
    `EngineConfig` (or anything with its mode, encoder_sms, encoder_splits, green_contexts and
    programs_per_sm fields: a tensor-parallel worker builds the same set on its own device).
    `splits`: ``spatial``'s split set when chosen elsewhere (`engine_policy`)."""
    chosen = encoder_split_set(config, device_num_sms(device), splits)
    green = None if config.green_contexts else False
    if config.mode == "shared":
        pset = PartitionSet(device, shared=True)
        return pset, [pset.full]
    pset = PartitionSet(device, chosen, green=green, programs_per_sm=config.programs_per_sm)
    if config.mode == "spatial-static":
        return pset, [pset.get(chosen[0])]
    return pset, pset.partitions()


def check_tp_partitions(runner: Any, pset: Any, mode: str, total: int) -> None:
    """Under tensor parallelism the other ranks built their partitions from the runner's spec:
    ValueError (after closing `pset`) unless they are rank 0's."""
    if getattr(runner, "tp_size", 1) <= 1:
        return
    spec = runner.partition_spec
    mine = (mode, tuple(sorted(pset.splits)))
    theirs = None if spec is None else (spec.mode, encoder_split_set(spec, total))
    if theirs != mine:
        pset.close()
        built = "none" if theirs is None else f"{theirs[0]} splits {theirs[1]}"
        raise ValueError(f"the tensor-parallel workers built partitions for {built}, rank 0 "
                         f"for {mine[0]} splits {mine[1]}: build the runner with "
                         "TensorParallelRunner.for_engine(config)")


__all__ = ["check_tp_partitions", "chosen_splits", "encoder_split_set", "engine_policy",
           "make_partitions"]
