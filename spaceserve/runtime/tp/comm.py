"""The tensor-parallel group's collectives on torch.distributed: gloo on CPU, NCCL on GPU.

Each rank builds its process groups directly (`ProcessGroupGloo` / `ProcessGroupNCCL` over a
`FileStore` in a fresh directory: no port to pick, no global default group), so several
engines can live in one process and parallel test runs never collide. One group per stage
that issues collectives ("decoder"; "encoder" in the co-located modes, where prefill chunks
run on the compute partition beside the decoder's steps): two streams never share a
communicator, whose operations must be issued in the same order on every rank.

`GroupComm` is the models' `Communicator`: in-place all-reduce, all-gather along dim 0 and
broadcast (a data-parallel encoder's embeddings; a pipelined step's decode inputs, from rank
0's device), issued synchronously (``asyncOp = False``).
With NCCL (torch >= 2.8) a synchronous collective runs on the *current* stream, so it lands on
the stage's partition stream and is captured into the decode CUDA graphs like any kernel; the
communicator is connected eagerly at start-up (`connect` runs one all-reduce per group), never
lazily inside a capture. The NCCL path is written for the GPU image (torch 2.11) and cannot run
on this project's CPU-only CI.

SM accounting. NCCL runs a collective as one kernel of one thread block (CTA) per channel, each
on an SM. The group bounds that count with NCCL's environment knob ``NCCL_MAX_CTAS`` (read by the
NCCL torch 2.11 ships, 2.28.9, at communicator creation; it overrides the per-communicator
``maxCTAs`` config and also caps NVLink-SHARP channels; ``NCCL_MAX_NCHANNELS``, its older
name, is still honoured and only lowers the count further), set in every rank's environment
before its groups exist. Each collective is recorded in the launch record (`record_collective`:
grid = that bound, budget = the stage's SMs: the ``num_sms`` it is issued with, as a kernel's).
Because every collective runs on its stage's stream, in order with the stage's kernels, it
never runs beside them: the stage's kernels keep its whole budget, and the bound only has to
fit the smallest partition a collective runs in (`runner.collective_sms` checks that).

Every operation has the group's timeout (gloo's default is 30 minutes); the process layer
(`group.py`) watches the workers and turns a dead peer into an error long before that. NCCL
groups abort their communicators on an error rather than tear the process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless set otherwise): rank 0 is the engine's process.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from spaceserve.kernels.budget import device_num_sms, is_recording, record_collective

Tensor = torch.Tensor
CTAS_ENV = "NCCL_MAX_CTAS"  # NCCL >= 2.17; NCCL_MAX_NCHANNELS is the older spelling


def _c10d() -> Any:
    import torch._C._distributed_c10d as c10d

    return c10d


def _options(kind: str) -> Any:
    c10d = _c10d()
    opts = getattr(c10d, f"{kind}Options")()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False  # NCCL: on the current stream (capturable), no trampoline stream
    if kind == "Allreduce":
        opts.reduceOp = c10d.ReduceOp.SUM
    return opts


def env_ctas() -> int | None:
    """The thread-block bound in this process's environment (``NCCL_MAX_CTAS``), or None."""
    raw = os.environ.get(CTAS_ENV)
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


class GroupComm:
    """One process group as the models' `Communicator` (rank, size, all_reduce, all_gather,
    broadcast); `ctas` is the bound on a collective's thread blocks that it records (None: the
    ``NCCL_MAX_CTAS`` of the environment; without one the record can only say "the whole
    stage budget")."""

    def __init__(self, pg: Any, rank: int, size: int, name: str, *, backend: str = "gloo",
                 ctas: int | None = None) -> None:
        self.pg, self.rank, self.size, self.name = pg, rank, size, name
        self.backend = backend
        self.ctas = ctas if ctas is not None else env_ctas()
        self._reduce = _options("Allreduce")
        self._gather = _options("Allgather")

    def _record(self, name: str, x: Tensor, num_sms: int | None) -> None:
        """One launch-record entry: at most `ctas` thread blocks (the whole stage budget when
        unbounded) inside the issuing stage's budget `num_sms` (None: the whole device),
        stream-ordered with its kernels."""
        if not is_recording():
            return
        budget = num_sms if num_sms is not None else device_num_sms(x.device)
        ctas = self.ctas if self.ctas is not None else budget
        record_collective(name, ctas, budget, group=self.name, backend=self.backend,
                          bytes=int(x.numel() * x.element_size()), overlap=False)

    def all_reduce(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        self._record("all_reduce", x, num_sms)
        self.pg.allreduce([x], self._reduce).wait()
        return x

    def all_gather(self, x: Tensor, *, num_sms: int | None = None) -> Tensor:
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._record("all_gather", out, num_sms)
        self.pg._allgather_base(out, x, self._gather).wait()
        return out

    def broadcast(self, x: Tensor, src: int, *, num_sms: int | None = None) -> Tensor:
        """Rank `src`'s `x` into every rank's `x` (contiguous), in place."""
        self._record("broadcast", x, num_sms)
        opts = _options("Broadcast")
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([x], opts).wait()
        return x

    def abort(self) -> None:
        """Abort the group's pending operations (NCCL: unblocks a collective whose peer died)."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            abort()

    def shutdown(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _process_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    from torch.distributed import ProcessGroupNCCL  # CUDA builds only

    # On an error or timeout abort the communicators and raise in the waiting thread (2,
    # "CleanUpOnly"), rather than tear the process down: rank 0 is the engine's process.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, opts)


def connect(rank: int, size: int, rendezvous: str, device: torch.device, stages: tuple[str, ...],
            timeout_s: float) -> dict[str, GroupComm]:
    """This rank's communicator per stage (blocks until every rank has joined), each checked
    with one all-reduce: a rank joining the wrong group fails here, not mid-step."""
    import torch.distributed as dist

    backend = backend_for(device)
    store = dist.FileStore(rendezvous, size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    comms = {}
    for stage in stages:
        pg = _process_group(backend, dist.PrefixStore(f"spaceserve/{stage}", store), rank, size,
                            timeout_s)
        comm = GroupComm(pg, rank, size, stage, backend=backend)
        probe = torch.ones(1, device=device)
        comm.all_reduce(probe)
        if int(probe.item()) != size:
            raise RuntimeError(f"tensor-parallel group {stage!r}: all-reduce of ones gave "
                               f"{probe.item()}, expected {size}")
        comms[stage] = comm
    return comms
