"""`EngineReplica`: one SpaceServe engine as a Ray Serve replica.

Each replica loads the model (`load_engine`, as ``spaceserve serve`` does) on the device Ray gave
it (a GPU, a TP group's GPUs, or CPU threads for the tiny model) and drives it with the single
server's `AsyncEngine`: same admission, same engine thread, same abort on cancel. `generate` is
an async generator the ingress streams from: ``("out", label, RequestOutput)`` items until the
final one, or one ``("error", status, message)``; Ray cancelling it (the client went away)
aborts the request, which frees its KV blocks. Its label is its Ray Serve rank ("0", "1", ...),
which a restarted replica takes over. `record_routing_stats` reports the gauges of /metrics and
who it is; `check_health` fails once the engine thread has stopped, so Ray replaces the replica.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from spaceserve.runtime.inputs import QueueFull as PoolFull
from spaceserve.server.engine_client import (
    AsyncEngine,
    QueueFull,
    load_engine,
    tune_interpreter,
)
from spaceserve.server.transport.errors import APIError


def _rank() -> int:
    from ray import serve

    rank = serve.get_replica_context().rank
    return int(getattr(rank, "rank", rank))


class EngineReplica:
    """See the module docstring; `engine_kwargs` go to `load_engine` (seed + rank per replica,
    so requests without a seed sample differently on different replicas)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], max_pending: int = 256,
                 num_threads: int | None = None) -> None:
        self.rank = _rank()
        self.label = str(self.rank)
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        kwargs = dict(engine_kwargs)
        kwargs["seed"] = int(kwargs.get("seed", 0)) + self.rank
        engine, _, note = load_engine(model, **kwargs)
        self.client = AsyncEngine(engine, max_pending=max_pending, mode_note=note)
        tune_interpreter()

    async def generate(self, request_id: str, prompt: dict[str, Any], params: Any,
                       stream: bool, route: Any = None, exclude: Any = None,
                       fair_key: str | None = None) -> AsyncIterator[tuple]:
        """Run one request (`fair_key`: its user, for the engine's fair share); `route` and
        `exclude` are for the router, unused here."""
        try:
            handle = self.client.reserve(request_id)
        except QueueFull as exc:
            yield ("error", 503, f"server busy: {exc}; retry later")
            return
        handle.fair_key = fair_key
        try:
            try:
                await handle.start(lambda: prompt, params, stream=stream)
            except APIError as exc:  # its 503s (SLO-aware admission) say when to retry
                yield ("error", exc.status, exc.message, exc.param, exc.retry_after)
                return
            except PoolFull as exc:  # its validation queue is full
                yield ("error", 503, f"server busy: {exc}; retry later")
                return
            while True:
                out = await handle.next()
                yield ("out", self.label, out)
                if handle.finished:  # all n sequences
                    return
        finally:
            handle.close()

    def info(self) -> dict[str, Any]:
        """What the ingress needs to know of the engine."""
        eng = self.client.engine
        return {"max_model_len": int(eng.max_model_len),
                "max_num_seqs": int(eng.config.max_num_seqs),
                "vocab_size": int(eng.runner.info.vocab_size), "mode": self.client.mode,
                "mode_note": self.client.mode_note, "rank": self.rank,
                "device": self.client.device}

    def record_routing_stats(self) -> dict[str, Any]:
        """Who this replica is and its /metrics gauges (Ray polls this periodically)."""
        depths = self.client.queue_depths()
        return {"rank": self.rank, "pid": os.getpid(), "node": socket.gethostname(),
                "gauges": [list(g) for g in self.client.gauges()],
                "counters": [list(c) for c in self.client.counters()],
                "kv_blocks_total": depths["kv_blocks_total"],
                "kv_blocks_free": depths["kv_blocks_free"]}

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError(self.client.last_error or "the engine thread has stopped")

    def __del__(self) -> None:  # Ray Serve's graceful shutdown
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
            client.engine.close()
