"""The engine on a background thread, driven from asyncio without blocking the event loop.

`AsyncEngine` owns one `Engine`. A daemon thread runs ``engine.step()`` whenever requests are
active and sleeps on a condition otherwise; requests enter through `reserve` (admission against
a bounded number of in-flight requests: `QueueFull` when full; `handles.Admission`, shared with
the replica client) and `RequestHandle.start`, which runs prompt preparation and
``add_request`` in a lane of the preprocessing pool (`PreprocessPool`: light and heavy lanes,
bounded queues, deadlines), with the server's budget of decoded pixels beside it (`pixels`).
The engine's per-request sink hands each output to the request's asyncio queue with
``call_soon_threadsafe``. Closing a handle before its final output (a client went away) aborts
the request, which frees its KV blocks and embeddings at the next step; `abort_all` ends every
live request with a reason (a shutdown), waking whoever waits on it. A step that leaves the
engine unable to run (a tensor-parallel group that lost a worker) marks it dead, with the
reason in `last_error`. After every step the thread samples the SM split and the queue depths:
the gauges of ``/metrics`` and the benchmark's split timeline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.inputs import PixelBudget, PreprocessPool
from spaceserve.runtime.policy.admission import DOOR_MARGIN, Refused, retry_seconds
from spaceserve.runtime.policy.slo import DEFAULT_SLO
from spaceserve.server.engine_load import (  # re-exported: scripts import them from here
    KNOWN_MODES,
    cap_video_tokens,
    device_label,
    device_sms,
    load_engine,
    resolve_mode,
    tune_interpreter,
)
from spaceserve.server.handles import Admission, Cancelled, Handle, QueueFull
from spaceserve.server.metrics import ServerMetrics
from spaceserve.server.transport.errors import APIError

__all__ = ["KNOWN_MODES", "AsyncEngine", "Cancelled", "QueueFull", "RequestHandle",
           "SplitSample", "cap_video_tokens", "device_label", "device_sms",
           "tune_interpreter", "load_engine", "resolve_mode"]

if TYPE_CHECKING:  # the engine (torch) is imported only by whoever builds one
    from spaceserve.runtime.core.request import RequestOutput, SamplingParams
    from spaceserve.runtime.engine.engine import Engine

# Engine.counters() key -> (metric name, help)
ENGINE_COUNTERS = (
    ("encoder_cache_queries", "encoder_cache_queries_total",
     "Media items (images, videos) looked up in the encoder cache."),
    ("encoder_cache_hits", "encoder_cache_hits_total",
     "Media items that needed no encoder pass (cached, or all their tokens prefix-cached)."),
    ("encoder_jobs", "encoder_jobs_total", "Encoder jobs run (one per request needing one)."),
    ("prefix_cache_queried_tokens", "prefix_cache_queried_tokens_total",
     "Tokens of admitted requests looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens_total",
     "Tokens whose KV blocks the prefix cache held (not computed)."),
    ("prefill_tokens", "prefill_tokens_computed_total",
     "Tokens computed in prefill (every computed token but a decode's newest)."),
)


@dataclass(frozen=True)
class SplitSample:
    """The engine's state after one step (engine monotonic clock)."""

    time: float
    encoder_sms: int
    decoder_sms: int
    waiting: int
    running: int
    encoder_pending: int


class RequestHandle(Handle):
    """One admitted request: start it, iterate its outputs, close it (aborts if unfinished)."""

    client: AsyncEngine

    noted = False  # SLO-aware admission knows when it arrived (`_arrived`)

    async def start(self, prepare: Any, params: Any, **kw: Any) -> Any:
        """SLO-aware admission first (a 503 before the request's preprocessing, when even a
        small request would miss the TTFT bound after the wait so far and the lane's
        backlog), then `Handle.start`."""
        adm = getattr(self.client.engine, "admission", None)
        if adm is not None and adm.active:
            now = time.monotonic()
            ticket, at = self.door if self.door is not None else (None, now)
            adm.leave(ticket)  # not ahead of itself
            refusal = adm.precheck(now, front_s=now - at + self.client.pool.drain_s(
                kw.get("lane", "light")))
            if refusal is not None:
                raise self.client.refuse(refusal)
            self._arrived(adm)
        return await super().start(prepare, params, **kw)

    def _arrived(self, adm: Any) -> None:
        """Tell admission when the request arrived (its door, else now): the wait before
        the engine counts toward its TTFT."""
        if not self.noted:
            self.noted = True
            ticket, at = self.door if self.door is not None else (None, time.monotonic())
            adm.note_arrival(self.request_id, at, ticket)

    def _sink(self, out: RequestOutput) -> None:
        if out.finished:
            self.client.metrics.observe(out)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # the loop is gone: nobody listens any more
            pass

    def add(self, prompt: Any, params: SamplingParams | Callable[[Any], SamplingParams], *,
            stream: bool) -> None:
        """Add the prepared `prompt` to the engine now (any thread; blocking: validation),
        unless the request was closed or cancelled meanwhile."""
        sp = params(prompt) if callable(params) else params
        self.expect(sp.n)
        with self._lock:
            if self.closed or self.cancelled.is_set():
                return
            adm = getattr(self.client.engine, "admission", None)
            if adm is not None and adm.active:
                self._arrived(adm)  # a prompt added without `start` (text read in one job)
            try:
                self.client.engine.add_request(prompt, sp, request_id=self.request_id,
                                               sink=self._sink, stream=stream,
                                               fair_key=self.fair_key)
            except Refused as exc:  # SLO-aware admission: cannot meet its TTFT bound
                raise self.client.refuse(exc) from None
            except ValueError as exc:  # a caller mistake the engine refused (n > max_num_seqs)
                from spaceserve.server.openai.sampling import (
                    param_of,  # pydantic: not on engine-only installs
                )

                raise APIError(400, str(exc), param=param_of(str(exc))) from None
            self.added = True
        self.client.wake()

    def close(self) -> None:
        """`Handle.close`; a request that never reached the engine (its preprocessing failed
        or was given up) no longer counts ahead of new arrivals."""
        super().close()
        adm = getattr(self.client.engine, "admission", None)
        if self.noted and adm is not None:
            adm.leave_front(self.request_id)

    def _stop(self) -> None:
        self.client.engine.abort(self.request_id)
        self.client.wake()

    def _pause(self, paused: bool) -> None:
        eng = self.client.engine
        (eng.pause if paused else eng.resume)(self.request_id)
        self.client.wake()


class AsyncEngine(Admission):
    """See the module docstring. `max_pending` bounds requests admitted and not yet closed;
    `pool` runs their preprocessing and `pixels` bounds the decoded pixels in it."""

    handle_class = RequestHandle

    def __init__(self, engine: Engine, *, max_pending: int = 256,
                 pool: PreprocessPool | None = None, pixels: PixelBudget | None = None,
                 mode_note: str | None = None, timeline_len: int = 200_000) -> None:
        super().__init__(max_pending=max_pending, pool=pool, pixels=pixels)
        self.engine = engine
        self.mode_note = mode_note
        self.metrics = ServerMetrics(getattr(getattr(engine, "config", None), "slo", DEFAULT_SLO))
        self.timeline: deque[SplitSample] = deque(maxlen=timeline_len)
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._dead = False
        self._device_sms = device_sms(engine)
        try:
            self.device = device_label(engine.runner.device)
        except Exception:  # a stand-in engine without a torch device
            self.device = None
        self._thread = threading.Thread(target=self._run, name="spaceserve-engine", daemon=True)
        self._thread.start()

    def at_door(self, state: dict[str, Any]) -> APIError | None:
        """SLO-aware admission's check before the body is read (`EngineAdmission.precheck`:
        the requests ahead, the preprocessing backlog or the recent wait before the engine,
        and the engine's queue pass the bound); an admitted request is counted ahead of
        later ones (``state["door"]``) until it reaches the engine's front or ends."""
        adm = getattr(self.engine, "admission", None)
        if adm is None or not adm.active:
            return None
        now = time.monotonic()
        light = self.pool.drain_s("light")  # every request's; media then wait for the heavy
        refusal = adm.precheck(now, front_s=light, margin=DOOR_MARGIN,
                               media_front_s=light + self.pool.drain_s("heavy"))
        if refusal is not None:
            return self.refuse(refusal)
        state["door"] = (adm.enter(now), now)
        return None

    def left_door(self, state: dict[str, Any]) -> None:
        door = state.get("door")
        if door is not None:
            self.engine.admission.leave(door[0])

    def refuse(self, exc: Refused) -> APIError:
        """An SLO-aware admission refusal as the server's 503 (counted as shed)."""
        self.metrics.refused()
        return APIError(503, str(exc), type="server_error", code="overloaded",
                        retry_after=retry_seconds(exc.retry_after_s))

    # The engine thread.

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing and not self._dead

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._closing and not eng.has_unfinished():
                    self._cond.wait(0.25)
                if self._closing:
                    return
            before = eng.num_steps
            try:
                eng.step()
            except Exception as exc:  # end every request with the reason instead of hanging
                self.last_error = f"engine step failed: {type(exc).__name__}: {exc}"
                eng.fail_all(self.last_error)
                if _engine_dead(exc):  # nothing can run any more: /health says so
                    self._dead = True
                    return
            self._sample()
            if eng.num_steps == before:
                time.sleep(0.0005)  # nothing could run (only drains): do not spin

    def _sample(self) -> None:
        enc, dec = self.sm_split()
        g = self.queue_depths()
        s = SplitSample(time.monotonic(), enc, dec, g["waiting"], g["running"],
                        g["encoder_pending"])
        last = self.timeline[-1] if self.timeline else None
        if last is None or (last.encoder_sms, last.decoder_sms, last.waiting, last.running,
                            last.encoder_pending) != (enc, dec, s.waiting, s.running,
                                                      s.encoder_pending) \
                or s.time - last.time > 0.05:
            self.timeline.append(s)

    # State.

    @property
    def mode(self) -> str:
        return str(getattr(self.engine.config, "mode", "temporal"))

    def sm_split(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs); a stage without a budget has the whole device."""
        fn = getattr(self.engine, "sm_split", None)
        if callable(fn):
            try:
                enc, dec = fn()
                return int(enc), int(dec)
            except Exception:  # a half-started spatial stage: the whole device
                pass
        return self._device_sms, self._device_sms

    def queue_depths(self) -> dict[str, int]:
        eng = self.engine
        sched, enc = getattr(eng, "scheduler", None), getattr(eng, "encoder", None)
        bm = getattr(eng, "block_manager", None)
        return {
            "waiting": len(getattr(sched, "waiting", ())),
            "running": len(getattr(sched, "running", ())),
            "encoder_pending": int(getattr(enc, "num_pending", 0)),
            "encoder_held": int(getattr(enc, "num_held", 0)),
            "active": int(eng.num_active),
            "pending": self._pending,
            "preprocess_pixels": self.pixels.in_use,
            **{f"preprocess_{k}": v for k, v in self.pool.depth().items()},
            "kv_blocks_free": int(getattr(bm, "num_free", 0)),
            "kv_blocks_total": int(getattr(eng.memory, "num_blocks", 0)),
        }

    def gauges(self) -> list[tuple[str, str, float]]:
        g = self.queue_depths()
        enc, dec = self.sm_split()
        total = max(g["kv_blocks_total"], 1)
        return [
            ("num_requests_waiting", "Requests waiting to be scheduled.", g["waiting"]),
            ("num_requests_running", "Requests in the running batch.", g["running"]),
            ("num_requests_in_flight", "Requests admitted by the server.", g["pending"]),
            ("num_requests_paused", "Streams paused because their client is not reading.",
             self.num_paused),
            ("preprocess_queue_depth", "Requests waiting for preprocessing.",
             g["preprocess_light_queued"] + g["preprocess_heavy_queued"]),
            ("preprocess_pixels", "Decoded image pixels held by preprocessing.",
             g["preprocess_pixels"]),
            ("encoder_queue_depth", "Image requests waiting for the encoder.",
             g["encoder_pending"]),
            ("encoder_embeddings_held", "Encoded images held for prefill.", g["encoder_held"]),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use.",
             1.0 - g["kv_blocks_free"] / total),
            ("encoder_sms", "SMs of the encoder stage.", enc),
            ("decoder_sms", "SMs of the decoder stage.", dec),
            ("device_sms", "SMs of the device.", self._device_sms),
            ("engine_steps_total", "Engine steps run.", self.engine.num_steps),
            ("encoder_cache_usage_bytes", "Bytes of embeddings the encoder cache keeps.",
             int(getattr(getattr(self.engine, "encoder_cache", None), "bytes_cached", 0))),
            ("prefix_cache_blocks", "KV blocks committed to the prefix cache (in use or free).",
             int(getattr(getattr(self.engine, "block_manager", None), "num_cached", 0))),
        ]

    def counters(self) -> list[tuple[str, str, int]]:
        """The engine's cache and work counters, as Prometheus counters (name, help, value)."""
        fn = getattr(self.engine, "counters", None)
        c = fn() if callable(fn) else {}
        return [(name, help_text, c[key]) for key, name, help_text in ENGINE_COUNTERS if key in c]

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self.pool.shutdown()


def _engine_dead(exc: BaseException) -> bool:
    """Whether a step's exception leaves the engine unable to run any step (a tensor-parallel
    group that lost a worker)."""
    from spaceserve.runtime.tp.group import TensorParallelError

    return isinstance(exc, TensorParallelError)
