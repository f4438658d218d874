"""What the server's engine clients share (`AsyncEngine`: one engine in this process;
`replicas.ReplicaClient`: engine replicas on Ray), so `create_app` serves either the same way.

`Admission` bounds the requests in flight (`reserve`: `QueueFull` when full), owns the
preprocessing pool (`PreprocessPool`: light and heavy lanes, bounded queues, deadlines) and
the budget of decoded pixels beside it (`PixelBudget`), carries the `draining` flag a graceful
shutdown sets, and ends every live request on `abort_all`. `Handle` is one admitted request:
``start`` runs its preparation in a lane of the pool and hands the prompt to ``add`` (the
client's way to the engine), ``wait`` races anything against the server ending the request
(`Cancelled`), pixel leases are held until its media are encoded (``hold``,
``release_held``), its outputs arrive on an asyncio queue (``next``), and a stream whose client
stops reading pauses it (``pause``, ``resume``; paused requests keep their admission slots).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.inputs import PixelBudget, PreprocessPool

if TYPE_CHECKING:
    from spaceserve.runtime.core.request import RequestOutput, SamplingParams
    from spaceserve.server.transport.errors import APIError

DEFAULT_PIXELS = 4 * 4096 * 4096  # the server's decoded pixels in preprocessing, by default


class QueueFull(Exception):
    """Too many requests in flight; answered with 503."""


class Cancelled(Exception):
    """The request was ended by the server (`Admission.abort_all`); the message says why."""


class Handle:
    """One admitted request; subclasses say how a prompt reaches the engine (`add`) and how
    an unfinished request is stopped (`_stop`)."""

    def __init__(self, client: Admission, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.added = False
        self.finished = False  # every one of its n sequences has ended (or it failed)
        self.closed = False
        self.n = 1  # sequences (``n`` > 1: parallel sampling), set by ``add``
        self.fair_key: str | None = None  # the user it shares the fair share with (if keyed)
        self.door: tuple[int, float] | None = None  # (ticket, time) from `Admission.at_door`
        self._left = 1  # sequences whose final output has not been taken yet
        self.cancelled = asyncio.Event()
        self.cancel_reason = ""
        self.paused = False  # its stream's client is not reading (`pause`)
        self._held: list[Any] = []  # pixel leases until the media are encoded
        self._lock = threading.Lock()  # orders adding against closing

    async def start(self, prepare: Callable[[], Any], params: SamplingParams | Callable[
            [Any], SamplingParams], *, stream: bool, lane: str = "light", cost: float = 0.0,
            deadline: float | None = None, on_done: Callable[[], Any] | None = None) -> Any:
        """Run ``prepare()`` (blocking prompt work) in the pool's `lane`, then add the request;
        returns the prepared prompt. `params` may be a function of it (limits known only
        then). `deadline` (monotonic clock) bounds the wait (DeadlineExceeded); `on_done()`
        runs when the job is over, however it ends. Cancelled if the server ends the request
        meanwhile."""
        def job() -> Any:
            prompt = prepare()
            self.add(prompt, params, stream=stream)
            return prompt

        return await self.wait(self.client.pool.run(job, lane=lane, cost=cost,
                                                    deadline=deadline, on_done=on_done))

    def add(self, prompt: Any, params: SamplingParams | Callable[[Any], SamplingParams], *,
            stream: bool) -> None:
        """Send the prepared `prompt` on (any thread), unless the request was closed or
        cancelled meanwhile; APIError for a prompt the engine refuses."""
        raise NotImplementedError

    async def wait(self, aw: Awaitable[Any]) -> Any:
        """`aw`'s result, or Cancelled as soon as the server ends this request."""
        task = asyncio.ensure_future(aw)
        if self.cancelled.is_set():
            task.cancel()
            raise Cancelled(self.cancel_reason)
        stop = asyncio.ensure_future(self.cancelled.wait())
        try:
            await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller gave up (its client went away)
            task.cancel()  # a pool job is asked to stop at its next cancel point
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise Cancelled(self.cancel_reason)

    def hold(self, lease: Any) -> None:
        """Keep `lease` (anything with ``release()``) until `release_held` or `close`; at once
        released if the handle is closed already (any thread)."""
        with self._lock:
            if not self.closed:
                self._held.append(lease)
                return
        lease.release()

    def release_held(self) -> None:
        """Release the held leases (the request's media are encoded: it has an output)."""
        with self._lock:
            held, self._held = self._held, []
        for lease in held:
            lease.release()

    def expect(self, n: int) -> None:
        """The request runs `n` sequences: it has finished after n final outputs."""
        self.n = self._left = n

    async def next(self) -> RequestOutput:
        out = await self.queue.get()
        self._left -= out.finished
        # an error the client answers itself (its HTTP status in ``extra``) ends them all
        self.finished = self._left <= 0 or (out.finished and "status" in out.extra)
        return out

    def cancel(self, reason: str) -> None:
        """End the request from the server's side (event loop only): whoever waits on it
        gets Cancelled(reason); the request is stopped where it runs."""
        if self.cancelled.is_set() or self.closed:
            return
        self.cancel_reason = reason
        self.cancelled.set()
        with self._lock:
            stop = self.added and not self.finished
        if stop:
            self._stop()

    def close(self) -> None:
        """Release the admission slot; stop the request when it has not finished."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            stop = self.added and not self.finished
        if stop:
            self._stop()
        if self.paused:
            self.paused = False
            self.client.num_paused -= 1
        self.release_held()
        self.client._release(self)

    def _stop(self) -> None:
        """Stop the unfinished request where it runs (abort it)."""
        raise NotImplementedError

    def pause(self) -> None:
        """Stop generating for this request until `resume` (its stream's client is not
        reading): where the client can (`AsyncEngine`), its sequences are preempted and hold
        no KV blocks meanwhile; elsewhere (replicas) it goes on, and only the write timeout
        ends it."""
        if self.added and not self.finished and not self.closed:
            self.client.num_paused += 1
            self.paused = True
            self._pause(True)

    def resume(self) -> None:
        """Undo `pause` (the client reads again)."""
        if self.paused:
            self.client.num_paused -= 1
            self.paused = False
            if not self.closed:
                self._pause(False)

    def _pause(self, paused: bool) -> None:
        """Pause or resume the request where it runs (nothing where that is not possible)."""


class Admission:
    """See the module docstring. `max_pending` bounds requests admitted and not yet closed;
    `pool` runs their preprocessing and `pixels` bounds the decoded pixels in it."""

    handle_class: type[Handle] = Handle

    def __init__(self, *, max_pending: int = 256, pool: PreprocessPool | None = None,
                 pixels: PixelBudget | None = None) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r} must be an int >= 1")
        self.max_pending = max_pending
        self.pool = pool or PreprocessPool()
        self.pixels = pixels or PixelBudget(DEFAULT_PIXELS)
        self.draining = False
        self.num_paused = 0  # admitted requests paused for a client not reading (event loop)
        self._handles: set[Handle] = set()
        self._pending = 0
        self._plock = threading.Lock()
        self._ids = itertools.count(1)

    @property
    def num_pending(self) -> int:
        return self._pending

    def at_door(self, state: dict[str, Any]) -> APIError | None:
        """The 503 for a generation request refused before its body is read (SLO-aware
        admission: even a small request would miss its bound); None: admitted, with what
        admission tracks of it in `state` (``state["door"]``, handed to its handles as
        `Handle.door`). None here. Called in the event loop for every POST to a generation
        route, and `left_door(state)` once its response has ended."""
        return None

    def left_door(self, state: dict[str, Any]) -> None:
        """The request `at_door` admitted is over (see there)."""

    def reserve(self, request_id: str | None = None) -> Any:
        """Admit one request (a `handle_class`) or raise QueueFull; call inside the event
        loop."""
        with self._plock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests in flight (max_pending="
                                f"{self.max_pending})")
            self._pending += 1
            rid = request_id or f"srv-{next(self._ids)}"
        handle = self.handle_class(self, rid)
        self._handles.add(handle)
        return handle

    def _release(self, handle: Handle) -> None:
        with self._plock:
            self._pending -= 1
        self._handles.discard(handle)

    def abort_all(self, reason: str) -> int:
        """End every live request (event loop only): see `Handle.cancel`; how many."""
        live = [h for h in self._handles if not h.closed]
        for h in live:
            h.cancel(reason)
        return len(live)


__all__ = ["DEFAULT_PIXELS", "Admission", "Cancelled", "Handle", "QueueFull"]
