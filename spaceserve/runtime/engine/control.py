"""Aborting, failing, pausing and resuming requests, a part of the `Engine` (engine.py). A
request whose output nobody takes (a stream's client that stopped reading) should hold no KV
blocks meanwhile: it is paused.

`pause` and `resume` may be called from any thread; like an abort they are posted to the
engine's inbox and applied at the start of the next step (`_apply_control`), never while a
step plans. A paused request's running sequences are preempted by recompute (the scheduler's
`pause`: blocks freed, tokens and embeddings kept) and wait at the front of the queue,
skipped by admission, until resumed; then they are prefilled again and draw the same tokens
they would have (a draw depends only on the seed and the position). A paused request stays
active (it counts in `num_active` and `abort` ends it) but gives a step nothing to do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from spaceserve.runtime.core.request import Status

CONTROLS = ("pause", "resume")


class RequestControl:
    """`Engine.abort`, `fail_all`, `pause` and `resume` (module docstring)."""

    _lock: threading.Lock
    _step_lock: threading.Lock
    _inflight: Any
    spatial: Any
    _inbox: deque[tuple[str, Any]]
    _active: dict[str, Any]
    _paused: set[str]
    scheduler: Any

    def abort(self, request_id: str) -> bool:
        """Abort a request (takes effect at the next step); False when it is not active."""
        return self._post("abort", request_id)

    def fail_all(self, message: str) -> None:
        """End every active request with an error (the model failed; nothing can continue)."""
        with self._step_lock:
            self._inflight = None  # its draws are lost with the requests
            if self.spatial is not None:
                self.spatial.drain()
            now = time.monotonic()
            with self._lock:
                self._inbox.clear()
                reqs = [s for r in self._active.values() for s in (r.group.seqs if r.group
                                                                   else (r,))]
            for req in reqs:
                if req.status is not Status.FINISHED:
                    self._end(req, "error", message, now)

    def pause(self, request_id: str) -> bool:
        """Stop scheduling a request until `resume` (module docstring); False when it is not
        active."""
        return self._post("pause", request_id)

    def resume(self, request_id: str) -> bool:
        """Schedule a paused request again; False when it is not active."""
        return self._post("resume", request_id)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def _post(self, kind: str, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._active:
                return False
            self._inbox.append((kind, request_id))
            return True

    def _apply_control(self, kind: str, request_id: str) -> None:
        """Apply a posted pause or resume to every started sequence of the request (step
        thread)."""
        req = self._active.get(request_id)
        if req is None:
            return
        act = self.scheduler.pause if kind == "pause" else self.scheduler.resume
        for seq in req.group.started() if req.group else (req,):
            act(seq)
        if kind == "pause":
            self._paused.add(request_id)
        else:
            self._paused.discard(request_id)


__all__ = ["CONTROLS", "RequestControl"]
