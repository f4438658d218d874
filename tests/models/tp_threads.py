"""A tensor-parallel group of threads in one process, for model-level tests: each rank runs in
its own thread and the collectives meet at a barrier (sums in rank order, so every rank gets
bitwise the same result, as a ring all-reduce gives). The engine uses torch.distributed.

With ``serial=True`` the ranks take turns between collectives (one lock, released while a rank
waits at the barrier): the Triton interpreter cannot run kernels from two threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


class ThreadGroup:
    """Shared state of `size` ranks; `comm(rank)` is each rank's communicator."""

    def __init__(self, size: int, timeout_s: float = 120.0, serial: bool = False) -> None:
        self.size = size
        self.turn = threading.Lock() if serial else None
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.calls = [0] * size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g.calls[self.rank] += 1
        g.slots[self.rank] = x.clone()
        if g.turn is not None:
            g.turn.release()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        if g.turn is not None:
            g.turn.acquire()
        return parts

    def all_reduce(self, x: torch.Tensor, *, num_sms: int | None = None) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor, *, num_sms: int | None = None) -> torch.Tensor:
        return torch.cat(self._exchange(x))


def run_ranks(size: int, fn: Callable[[int, ThreadComm], Any], *, serial: bool = False
              ) -> list[Any]:
    """fn(rank, comm) on `size` threads at once (taking turns when `serial`); results in rank
    order (errors re-raised)."""
    group = ThreadGroup(size, serial=serial)

    def run(rank: int) -> Any:
        if group.turn is None:
            return fn(rank, group.comm(rank))
        with group.turn:
            return fn(rank, group.comm(rank))

    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(run, r) for r in range(size)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            group.barrier.abort()
            raise
