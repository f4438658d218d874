"""Engine settings: `EngineConfig`, the engine modes and the attention backends.

Every field is validated when the config is built (ValueError names the field), so a bad flag
fails before any model is loaded. The co-located modes' fields are checked by `epd.check_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spaceserve.runtime.core.memory import GRAPH_RESERVE_BYTES
from spaceserve.runtime.modes import DRIVERS, MODES, OBJECTIVES, PLACEMENTS
from spaceserve.runtime.policy.slo import DEFAULT_SLO, Slo

ATTENTION_BACKENDS = ("triton", "torch")
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; every field is validated (ValueError names it).

    `num_kv_blocks` None sizes the cache from free device memory (CPU: a default count).
    `max_model_len` None takes the model's context. `graph_batch_sizes` None: the default
    buckets up to `max_num_seqs` (a runner without graphs ignores them). Decode graphs are
    captured per batch size and per block-table width: `graph_context_lens` (tokens) names the
    widths, None a doubling ladder from 256 tokens to `max_model_len`; a decode step replays
    the narrowest graph that covers its longest sequence (longer ones run eagerly). All decode
    graphs share one memory pool, bounded by `graph_reserve_bytes` (the memory the KV cache
    leaves them), checked as each graph is captured.

    Co-located modes (``shared``, ``spatial-static``, ``spatial``; see `epd.py`):
    `encoder_sms` is the static split (None: about half the device, a multiple of 8);
    `encoder_splits` the splits partitions are made for in ``spatial`` (None: chosen at start-up
    from the curves and `slo`, the same on every tensor-parallel rank; `split_set.py`); `curves`
    a resource-utility curves JSON for SIS and TWSRFT (None: the analytic model, of one rank at
    tensor_parallel_size > 1); `prefill_on` "auto" (SIS in ``spatial``, else the compute
    partition), "compute" or "decode"; `encoder_driver` "cooperative" or "thread" (the
    cooperative one launches encoder layers for `encoder_launch_budget_s` of host time per step,
    while the decode step runs, at least one layer per step; `encoder_window_s` is TWSRFT's
    grant window, and ``temporal-chunked``'s encoder chunk between decode steps, see
    `encoder_chunked.py`); `green_contexts` False forces kernel budgets alone; `programs_per_sm`
    applies inside green partitions only.
    `slo`: the latency SLO requests are judged by and ``spatial``'s SIS aims at (`slo.py`; an
    `Slo` or its text such as ``"ttft:2000,tpot:50"``, the default); `sis_objective` "goodput"
    or "tpot" (`sis.py`); `sis_load` the decode (batch, mean context) the split set is chosen
    for when `encoder_splits` is None (`policy.py`, the simulator's background batch).

    `async_scheduling` pipelines the temporal modes' steps: step n+1 is scheduled and launched
    before step n's tokens are read back (see `engine.py`); False runs every step to completion.
    `tensor_parallel_size` N > 1 splits the decoder over N ranks (one process each, rank 0 in
    the engine's; see `runtime/tp`); the runner must be a tensor-parallel one of that size
    (`Engine.from_pretrained` builds it). `mm_encoder_tp_mode` says how its ranks share the
    vision encoder, with vLLM's name: "data" (each rank encodes a share of the images, which
    are then broadcast) or "replicate" (every rank encodes every image); vLLM's "weights" (the
    ViT's layers split over the ranks) is not implemented and refused (the README's simulator
    comparison says where it would pay).
    `collective_sms` bounds a collective's thread blocks (NCCL_MAX_CTAS; None: 16, or the
    smallest partition when smaller).

    `encoder_cache_bytes` is the encoder output cache's budget (None: sized from free device
    memory, a fixed default on CPU; see `encoder_cache.default_capacity`; 0 turns it off);
    `enable_prefix_caching` shares computed KV blocks between requests with a common prefix.
    """

    mode: str = "temporal"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_images_per_prompt: int = 8
    max_encoder_tokens_per_step: int = 16384
    max_held_embeddings: int = 64
    gpu_memory_utilization: float = 0.9
    graph_reserve_bytes: int = GRAPH_RESERVE_BYTES
    graph_batch_sizes: tuple[int, ...] | None = None
    graph_context_lens: tuple[int, ...] | None = None
    seed: int = 0
    encoder_sms: int | None = None
    encoder_splits: tuple[int, ...] | None = None
    curves: str | None = None
    prefill_on: str = "auto"
    encoder_driver: str = "cooperative"
    encoder_window_s: float = 0.02
    encoder_launch_budget_s: float = 0.003
    green_contexts: bool = True
    programs_per_sm: int = 1
    async_scheduling: bool = True
    tensor_parallel_size: int = 1
    mm_encoder_tp_mode: str = "data"
    collective_sms: int | None = None
    encoder_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    slo: Slo | str = DEFAULT_SLO
    sis_objective: str = "goodput"
    sis_actions: str = "superset"  # SIS: "share", or "superset" (+ whole-GPU encoder windows)
    sis_load: tuple[int, int] = (32, 1152)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not available; modes: {', '.join(MODES)}")
        try:
            object.__setattr__(self, "slo", Slo.of(self.slo))
        except ValueError as exc:
            raise ValueError(f"slo={self.slo!r}: {exc}") from None
        check_config(self)  # the co-located modes' settings
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_images_per_prompt", "max_encoder_tokens_per_step",
                     "max_held_embeddings", "num_kv_blocks", "max_model_len",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name in ("num_kv_blocks", "max_model_len"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be a bool")
        if self.mm_encoder_tp_mode == "weights":
            raise ValueError("mm_encoder_tp_mode='weights' (the vision encoder's layers split "
                             "over the ranks) is not implemented; use 'data' (each rank "
                             "encodes whole images) or 'replicate'")
        if self.mm_encoder_tp_mode not in ("data", "replicate"):
            raise ValueError(f"mm_encoder_tp_mode={self.mm_encoder_tp_mode!r} is not one of "
                             "data, replicate")
        if self.collective_sms is not None and (isinstance(self.collective_sms, bool) or not
                                                isinstance(self.collective_sms, int) or
                                                self.collective_sms < 1):
            raise ValueError(f"collective_sms={self.collective_sms!r} must be an int >= 1")
        cache = self.encoder_cache_bytes
        if cache is not None and (isinstance(cache, bool) or not isinstance(cache, int)
                                  or cache < 0):
            raise ValueError(f"encoder_cache_bytes={cache!r} must be an int >= 0 or None")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a "
                             "bool")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                             "(0, 1]")
        if self.graph_batch_sizes is not None and any(
                not isinstance(s, int) or s < 1 for s in self.graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes={self.graph_batch_sizes!r} must be ints >= 1")
        lens = self.graph_context_lens
        if lens is not None and (not lens or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens)):
            raise ValueError(f"graph_context_lens={lens!r} must be a non-empty tuple of ints "
                             ">= 1 (tokens)")
        if isinstance(self.graph_reserve_bytes, bool) or not isinstance(
                self.graph_reserve_bytes, int) or self.graph_reserve_bytes < 0:
            raise ValueError(f"graph_reserve_bytes={self.graph_reserve_bytes!r} must be an "
                             "int >= 0")


def check_config(cfg: Any) -> None:
    """Validate an `EngineConfig`'s co-located-mode settings; ValueError names the field."""
    for name, allowed in (("prefill_on", PLACEMENTS), ("encoder_driver", DRIVERS)):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name}={getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    for name in ("encoder_sms", "programs_per_sm"):
        value = getattr(cfg, name)
        if value is None and name == "encoder_sms":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    splits = cfg.encoder_splits
    if splits is not None and (not splits or any(
            isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in splits)):
        raise ValueError(f"encoder_splits={splits!r} must be ints >= 1")
    if cfg.curves is not None and not isinstance(cfg.curves, str):
        raise ValueError(f"curves={cfg.curves!r} must be a path (str) or None")
    if cfg.sis_objective not in OBJECTIVES:
        raise ValueError(f"sis_objective={cfg.sis_objective!r} is not one of "
                         f"{', '.join(OBJECTIVES)}")
    load = cfg.sis_load
    if not isinstance(load, tuple) or len(load) != 2 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in load):
        raise ValueError(f"sis_load={load!r} must be (batch, context), ints >= 1")
    for name, zero_ok in (("encoder_window_s", False), ("encoder_launch_budget_s", True)):
        value = getattr(cfg, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (value >= 0 if zero_ok else value > 0):
            raise ValueError(f"{name}={value!r} must be a number {'>=' if zero_ok else '>'} 0")
