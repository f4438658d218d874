"""The tensor-parallel protocol: everything rank 0 and its workers say to each other.

Rank 0 runs the engine (scheduler, encoder stage, sampler) and one shard of the model; each
worker runs another shard and does exactly what rank 0 tells it, in order. Commands travel
over one pipe per worker, pickled once and written to every pipe (a broadcast that never
times out while the engine is idle, and whose end-of-file tells a worker its rank 0 is gone);
the tensors of a step move only through the collectives inside the model.

Per engine step rank 0 sends a `Step`: the planner's `StepInputs` (rows, token counts, token
ids, need-logits flags, graph padding, and the block ids / rope state the step's rows took
since the last step), the stage and SM budget it runs under, the graph size it replays, and its
image pieces as (embeddings key, first row, end row). A decode step of B sequences is a few
arrays of B integers plus the new block ids: kilobytes. Rank 0 samples from the gathered
logits alone, so nothing about sampling crosses the pipe, and no reply is awaited. In a
pipelined step (``EngineConfig.async_scheduling``) the inputs of decodes whose previous token is
still on rank 0's device are listed in ``StepInputs.pending``; rank 0 broadcasts them over the
stage's group inside the step (`GroupComm.broadcast`), so no rank waits for a read-back.

The vision tower runs data-parallel (``mm_encoder_tp_mode="data"``, the default): rank 0
assigns each encoder job (a request's media items its encoder cache lacks) to one rank, the
*owner*, and sends that rank alone its pixels and its encoder commands, each numbered (`seq`). A
worker writes the number of the last one it finished (on a GPU: once the device has) into a
shared progress counter, so rank 0 knows without a message when an owner is done
(`group.RemoteEvent`); a worker whose encoding fails first puts ``(key, message)`` on the
group's notice queue. Rank 0 then sends `Share`: every rank takes part in a broadcast from the
owner, on its decoder stream, and keeps the embeddings under the key rank 0 gave the job. With
``mm_encoder_tp_mode="replicate"`` every rank runs every encoder command on the same pixels
instead (no `seq`, no `Share`). Encoder commands carry no collectives, so their order relative
to steps matters only in that a step comes after the `Share` (or, replicated, the
`FinishEncode`) of the embeddings it uses - which the pipe's order guarantees.
Either way a finished job's output is then split into one set of rows per media item (`Split`),
kept under the key of rank 0's encoder-cache entry for that item until a `Release` of it: a
cache hit on rank 0 is a hit on every rank, and needs no encoder command anywhere.

Every command that launches work carries its SM budget, as rank 0 got it: a `Step` the
(encoder, decoder) budgets of the partition its batch runs on (`ScheduledBatch.partition`) and
the budget of its stage, `Capture` the partition it captures for, an encoder command the
encoder's `num_sms` and `Share` the decoder's. A worker runs the command under the same budget
and, in the co-located modes, on the streams of its own partition with those budgets
(`PartitionSpec` builds the same partition set on every rank): the one of the step's budgets,
or for a command with one stage's budget the current partition when its budget matches, else
the one partition whose stage has that budget.

Worker -> rank 0 messages are tuples: ``("hello", rank, pid)`` once imported,
``("ready", rank)`` once its shard is loaded, ``("reply", value)`` for the commands that
return something (`Profile`, `Capture`, `Stats`), and ``("error", rank, text)`` just before a worker
exits on an exception.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.core.batch import Budgets


@dataclass(frozen=True)
class ModelSource:
    """What every rank builds its shard from: a checkpoint directory (`path`), or random
    weights of a config (`config`, a dict, and `seed`)."""

    path: str | None = None
    config: dict[str, Any] | None = None
    seed: int = 0
    attention_backend: str = "triton"
    dtype: str | None = None
    device: str = "cpu"  # "cpu" or "cuda" (rank r takes cuda:r)


@dataclass(frozen=True)
class PartitionSpec:
    """How the co-located modes build their SM partitions (`split_set.make_partitions`, as
    `epd.build_spatial` does on rank 0). In ``spatial``, `encoder_splits` is the split set rank
    0 chose from the curves and the SLO before the workers started (`split_set.chosen_splits`),
    or the config's own; rank 0's engine refuses to start on a set that differs from it."""

    mode: str
    encoder_sms: int | None
    encoder_splits: tuple[int, ...] | None
    green_contexts: bool
    programs_per_sm: int


@dataclass(frozen=True)
class GroupSpec:
    """The group every worker joins: its size, the rendezvous file, the collective timeout,
    the stages with a communicator, the partitions (co-located modes), intra-op threads on
    CPU, and environment variables set before anything is imported (e.g. NCCL's)."""

    size: int
    rendezvous: str
    timeout_s: float
    stages: tuple[str, ...] = ("decoder",)
    partitions: PartitionSpec | None = None
    num_threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    progress: Any = None  # shared int64 per rank: the last encoder command seq it finished
    notices: Any = None  # queue of (rank, key, message): encodings that failed on their owner


# -- commands (rank 0 -> workers) -------------------------------------------------------------

@dataclass
class Profile:
    """`ModelRunner.profile_peak_bytes`; replies (peak bytes, free device bytes)."""

    limits: Any
    max_encoder_tokens: int


@dataclass
class Allocate:
    num_blocks: int
    limits: Any


@dataclass
class Capture:
    """Capture decode graphs for these batch sizes under the decoder budget of the partition
    `budgets`; replies the sizes."""

    sizes: tuple[int, ...]
    budgets: Budgets


@dataclass
class Encode:
    """Encode requests' images whole (`ModelRunner.encode`), one key per request. `seq` is set
    on a data-parallel owner's command (module docstring), None when replicated."""

    keys: list[int]
    images: list[tuple[Any, Any]]  # (pixel_values, image_grid_thw) per key
    num_sms: int | None
    seq: int | None = None


@dataclass
class StartEncode:
    key: int
    pixel_values: Any
    image_grid_thw: Any
    seq: int | None = None


@dataclass
class AdvanceEncode:
    key: int
    layers: int
    num_sms: int | None
    seq: int | None = None


@dataclass
class FinishEncode:
    key: int
    num_sms: int | None
    seq: int | None = None


@dataclass
class Share:
    """Broadcast finished embeddings from their owners, in order, on the decoder stream: every
    rank takes part in each under the decoder's budget `num_sms`; `items` are (key, owner rank,
    image tokens)."""

    items: list[tuple[int, int, int]]
    num_sms: int | None


@dataclass
class Embeds:
    """Embeddings rank 0 did not encode (given with the request): kept under `key`."""

    key: int
    embeds: Any


@dataclass
class Release:
    keys: list[int]


@dataclass
class Split:
    """Rows ``lo..hi-1`` of the embeddings under `key` (a finished job) are kept under each
    part's own key (an encoder-cache entry); `key` itself is dropped."""

    key: int
    parts: list[tuple[int, int, int]]  # (entry key, lo, hi)


@dataclass
class Step:
    """One engine step (module docstring): `budget` is its stage's of the partition `budgets`;
    `pieces` are (key or None, lo, hi)."""

    stage: str
    budget: int | None
    graph: int | None
    inputs: Any  # runtime.step_plan.StepInputs without its device-side image pieces
    pieces: list[tuple[int | None, int, int]]
    budgets: Budgets


@dataclass
class Stats:
    """Diagnostics; replies {"steps", "embeds", "jobs", "encoded", "launches", "splits"}:
    steps run, embeddings and encoder jobs held, images this rank encoded, the launches
    (`LaunchRecord`s, collectives included) recorded since the last `Stats`, and the encoder
    splits of this rank's partition set (None in the temporal modes). `record` True starts
    recording launches, False stops, None leaves it as is."""

    record: bool | None = None


@dataclass
class Stop:
    pass


COMMANDS = (Profile, Allocate, Capture, Encode, StartEncode, AdvanceEncode, FinishEncode,
            Share, Embeds, Release, Split, Step, Stats, Stop)
REPLIES = (Profile, Capture, Stats)  # the commands a worker answers


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)
