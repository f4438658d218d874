"""The simulator's settings: execution mode, scheduler knobs and the background decode batch."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from spaceserve.runtime.modes import (
    ADMISSIONS,
    MODES,
    OBJECTIVES,
    PLACEMENTS,
    SIS_ACTIONS,
    TEMPORAL_MODES,
)
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.scheduling import (
    SchedulingPolicy,
    decode_bound_s,
    scheduling_policy,
)
from spaceserve.runtime.policy.slo import Slo

# Host seconds the simulator charges (flags --host-ms, --sis-host-ms). One engine step: the
# host-time goal of a 64-sequence step (bench/serving/engine_step.py: scheduling, planning, the
# sampler's bookkeeping), of which `Scheduler.schedule` + `update` measure 0.06-0.08 ms at 64-128
# sequences on the CI CPU (bench/sim/host_time.py). SIS: `decide` at saturation, once per
# decode step: medians of 0.07-0.08 ms with 32 pending encoder jobs and 0.11-0.13 ms with 64 on
# the CI CPU (bench/sim/bench_sis.py, thread time), so 0.1 ms.
HOST_S = 0.0003
SIS_HOST_S = 0.0001


@dataclass(frozen=True)
class SimConfig:
    """How one GPU runs: mode, scheduler knobs and the background decode batch."""

    mode: str = "spatial"
    static_encoder_sms: int = 64
    allowed_encoder_sms: tuple[int, ...] | None = None  # default: `policy.choose_splits`
    encoder_policy: str | None = None  # default: fifo for temporal, twsrft otherwise
    window_s: float | None = None  # encoder window; default: temporal-chunked's from the SLO
    # (`chunked_window_s`), TWSRFT's grant 20 ms elsewhere (temporal: whole jobs)
    max_wait_s: float = 0.5
    token_budget: int = 16384
    tpot_factor: float = 1.15  # the tpot objective's target (x unloaded decode step)
    sis_objective: str = "goodput"  # or "tpot": the paper-like TPOT-first baseline
    sis_actions: str = "share"  # SIS: "share" (pure sharing) or "superset" (+ whole-GPU windows)
    slo: Slo | None = None  # what the goodput objective and TWSRFT's deadline aim at
    comfort_factor: float = 2.5  # goodput objective: calm decode step (x unloaded)
    decode_margin: float = 0.8  # goodput objective: decode step within this x its SLO
    launch_budget_s: float = 0.003  # the engine's cooperative encoder driver, per decode step
    layer_launch_s: float = 0.00024  # host time to launch one vision layer (0: unbounded)
    min_gain: float = 0.1
    min_dwell_s: float = 0.05
    prefill_on: str = "auto"  # auto: SIS (spatial), else compute; temporal modes: decode steps
    chunk_tokens: int = 512  # co-located modes: one request's prefill chunk per decode step
    # the time-multiplexed modes run the engine's scheduler (stepped.py) with its settings
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 128  # sequences in one engine step
    kv_blocks: int = 65536  # KV blocks (x block_size tokens; preemption by recompute)
    block_size: int = 16
    max_held: int = 64  # requests holding or computing image embeddings
    max_encoder_tokens: int = 16384  # temporal: media tokens encoded per step (per rank)
    host_s: float = HOST_S  # host time of one engine step (scheduling, planning, sampling)
    sis_host_s: float = SIS_HOST_S  # spatial: host time of SIS's decisions per decode step
    # the engine pipelines its time-multiplexed steps (async scheduling): a step's host work
    # runs while the previous step computes, so a step lasts max(device, host); False: both
    async_scheduling: bool = True
    background: int = 32  # requests kept decoding (replaced as they finish)
    background_context: int = 1024  # their prompt length
    background_output: int = 256  # their output length
    context_bucket: int = 64  # SIS sees the decode context rounded to this
    shared_decode_share: float = 0.5  # shared mode: decode's share of SM throughput when both run
    admission: str = "queue"  # or "slo": the engine's SLO-aware admission (sim/admission.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill_on not in PLACEMENTS:
            raise ValueError(f"prefill_on must be one of {PLACEMENTS}, got {self.prefill_on!r}")
        if self.background < 0 or self.background_context < 0 or self.background_output < 2:
            raise ValueError("background, background_context must be >= 0; "
                             "background_output >= 2")
        if self.chunk_tokens < 1 or self.context_bucket < 1:
            raise ValueError("chunk_tokens and context_bucket must be >= 1")
        if not 0 < self.shared_decode_share < 1:
            raise ValueError(f"shared_decode_share must be in (0, 1), got "
                             f"{self.shared_decode_share}")
        if self.sis_objective not in OBJECTIVES:
            raise ValueError(f"sis_objective must be one of {OBJECTIVES}, got "
                             f"{self.sis_objective!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.sis_actions not in SIS_ACTIONS:
            raise ValueError(f"sis_actions must be one of {SIS_ACTIONS}, got "
                             f"{self.sis_actions!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_blocks", "block_size",
                     "max_held", "max_encoder_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not (self.host_s >= 0 and self.sis_host_s >= 0):
            raise ValueError(f"host_s and sis_host_s must be >= 0, got {self.host_s}, "
                             f"{self.sis_host_s}")
        if self.mode in TEMPORAL_MODES and self.prefill_on == "compute":
            raise ValueError(f"prefill_on='compute' is not a {self.mode} schedule: the engine's "
                             "time-multiplexed modes prefill in chunks inside the decode steps "
                             "(use 'auto' or 'decode')")
        if self.mode == "temporal" and self.encoder_policy not in (None, "fifo"):
            raise ValueError("temporal encodes whole passes oldest first (the engine's temporal "
                             "stage); TWSRFT order is temporal-chunked's (a long window runs "
                             "whole passes)")
        if self.window_s is not None and not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")


def default_allowed(total_sms: int, step: int = 8) -> tuple[int, ...]:
    """Encoder SM counts a Hopper green-context partition offers (multiples of 8)."""
    return tuple(range(step, total_sms - step + 1, step))


def sim_policy(curves: CurveSet, c: SimConfig) -> SchedulingPolicy:
    """The scheduling policy a simulated GPU runs: what `epd.build_spatial` builds for an engine
    with the same curves, SLO and knobs, at the background batch as the reference decode load."""
    return scheduling_policy(
        curves, c.slo, objective=c.sis_objective, splits=c.allowed_encoder_sms,
        batch=c.background, context=c.background_context + c.background_output / 2,
        decode_margin=c.decode_margin, comfort_factor=c.comfort_factor,
        tpot_factor=c.tpot_factor, window_s=c.window_s or 0.02, max_wait_s=c.max_wait_s,
        token_budget=c.token_budget, launch_budget_s=c.launch_budget_s,
        layer_launch_s=c.layer_launch_s)


DEFAULT_WINDOW_S = 0.02  # TWSRFT's grant (and temporal-chunked's window without a decode bound)
MIN_WINDOW_S = 0.001


def chunked_window_s(curves: CurveSet, c: SimConfig, budget: int | None = None) -> float:
    """temporal-chunked's default encoder window: the largest whose engine step still fits the
    SLO's decode bound (the tighter of TPOT and ITL) with the decode margin - ``decode_margin``
    x bound - (a step carrying a full prefill chunk of `budget` tokens, default
    ``max_num_batched_tokens``, beside the background batch, plus the host time); at least
    1 ms (a step then runs at least one layer), 20 ms without a decode bound."""
    bound = decode_bound_s(c.slo) if c.slo is not None else None
    if bound is None:
        return DEFAULT_WINDOW_S
    budget = budget or c.max_num_batched_tokens
    batch = min(c.background, c.max_num_seqs)
    ctx = c.background_context + c.background_output / 2
    step = curves.mixed_step(batch, ctx, max(0, budget - batch), c.background_context,
                             curves.num_sms) + c.host_s
    return max(MIN_WINDOW_S, c.decode_margin * bound - step)


def engine_objects() -> SimpleNamespace:
    """The engine's scheduler objects the simulator's step loops run (stepped.py,
    spatial_loop.py): imported on first use, as they pull in torch, which `spaceserve sim
    --help` must not; handed to the loops so they stay shallow in the import graph."""
    from spaceserve.runtime.core.block_manager import BlockManager
    from spaceserve.runtime.core.request import Request, Status
    from spaceserve.runtime.core.sampling_params import SamplingParams
    from spaceserve.runtime.core.scheduler import Scheduler
    from spaceserve.runtime.spatial.batch_split import split_batch, turn_budget

    return SimpleNamespace(BlockManager=BlockManager, Request=Request, Status=Status,
                           SamplingParams=SamplingParams, Scheduler=Scheduler,
                           split_batch=split_batch, turn_budget=turn_budget)
