"""`TensorParallelRunner`: the engine's model runner at tensor_parallel_size > 1 (rank 0).

It holds rank 0's shard in an ordinary `Qwen2VLRunner` (`local`) and the other ranks in a
`WorkerGroup`. Every runner call the engine makes is mirrored to the workers (`protocol.py`):
- calls whose device work contains collectives (a step, profiling, graph capture) are sent
  first and then run locally, so all ranks enter the collectives together; a step's host half
  (`Qwen2VLRunner.prepare_step`, which may refuse a batch) runs before anything is sent;
- encoder calls (`encoder.py`): the vision tower is whole on every rank; by default each image
  is encoded by one rank and then broadcast to all (data-parallel), or every rank encodes every
  image (replicated); either way input is validated on rank 0 before any worker sees it;
- host-only calls (`prepare_request`, `kv_block_bytes`) stay on rank 0.
Encoder jobs are known to the workers by a key per job (`MultiModalData`). When a job is done,
rank 0's encoder cache splits its output into one entry per media item and `split_encoding`
has every worker do the same (`Split`), so each item's embeddings live on every rank under a key
of their own, as long as rank 0's entry lives: `release_encoding` drops a job or an entry
(the encoder cache calls it when an entry is evicted or its last request ends). A step's image
pieces name entries by those keys; one no worker has (never encoded there) is sent once.

SM budgets: every command carries rank 0's stage budgets, so each rank's kernels run under the
same ones, and the collectives' thread blocks are bounded by `collective_sms` (NCCL_MAX_CTAS in
every rank's environment; `comm.py`), which must fit the smallest partition a collective runs in.

A worker's death, a failed send or a failed collective turns into `TensorParallelError` naming
the worker (`group.py`); from then on every call raises it, and `close` stops what is left.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from spaceserve.checks import require_choice, require_int
from spaceserve.runtime.core.batch import WHOLE_DEVICE, Budgets, ScheduledBatch
from spaceserve.runtime.core.request import Request
from spaceserve.runtime.modes import TEMPORAL_MODES
from spaceserve.runtime.tp import protocol as P
from spaceserve.runtime.tp.comm import CTAS_ENV
from spaceserve.runtime.tp.encoder import MM_ENCODER_TP_MODES, EncoderMethods
from spaceserve.runtime.tp.group import TensorParallelError, WorkerGroup
from spaceserve.runtime.tp.worker import worker_main
from spaceserve.runtime.worker.step_plan import StepLimits

DEFAULT_TIMEOUT_S = 300.0  # a collective's limit; a dead worker is noticed long before
# Thread blocks a collective may take by default: enough channels for NVLink bandwidth on
# prefill-sized all-reduces, and half of the smallest default partition (132 SMs: 32 / 36).
DEFAULT_COLLECTIVE_SMS = 16


def collective_timeout_s() -> float:
    """The collectives' timeout: ``SPACESERVE_TP_TIMEOUT_S`` or `DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("SPACESERVE_TP_TIMEOUT_S")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"SPACESERVE_TP_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"SPACESERVE_TP_TIMEOUT_S={raw!r} must be > 0")
    return value


class TensorParallelRunner(EncoderMethods):
    """Rank 0 of a tensor-parallel group of `size` ranks (module docstring). `partitions` is
    set for the co-located modes (every rank builds the same partition set from it; in
    ``spatial`` it carries the engine's chosen split set: `for_engine`); `env` is set in
    every rank's environment before its group is created (NCCL's knobs, for instance);
    `mm_encoder_tp_mode` "data" or "replicate" (`encoder.py`); `collective_sms` bounds a
    collective's thread blocks (None: `collective_sms_for`'s default)."""

    def __init__(self, source: P.ModelSource, size: int, *,
                 partitions: P.PartitionSpec | None = None, timeout_s: float | None = None,
                 env: dict[str, str] | None = None, mm_encoder_tp_mode: str = "data",
                 collective_sms: int | None = None) -> None:
        from spaceserve.runtime.tp.comm import connect
        from spaceserve.runtime.tp.worker import build_runner, rank_device

        require_int("tensor_parallel_size", size, 2)  # one rank needs no group
        device = rank_device(source.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        require_choice("mm_encoder_tp_mode", mm_encoder_tp_mode, MM_ENCODER_TP_MODES)
        self.size = size
        self.tp_size = size
        self.source = source
        self.mm_encoder_tp_mode = mm_encoder_tp_mode
        self.partition_spec = partitions
        self.collective_sms = collective_sms_for(device, partitions, collective_sms)
        env = {**(env or {}), CTAS_ENV: str(self.collective_sms)}
        self._seq = [0] * size
        self._owner_lock = threading.Lock()
        self.assigned = [0] * size
        self._ready: dict[int, Any] = {}
        self._shared: set[int] = set()
        self.num_shipped = 0  # embeddings sent through the pipe by a step (none held there)
        stages = ("decoder",) if partitions is None else ("decoder", "encoder")
        self.group = WorkerGroup(size, source, timeout_s=timeout_s or collective_timeout_s(),
                                 stages=stages, partitions=partitions,
                                 num_threads=torch.get_num_threads(), env=env,
                                 target=worker_main)
        os.environ.update(self.group.spec.env)  # e.g. NCCL's knobs: rank 0 joins with them too
        self.comms: dict[str, Any] = {}
        self._dead = False
        self._lock = threading.Lock()  # keys
        try:
            self.group.expect("hello")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            spec = self.group.spec
            self.comms = self.group.watched(
                lambda: connect(0, size, spec.rendezvous, device, stages, spec.timeout_s))
            if device.type == "cuda":  # unblock collectives waiting on a dead peer
                self.group.on_failure.append(self._abort)
            self.local = build_runner(source, 0, size, self.comms["decoder"], device)
            self.group.expect("ready")
        except BaseException:
            self.close()
            raise
        self.info = self.local.info
        self.device = self.local.device
        self.model = self.local.model
        self._keys: dict[int, tuple[int, Any]] = {}
        self._next_key = 0

    @classmethod
    def for_engine(cls, config: Any, *, path: str | None = None,
                   model_config: dict[str, Any] | None = None, seed: int = 0,
                   attention_backend: str = "triton", dtype: Any = None, device: Any = None
                   ) -> TensorParallelRunner:
        """The runner of an `EngineConfig` (its ``tensor_parallel_size`` and, for the
        co-located modes, its partition fields; ``spatial``'s split set chosen here, from its
        curves and SLO) over a checkpoint `path` or random weights of `model_config` (a config
        dict) drawn with `seed`. `device` None: CUDA when present."""
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and dev.index not in (None, 0)):
            raise ValueError(f"device={device!r}: a tensor-parallel group runs on 'cpu' or on "
                             "'cuda' (rank r on GPU r of the visible ones)")
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        source = P.ModelSource(path=None if path is None else os.fspath(path),
                               config=model_config, seed=seed,
                               attention_backend=attention_backend, dtype=dtype,
                               device=dev.type)
        hf_config = source_config(source)
        check_splits(source, config.tensor_parallel_size, hf_config)
        partitions = None
        if config.mode not in TEMPORAL_MODES:  # the co-located modes' partitions, every rank's
            from spaceserve.runtime.spatial.split_set import chosen_splits

            rank0 = torch.device("cuda", 0) if dev.type == "cuda" else dev
            splits = chosen_splits(config, hf_config, rank0)
            partitions = P.PartitionSpec(config.mode, config.encoder_sms, splits,
                                         config.green_contexts, config.programs_per_sm)
        return cls(source, config.tensor_parallel_size, partitions=partitions,
                   mm_encoder_tp_mode=config.mm_encoder_tp_mode,
                   collective_sms=config.collective_sms)

    # -- plumbing ----------------------------------------------------------------------------
    def _send(self, cmd: Any) -> None:
        if self._dead:
            self.group.raise_failure()
        try:
            self.group.broadcast(cmd)
        except TensorParallelError:
            self._dead = True
            raise

    def _run(self, fn: Any, *args: Any, fatal: bool = True, **kwargs: Any) -> Any:
        """Run rank 0's part of a command already sent. Any exception of a `fatal` part (one
        with collectives: the workers are in them now) and any exception once the group has
        failed becomes the group's `TensorParallelError`; other exceptions (an image the
        encoder refuses, refused on every rank alike) pass through."""
        try:
            return fn(*args, **kwargs)
        except TensorParallelError:
            self._dead = True
            raise
        except Exception as exc:
            if fatal or self._dead or self.group.failure() is not None or \
                    _collective_error(exc):
                self._dead = True
                self.group.raise_failure(exc)
            raise
        except BaseException:  # interrupted: the workers may be inside a collective now
            if fatal:
                self._dead = True
            raise

    def _send_to(self, rank: int, cmd: Any) -> None:
        if self._dead:
            self.group.raise_failure()
        try:
            self.group.send_to(rank, cmd)
        except TensorParallelError:
            self._dead = True
            raise

    def _replies(self) -> list[Any]:
        try:
            return self.group.replies()
        except TensorParallelError:
            self._dead = True
            raise

    def _abort(self) -> None:
        for comm in self.comms.values():
            comm.abort()

    def _key(self, obj: Any, *, create: bool = True) -> int | None:
        """The workers' key of an encoder job (`MultiModalData`) or encoder-cache entry."""
        with self._lock:
            entry = self._keys.get(id(obj))
            if entry is not None and entry[1] is obj:
                return entry[0]
            if not create:
                return None
            key, self._next_key = self._next_key, self._next_key + 1
            self._keys[id(obj)] = (key, obj)
            return key

    # -- the runner protocol -----------------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block on each rank (its own KV heads)."""
        return self.local.kv_block_bytes(block_size)

    def profile_peak_bytes(self, limits: StepLimits, max_encoder_tokens: int) -> int:
        """The largest peak over the ranks, plus how much less free memory the tightest rank
        has than rank 0 (the KV cache is sized on rank 0's free memory, the same on all)."""
        self._send(P.Profile(limits, max_encoder_tokens))
        peak = self._run(self.local.profile_peak_bytes, limits, max_encoder_tokens)
        if self.device.type != "cuda":
            self._replies()
            return peak
        free0 = torch.cuda.mem_get_info(self.device)[0]
        worst = peak
        for p, free in self._replies():
            worst = max(worst, p + max(0, free0 - free))
        return worst

    def allocate_kv_cache(self, num_blocks: int, limits: StepLimits) -> None:
        self._send(P.Allocate(num_blocks, limits))
        self._run(self.local.allocate_kv_cache, num_blocks, limits)

    def capture_decode_graphs(self, batch_sizes: Sequence[int], *,
                              partition: Budgets = WHOLE_DEVICE) -> tuple[int, ...]:
        self._send(P.Capture(tuple(batch_sizes), partition))
        sizes = self._run(self.local.capture_decode_graphs, batch_sizes, partition=partition)
        theirs = self._replies()
        if any(tuple(t) != tuple(sizes) for t in theirs):
            raise TensorParallelError(f"decode graphs captured differ across ranks: rank 0 "
                                      f"{sizes}, others {theirs}")
        return sizes

    def prepare_request(self, req: Request) -> None:
        self.local.prepare_request(req)

    def execute(self, batch: ScheduledBatch, *, stage: str = "decoder") -> torch.Tensor:
        """One step on every rank: rank 0 prepares it, sends it, and runs its own shard;
        returns the full logits (gathered inside the model)."""
        step = self.local.prepare_step(batch, stage=stage)
        pieces = []
        for src, lo, hi in step.pieces:
            key = None
            if src is not None:
                key = self._key(src, create=False)
                if key is None or (self.encoder_ranks > 1 and key not in self._shared):
                    # embeddings the workers do not hold (given with the request, or encoded
                    # by a stage unaware of ranks): ship them once
                    key = self._key(src)
                    self._send(P.Embeds(key, src.tensor.detach().cpu()))
                    self.num_shipped += 1
                    if self.encoder_ranks > 1:
                        self._shared.add(key)
                elif src.tensor is not None and src.tensor.is_cuda:
                    self.wait_shared(key, src.tensor)
            pieces.append((key, lo, hi))
        self._send(P.Step(step.stage, step.budget, step.graph, step.inputs.wire(), pieces,
                          step.partition))
        comm = self.comms.get(stage, self.comms["decoder"])
        return self._run(self.local.run_step, step, comm=comm)

    def worker_stats(self, record: bool | None = None) -> list[dict[str, Any]]:
        """Each worker's diagnostics (`protocol.Stats`): steps run, embeddings and encoder jobs
        held, the launches recorded since the last call (`record` switches recording) and the
        encoder splits of its partition set."""
        self._send(P.Stats(record))
        return self._replies()

    # -- shutdown ----------------------------------------------------------------------------
    def worker_pids(self) -> list[int]:
        return list(self.group.pids)

    def close(self) -> None:
        """Stop the workers and release the groups (idempotent)."""
        self._dead = True
        group = getattr(self, "group", None)
        if group is not None:
            group.close()
        for comm in getattr(self, "comms", {}).values():
            comm.shutdown()
        self.comms = {}


def smallest_partition(device: torch.device, partitions: P.PartitionSpec | None) -> int:
    """The fewest SMs any stage that issues collectives gets: the whole device in temporal and
    shared modes, else the smaller side of the most lopsided split of the set the spec builds
    (requested counts: 120 encoder SMs of 132 leave the decoder 12)."""
    return _smallest(device, partitions)[0]


def _smallest(device: torch.device, partitions: P.PartitionSpec | None) -> tuple[int, str]:
    """`smallest_partition` and where it is, in words."""
    from spaceserve.kernels.budget import device_num_sms
    from spaceserve.runtime.spatial.split_set import encoder_split_set

    total = device_num_sms(device)
    splits = () if partitions is None else encoder_split_set(partitions, total)
    if not splits:
        return total, f"the whole device of {total} SMs"
    e = min(splits, key=lambda x: min(x, total - x))
    side = "encoder" if e <= total - e else "decoder"
    return min(e, total - e), (f"the {side} side of the {e} / {total - e} split of encoder "
                               f"splits {splits}")


def collective_sms_for(device: torch.device, partitions: P.PartitionSpec | None,
                       requested: int | None) -> int:
    """The bound on a collective's thread blocks: `requested`, or `DEFAULT_COLLECTIVE_SMS`
    capped at the smallest partition; ValueError when a requested bound does not fit it (a
    collective could not run inside that partition's SMs)."""
    smallest, where = _smallest(device, partitions)
    if requested is None:
        return max(1, min(DEFAULT_COLLECTIVE_SMS, smallest))
    require_int("collective_sms", requested)
    if requested > smallest:
        raise ValueError(f"collective_sms={requested} exceeds the smallest partition a "
                         f"collective runs in ({smallest} SMs): {where}")
    return requested


def source_config(source: P.ModelSource) -> Any:
    """The transformers config every rank builds its shard from (the checkpoint's config.json
    or the source's dict); None for a checkpoint of an unsupported type (`from_pretrained`
    says why, on rank 0)."""
    from spaceserve.models.loading.loader import SUPPORTED_MODEL_TYPES, config_class

    if source.path is not None:
        import json

        with open(os.path.join(source.path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            return None
        return config_class(model_type).from_pretrained(source.path)
    raw = dict(source.config or {})
    return config_class(raw.pop("model_type", "qwen2_vl"))(**raw)


def check_splits(source: P.ModelSource, size: int, config: Any = None) -> None:
    """ValueError, before any process starts, when the model's heads or MLP width do not split
    over `size` ranks (reads only the checkpoint's config; `config`: it, already read)."""
    from spaceserve.models.parallel import TensorParallel, check_text_config

    config = source_config(source) if config is None else config
    if config is not None:
        check_text_config(config.text_config, TensorParallel(0, size))


def _collective_error(exc: BaseException) -> bool:
    """Whether `exc` comes from a collective (gloo / NCCL / c10d)."""
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return any(s in text for s in ("gloo", "nccl", "NCCL", "c10d", "DistBackendError",
                                   "Connection closed by peer", "Connection reset"))
