"""`ReplicaClient`: the engine client `create_app` serves, over a set of engine replicas.

It has the surface the HTTP layer uses of `AsyncEngine`: the same admission, preprocessing pool
(light and heavy lanes), pixel budget, ``draining`` flag and ``abort_all`` (`handles.Admission`;
``reserve`` -> a `handles.Handle` with ``start`` / ``wait`` / ``hold`` / ``next`` /
``cancel`` / ``close``), and ``alive``, ``last_error``, ``mode``, ``mode_note``, ``device``,
``metrics``, ``gauges``, ``engine.max_model_len``, ``close``; so the API, errors, bounds,
graceful shutdown, /health and /metrics are the single server's. The ingress preprocesses
(chat template, media decoding) exactly as one server does; a handle then derives the
prompt's `RouteRequest` (image content hashes, prefix-block hashes) and streams the request
from one replica through a `ReplicaBackend` (Ray Serve's deployment handle in deploy.py, a fake
in tests); the backend's router ranks replicas with the `ReplicaTracker` this client reports
to (first token, end). The server ending a request (a drain's deadline) cancels the replica's
call, which aborts it there.

Faults: when the replica fails (its process died, its stream broke) before anything was handed
to the HTTP layer, the request is sent once more, to another replica; otherwise it ends with an
error output whose status is 503 (a JSON 503 before the first chunk, an SSE error event after).
A request no replica takes within `route_timeout_s` ends the same way, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from spaceserve.runtime.inputs import PixelBudget, PreprocessPool
from spaceserve.runtime.policy.admission import retry_seconds
from spaceserve.runtime.routing.keys import route_request
from spaceserve.server.handles import Admission, Handle
from spaceserve.server.replicas.metrics import ReplicaSetMetrics
from spaceserve.server.transport.errors import APIError

if TYPE_CHECKING:
    from spaceserve.runtime.core.request import RequestOutput, SamplingParams
    from spaceserve.runtime.routing.tracker import ReplicaTracker


class ReplicaLost(Exception):
    """A replica's stream ended without the request's final output."""


class NoReplica(Exception):
    """No replica took the request in time."""


class ReplicaBackend(Protocol):
    """Sends one request to one replica (the router picks it) and yields the replica's items:
    ``("out", replica_label, RequestOutput)`` (the outputs of a request's n choices
    interleave, each with its ``index``) or ``("error", http_status, message[, param])``."""

    def stream(self, kwargs: dict[str, Any]) -> AsyncIterator[tuple]: ...

    def is_replica_failure(self, exc: BaseException) -> bool: ...


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP layer reads of the engine (the replicas all run the same one);
    `max_num_seqs` bounds ``n`` and a request's sequences (openai/bounds.py), `vocab_size`
    prompt token ids (None: unknown, the replica's engine checks them)."""

    max_model_len: int
    max_num_seqs: int | None = None
    vocab_size: int | None = None


def error_output(request_id: str, status: int, message: str,
                 param: str | None = None, retry_after: float | None = None) -> RequestOutput:
    """A final output ending a request with `message`, answered with HTTP `status` (naming
    the request field `param`, and with a ``Retry-After``, when given)."""
    from spaceserve.runtime.core.request import RequestMetrics, RequestOutput

    now = time.monotonic()
    extra: dict[str, Any] = {"status": status}
    if param:
        extra["param"] = param
    if retry_after is not None:
        extra["retry_after"] = retry_after
    return RequestOutput(request_id, [], [], [], True, "error", message,
                         RequestMetrics(now, None, (), now), extra=extra)


class ReplicaRequestHandle(Handle):
    """One admitted request; see the module docstring."""

    client: ReplicaClient

    def __init__(self, client: ReplicaClient, request_id: str) -> None:
        super().__init__(client, request_id)
        self.task: asyncio.Task | None = None
        self.label: str | None = None  # the replica that answered
        self.delivered = False
        self._kwargs: dict[str, Any] = {}

    def add(self, prompt: Any, params: SamplingParams | Callable[[Any], SamplingParams], *,
            stream: bool) -> None:
        """Route the prepared `prompt` and send it to a replica (any thread), unless the
        request was closed or cancelled meanwhile."""
        c = self.client
        sp = params(prompt) if callable(params) else params
        self.expect(sp.n)
        route = route_request(self.request_id, prompt, image_token_id=c.image_token_id,
                              merge_size=c.merge_size, block_tokens=c.block_tokens,
                              output_tokens=sp.max_tokens)
        refusal = c.tracker.shed(route)  # SLO-aware admission: no replica can meet the bound
        if refusal is not None:
            c.metrics.refused()
            raise APIError(503, str(c.tracker.admission.refusal(refusal)), type="server_error",
                           code="overloaded", retry_after=retry_seconds(refusal.retry_after_s))
        with self._lock:
            if self.closed or self.cancelled.is_set():
                return
            self.added = True
        try:
            self.loop.call_soon_threadsafe(self._launch, prompt, sp, stream, route)
        except RuntimeError:  # the loop is gone: nobody listens any more
            pass

    def _launch(self, prompt: Any, params: Any, stream: bool, route: Any) -> None:
        if not (self.closed or self.cancelled.is_set()):
            self.task = asyncio.ensure_future(self._pump(prompt, params, stream, route))

    def _stop(self) -> None:
        """Cancel the replica call (the replica aborts the request)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()

    # The request's life on the replicas.

    async def _pump(self, prompt: Any, params: Any, stream: bool, route: Any) -> None:
        c, rid = self.client, self.request_id
        kwargs = self._kwargs = {"request_id": rid, "prompt": prompt, "params": params,
                                 "stream": stream, "route": route, "exclude": None,
                                 "fair_key": self.fair_key}
        del prompt
        for attempt in (1, 2):
            try:
                await self._relay(c.backend.stream(kwargs))
                return
            except asyncio.CancelledError:
                raise
            except NoReplica:
                self._fail(503, f"no replica took the request within {c.route_timeout_s:g} s; "
                           "retry later")
                return
            except Exception as exc:
                if not (isinstance(exc, ReplicaLost) or c.backend.is_replica_failure(exc)):
                    self._fail(500, f"internal error: {type(exc).__name__}")
                    return
                failed = c.tracker.assigned(rid)
                label = self.label or c.label_of(failed) or "unknown"
                c.metrics.replica_failed(label)
                c.tracker.on_finished(rid)
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if not self.delivered and attempt == 1:
                    c.metrics.request_retried()
                    kwargs["exclude"] = failed
                    continue
                after = "after part of the answer was sent" if self.delivered else \
                    "and so did the replica it was retried on"
                self._fail(503, f"replica {label} failed while serving this request {after} "
                           f"({why.rstrip(': ')}); retry it")
                return

    async def _relay(self, items: AsyncIterator[tuple]) -> None:
        """Hand a replica's outputs to the HTTP layer until the final one (of every one of
        the request's n sequences, whose outputs interleave)."""
        c, rid = self.client, self.request_id
        it = items.__aiter__()
        item = await self._first(it)
        left = self.n
        while True:
            if item[0] == "error":
                status, message = item[1], item[2]
                param = item[3] if len(item) > 3 else None
                retry = item[4] if len(item) > 4 else None  # an admission refusal's
                self._put(error_output(rid, int(status), str(message), param, retry))
                return
            _, label, out = item
            if self.label is None:
                key = c.key_of(str(label))
                if key is not None:
                    c.tracker.confirm(rid, key)
            self.label = str(label)
            if out.finished:
                left -= 1
                if not left:
                    c.tracker.on_finished(rid)
                c.metrics.observe(out, self.label)
            else:
                c.tracker.on_first_token(rid)
            if not self.delivered:  # no retry from here on: the prompt is not needed again
                self.delivered = True
                self._kwargs["prompt"] = None
            self._put(out)
            if not left:
                return
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                raise ReplicaLost("the replica's stream ended before the request did") from None

    async def _first(self, it: AsyncIterator[tuple]) -> tuple:
        """The first item; NoReplica when no replica took the request in time (once one has,
        its queue may take as long as it takes)."""
        c = self.client
        first = asyncio.ensure_future(it.__anext__())
        start = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=0.5)
                if done:
                    break
                if c.tracker.assigned(self.request_id) is None and \
                        time.monotonic() - start > c.route_timeout_s:
                    raise NoReplica()
        except BaseException:
            first.cancel()
            raise
        try:
            return first.result()
        except StopAsyncIteration:
            raise ReplicaLost("the replica's stream ended before the request did") from None

    def _put(self, out: RequestOutput) -> None:
        self.queue.put_nowait(out)

    def _fail(self, status: int, message: str) -> None:
        out = error_output(self.request_id, status, message)
        self.client.tracker.on_finished(self.request_id)
        self.client.metrics.observe(out)
        self._put(out)


class ReplicaClient(Admission):
    """See the module docstring. `max_pending` bounds requests admitted and not yet closed;
    `pool` runs their preprocessing (default: `workers` threads over its two lanes) and
    `pixels` bounds the decoded pixels in it."""

    handle_class = ReplicaRequestHandle

    def __init__(self, backend: ReplicaBackend, tracker: ReplicaTracker, *, max_model_len: int,
                 mode: str, num_replicas: int, image_token_id: int | None,
                 merge_size: int = 2, max_pending: int = 256, mode_note: str | None = None,
                 max_num_seqs: int | None = None, vocab_size: int | None = None,
                 route_timeout_s: float = 60.0, workers: int = 4,
                 pool: PreprocessPool | None = None, pixels: PixelBudget | None = None,
                 device: str | None = None) -> None:
        if pool is None:
            light = max(1, workers // 2)
            pool = PreprocessPool(light_workers=light, heavy_workers=max(1, workers - light))
        super().__init__(max_pending=max_pending, pool=pool, pixels=pixels)
        self.backend, self.tracker = backend, tracker
        self.engine = EngineFacts(max_model_len, max_num_seqs, vocab_size)
        self._mode, self._note = mode, mode_note
        self.device = device  # what each replica runs on (/health), as the first one said
        self.num_replicas = num_replicas
        self.image_token_id, self.merge_size = image_token_id, merge_size
        self.block_tokens = tracker.config.block_tokens
        self.route_timeout_s = route_timeout_s
        self.metrics = ReplicaSetMetrics(self.replica_gauges, self.replica_info,
                                         self.replica_counters)
        self._closing = False

    def _release(self, handle: Handle) -> None:
        super()._release(handle)
        self.tracker.on_finished(handle.request_id)

    # State.

    @property
    def alive(self) -> bool:
        return not self._closing and bool(self.tracker.keys())

    @property
    def last_error(self) -> str | None:
        """Why the replica set is dead (the single server's client says why its engine died)."""
        if self.alive:
            return None
        return "shutting down" if self._closing else f"none of {self.num_replicas} replicas " \
            "is running"

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def mode_note(self) -> str | None:
        live = len(self.tracker.keys())
        parts = [self._note] if self._note else []
        if live < self.num_replicas:
            parts.append(f"{live} of {self.num_replicas} replicas running")
        return "; ".join(parts) or None

    def label_of(self, key: str | None) -> str | None:
        """A replica's label (its rank) from its latest report."""
        if key is None:
            return None
        rank = self.tracker.info_of(key).get("rank")
        return None if rank is None else str(rank)

    def key_of(self, label: str) -> str | None:
        """The replica key (Ray replica id) of a label, from the latest reports."""
        for key, info in self.tracker.info().items():
            if str(info.get("rank")) == label:
                return key
        return None

    def _reports(self) -> dict[str, dict[str, Any]]:
        return {str(info["rank"]): info for info in self.tracker.info().values()
                if "rank" in info}

    def replica_gauges(self) -> dict[str, list[tuple[str, str, float]]]:
        """Each live replica's gauges as it last reported them, by label."""
        return {lab: [tuple(g) for g in info.get("gauges", ())]
                for lab, info in self._reports().items()}

    def replica_counters(self) -> dict[str, list[tuple[str, str, int]]]:
        """Each live replica's engine counters (caches, encoder jobs, prefill tokens)."""
        return {lab: [tuple(c) for c in info.get("counters", ())]
                for lab, info in self._reports().items()}

    def counters(self) -> list[tuple[str, str, int]]:
        """The engines' counters summed over the live replicas (a replaced replica's count
        starts again from 0)."""
        sums: dict[str, int] = {}
        helps: dict[str, str] = {}
        for per in self.replica_counters().values():
            for name, help_text, value in per:
                sums[name] = sums.get(name, 0) + int(value)
                helps.setdefault(name, help_text)
        return [(name, helps[name], value) for name, value in sums.items()]

    def replica_info(self) -> dict[str, dict[str, str]]:
        keys = {str(info.get("rank")): key for key, info in self.tracker.info().items()}
        return {lab: {"replica_id": keys.get(lab, ""), "pid": str(info.get("pid", "")),
                      "node": str(info.get("node", ""))}
                for lab, info in self._reports().items()}

    def gauges(self) -> list[tuple[str, str, float]]:
        """The single server's gauges summed over the replicas (the KV usage weighted by
        blocks; requests in flight and preprocessing counted here), plus the number of
        replicas running."""
        reports = list(self._reports().values())
        depth = self.pool.depth()
        ingress = {"preprocess_queue_depth": depth["light_queued"] + depth["heavy_queued"],
                   "preprocess_pixels": self.pixels.in_use}
        sums: dict[str, float] = {}
        helps: dict[str, str] = {}
        for info in reports:
            for name, help_text, value in info.get("gauges", ()):
                sums[name] = sums.get(name, 0.0) + float(value)
                helps.setdefault(name, help_text)
        blocks = sum(float(i.get("kv_blocks_total", 0)) for i in reports)
        used = sum(float(i.get("kv_blocks_total", 0)) - float(i.get("kv_blocks_free", 0))
                   for i in reports)
        out = []
        for name, value in sums.items():
            if name == "kv_cache_usage_perc":
                value = used / blocks if blocks else 0.0
            elif name == "num_requests_in_flight":
                value = self._pending
            elif name in ingress:  # preprocessing runs here, not on the replicas
                value = ingress[name]
            out.append((name, helps[name], value))
        out.append(("num_replicas", "Replicas running behind this endpoint.",
                    len(self.tracker.keys())))
        return out

    def close(self) -> None:
        self._closing = True
        self.pool.shutdown()
