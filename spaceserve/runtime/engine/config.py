"""Engine settings: `EngineConfig`, the engine modes and the attention backends.

Every field is declared once, with its default, its documentation and (where a command line
sets it) its flag (`setting.setting`; `args.py` builds the flags and reads them back). Every
field is validated when the config is built (ValueError names the field), so a bad flag fails
before any model is loaded; `check_config` checks the co-located modes' fields. A leaf: nothing
here imports torch or runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spaceserve.runtime.core.memory import GRAPH_RESERVE_BYTES
from spaceserve.runtime.engine.setting import Flag, ms_to_s, parse_ints, s_to_ms, setting
from spaceserve.runtime.modes import (
    ADMISSIONS,
    DRIVERS,
    ENCODER_POLICIES,
    MODES,
    OBJECTIVES,
    PLACEMENTS,
    SIS_ACTIONS,
)
from spaceserve.runtime.policy.slo import DEFAULT_SLO, DEFAULT_SLO_TEXT, Slo

ATTENTION_BACKENDS = ("triton", "torch")
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# --green-contexts auto|on|off -> the field's value (True and False keep their meaning)
GREEN_CONTEXTS = {"auto": True, "on": "on", "off": False}


def default_attention_backend(mode: str, device_type: str) -> str:
    """The attention backend an engine gets when none is asked for: the Triton kernels on CUDA,
    except in ``shared`` mode (stock torch kernels, co-located without partitions as under
    MPS); torch ops on CPU (the Triton interpreter is far too slow to serve)."""
    return "triton" if device_type == "cuda" and mode != "shared" else "torch"


def _green_text(value: Any) -> str:
    return {True: "auto", False: "off"}.get(value, value) if isinstance(value, bool) \
        else str(value)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; each field's documentation is its `setting` text below (also the
    help of its ``spaceserve serve`` flag). ValueError names a bad field."""

    mode: str = setting(
        "temporal", "engine mode: temporal, temporal-chunked (the encoder in chunks between "
        "decode steps), spatial (SM partitions chosen per step by SIS), spatial-static (one "
        "fixed split, --encoder-sms), shared (both stages on the whole device)",
        Flag(("--mode",)))
    block_size: int = setting(16, "tokens per KV cache block")
    num_kv_blocks: int | None = setting(
        None, "KV cache blocks (default: sized from free device memory; on CPU a default "
        "count)", Flag(("--num-kv-blocks",), type=int))
    max_num_seqs: int = setting(128, "requests in the running batch at most",
                                Flag(("--max-num-seqs",), type=int))
    max_num_batched_tokens: int = setting(
        2048, "tokens per engine step at most (chunked prefill)",
        Flag(("--max-num-batched-tokens",), type=int))
    max_model_len: int | None = setting(
        None, "context length (default: the model's, capped by the KV cache)",
        Flag(("--max-model-len",), type=int))
    max_images_per_prompt: int = setting(8, "images (and videos) one prompt may carry")
    max_encoder_tokens_per_step: int = setting(
        16384, "vision tokens the encoder stage takes on per step at most")
    max_held_embeddings: int = setting(
        64, "encoded images held for prefill at most (the encoder waits beyond; under a TTFT "
        "SLO the waiting requests that can still meet it go first)")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of device memory the engine may use (weights, KV cache, graphs)")
    graph_reserve_bytes: int = setting(
        GRAPH_RESERVE_BYTES, "memory the KV cache leaves the decode graphs' shared pool, "
        "checked as each graph is captured")
    graph_batch_sizes: tuple[int, ...] | None = setting(
        None, "batch sizes decode graphs are captured for (default: the buckets up to "
        "max_num_seqs; a runner without graphs ignores them)")
    graph_context_lens: tuple[int, ...] | None = setting(
        None, "block-table widths (tokens) decode graphs are captured for, one graph per batch "
        "size and width; a decode step replays the narrowest graph covering its longest "
        "sequence, longer ones run eagerly (default: doubling from 256 tokens to "
        "max_model_len)")
    seed: int = setting(0, "engine seed for requests that bring none",
                        Flag(("--seed",), type=int))
    encoder_sms: int | None = setting(
        None, "spatial-static: the encoder's SMs, the static split; the decoder gets the rest "
        "(default: about half the device, a multiple of 8)",
        Flag(("--encoder-sms",), type=int, metavar="SMS"))
    encoder_splits: tuple[int, ...] | None = setting(
        None, "spatial: the candidate encoder splits (SMs) partitions are made for, e.g. "
        "32,64,96 (default: chosen at start-up from the curves and the SLO, the same on every "
        "tensor-parallel rank)",
        Flag(("--encoder-splits",), type=parse_ints, metavar="SMS,SMS,..."))
    curves: str | None = setting(
        None, "a resource-utility curves JSON (written by `spaceserve profile`) for SIS and "
        "TWSRFT; a malformed file is refused at start (default: the analytic model of the "
        "checkpoint, of one rank at tensor-parallel size > 1)",
        Flag(("--curves",), metavar="FILE"))
    prefill_on: str = setting(
        "auto", "co-located modes: the partition prefill runs on: auto (SIS decides in "
        "spatial, else the compute partition), compute or decode")
    encoder_driver: str = setting(
        "cooperative", "co-located modes: cooperative (encoder layers launched for "
        "encoder_launch_budget_s of host time per step while the decode step runs, at least "
        "one layer per step) or thread")
    encoder_window_s: float = setting(
        0.02, "encoder time window (ms on the command line): temporal-chunked's encoder chunk "
        "between decode steps, TWSRFT's grant in the co-located modes",
        Flag(("--encoder-window-ms",), type=float, to_field=ms_to_s, from_field=s_to_ms))
    encoder_policy: str = setting(
        "twsrft", "temporal-chunked's encoder order: twsrft (time-weighted shortest remaining "
        "first, with the SLO's deadline) or fifo (arrival order; the simulator's best-temporal "
        "often picks it)", Flag(("--encoder-policy",), choices=ENCODER_POLICIES))
    encoder_launch_budget_s: float = setting(
        0.003, "the cooperative driver's host time for encoder launches per step")
    green_contexts: bool | str = setting(
        True, "SM partitions as CUDA green contexts: auto (True) uses them where the driver "
        "has them, else kernel budgets alone; on requires them (refused at start without); "
        "off (False) uses kernel budgets alone",
        Flag(("--green-contexts",), choices=tuple(GREEN_CONTEXTS), from_field=_green_text))
    programs_per_sm: int = setting(
        1, "thread blocks per SM of the kernels' grids, inside green partitions only")
    async_scheduling: bool = setting(
        True, "pipeline the temporal modes' steps, and the co-located modes' decode steps while "
        "SIS takes turns on the whole GPU: step n+1 is scheduled and launched before step n's "
        "tokens are read back; False runs every step to completion")
    tensor_parallel_size: int = setting(
        1, "ranks the decoder is split over (one process and GPU each; rank 0 in the engine's)",
        Flag(("--tensor-parallel-size", "-tp"), type=int))
    mm_encoder_tp_mode: str = setting(
        "data", "with tensor-parallel size > 1: each rank encodes a share of the images, then "
        "broadcast (data), or every rank encodes every image (replicate); vLLM's 'weights' is "
        "not implemented and refused",
        Flag(("--mm-encoder-tp-mode",), choices=("data", "replicate")))
    collective_sms: int | None = setting(
        None, "thread blocks of a collective at most, NCCL_MAX_CTAS (default: 16, or the "
        "smallest partition when smaller)")
    encoder_cache_bytes: int | None = setting(
        None, "encoder output cache budget in bytes; 0 turns it off (default: 5% of free GPU "
        "memory, at most 8 GiB; 512 MiB on CPU)", Flag(("--encoder-cache-bytes",), type=int))
    enable_prefix_caching: bool = setting(
        True, "share computed KV blocks between requests with a common prefix (automatic "
        "prefix caching)", Flag(("--no-prefix-caching",), negate=True,
                                help="turn automatic prefix caching of KV blocks off"))
    fair_share: bool = setting(
        True, "while requests wait, no request (or user: the server's --fair-share-key) keeps "
        "more than its max-min fair share of the sequence slots and KV blocks; sequences over "
        "it are preempted (recompute) so a newcomer is admitted. A lone request loses nothing",
        Flag(("--no-fair-share",), negate=True, help="first-come first-served batch and KV "
             "cache (vLLM's behaviour): one request may hold them all while others wait"))
    slo: Slo | str = setting(
        DEFAULT_SLO, "latency SLO in ms requests are judged by (goodput; the server's "
        "request_slo_total) and spatial's SIS aims at: any of ttft, tpot, itl (p99 per "
        f"request), e2el (default {DEFAULT_SLO_TEXT})", Flag(("--slo",), from_field=str))
    sis_objective: str = setting(
        "goodput", "SIS maximises predicted goodput, or protects TPOT at any TTFT cost (tpot: "
        "the paper-like baseline)", Flag(("--sis-objective",), choices=OBJECTIVES))
    sis_actions: str = setting(
        "share", "SIS's actions: share (pure sharing), or superset (sharing, and taking turns "
        "on the whole GPU - temporal-chunked's encoder windows and prefill budget from the "
        "SLO - while the image arrivals outgrow what sharing sustains, with hysteresis)",
        Flag(("--sis-actions",), choices=SIS_ACTIONS))
    admission: str = setting(
        "queue", "what happens to a request predicted to miss its TTFT bound: queue (admit "
        "everything, as vLLM does) or slo (refuse it at once with 503 and a Retry-After from "
        "the predicted drain, and end a waiting request once it can no longer meet the bound; "
        "the prediction reads the scheduling policy's queues)",
        Flag(("--admission",), choices=ADMISSIONS))
    sis_load: tuple[int, int] = setting(
        (32, 1152), "the decode (batch, mean context) the split set is chosen for when "
        "encoder_splits is None (the simulator's background batch)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not available; modes: {', '.join(MODES)}")
        try:
            object.__setattr__(self, "slo", Slo.of(self.slo))
        except ValueError as exc:
            raise ValueError(f"slo={self.slo!r}: {exc}") from None
        green = self.green_contexts
        if isinstance(green, str) and green in GREEN_CONTEXTS:
            object.__setattr__(self, "green_contexts", GREEN_CONTEXTS[green])
        elif not isinstance(green, bool):
            raise ValueError(f"green_contexts={green!r} is not one of auto, on, off (or True, "
                             "False)")
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
        if not isinstance(self.fair_share, bool):
            raise ValueError(f"fair_share={self.fair_share!r} must be a bool")
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


    @property
    def green_contexts_mode(self) -> str:
        """`green_contexts` as the flag names it: auto, on or off."""
        return _green_text(self.green_contexts)

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
    if cfg.encoder_policy not in ENCODER_POLICIES:
        raise ValueError(f"encoder_policy={cfg.encoder_policy!r} is not one of "
                         f"{', '.join(ENCODER_POLICIES)}")
    if cfg.sis_actions not in SIS_ACTIONS:
        raise ValueError(f"sis_actions={cfg.sis_actions!r} is not one of {', '.join(SIS_ACTIONS)}")
    if cfg.admission not in ADMISSIONS:
        raise ValueError(f"admission={cfg.admission!r} is not one of {', '.join(ADMISSIONS)}")
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
