"""Admission before the body, read timeouts, request ids and the one JSON error handler: a
pure ASGI middleware in front of the routes.

- Every request gets an id (``X-Request-Id``: the client's when it is a short token, else a
  new one), echoed in the response headers and in any 500.
- While the server drains (`draining()`), every request but ``/health`` gets 503 with
  ``Retry-After`` and ``Connection: close``.
- A POST to a generation route (`GENERATION_PATHS`) first asks `at_door()`: an `APIError`
  (SLO-aware admission's 503 ``overloaded``) is answered before a byte of the body is read,
  so a server past saturation sheds a request for the price of its headers.
- A body larger than `small_body_bytes` (or of unknown length) must first reserve its declared
  size (`max_body_bytes` when chunked) from a byte budget shared by all requests
  (`body_budget_bytes`); a reservation waits at most `body_wait_s` and is held until the route
  says it is done with the body (`release_body`, after preprocessing) or the response ends.
  Without room: 503 with ``Retry-After``, the body unread. Small bodies pass freely: their
  memory is bounded by the connection cap. So buffered bodies never exceed
  ``body_budget_bytes + max_connections * small_body_bytes``.
- The body must keep arriving: no chunk for `body_idle_timeout_s`, or not all of it within
  `body_timeout_s`, is a 408 that closes the connection (`BodyTimeout`).
- Any exception a route lets escape becomes a JSON 500 naming the request id; the traceback is
  logged once and the connection stays usable (Starlette's error middleware, which re-raises
  and makes uvicorn drop the connection, never sees it). A stream that fails after its start
  is ended cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spaceserve.server.openai.protocol import APIError

log = logging.getLogger("spaceserve.server")
_RID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
BODY_METHODS = ("POST", "PUT", "PATCH")
_IDS = random.Random()  # seeded from os.urandom once (again in a forked child); see new_id
os.register_at_fork(after_in_child=_IDS.seed)


def new_id(prefix: str, digits: int = 32) -> str:
    """A fresh id: `prefix` and `digits` random hex digits. Not uuid4, whose os.urandom
    releases the GIL and so waits up to a switch interval to take it back: on a busy server
    that stalled the event loop for milliseconds per request."""
    return f"{prefix}{_IDS.getrandbits(4 * digits):0{digits}x}"

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(frozen=True)
class GuardLimits:
    """The middleware's bounds (see the module docstring)."""

    max_body_bytes: int = 32 * 1024 * 1024
    small_body_bytes: int = 64 * 1024
    body_budget_bytes: int = 64 * 1024 * 1024
    body_wait_s: float = 2.0
    body_idle_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "small_body_bytes", "body_budget_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        for name in ("body_wait_s", "body_idle_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(f"body_budget_bytes={self.body_budget_bytes} must be at least "
                             f"max_body_bytes={self.max_body_bytes} (one full body fits)")


class BodyTimeout(APIError):
    """The body stopped arriving: 408, and the connection closes."""

    def __init__(self, message: str) -> None:
        super().__init__(408, message, code="request_timeout", headers={"Connection": "close"})


class BodyBudget:
    """Bytes of request bodies admitted at once (one event loop)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond: asyncio.Condition | None = None

    async def acquire(self, n: int, wait_s: float) -> BodyLease | None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(
                    lambda: self.used + n <= self.capacity), wait_s)
            except asyncio.TimeoutError:
                return None
            self.used += n
        return BodyLease(self, n)

    def _give_back(self, n: int) -> None:
        self.used -= n
        if self._cond is not None:
            cond = self._cond

            async def notify() -> None:
                async with cond:
                    cond.notify_all()

            asyncio.ensure_future(notify())


class BodyLease:
    def __init__(self, budget: BodyBudget, n: int) -> None:
        self.budget, self.n, self.held = budget, n, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.budget._give_back(self.n)


def release_body(scope_state: Any) -> None:
    """Give back the request's body reservation (a route calls this once it no longer holds
    the body or anything as large made from it)."""
    lease = scope_state.get("body_lease") if isinstance(scope_state, dict) else \
        getattr(scope_state, "body_lease", None)
    if lease is not None:
        lease.release()


def request_id(scope: dict[str, Any]) -> str:
    """The id of the request `scope` (set by the middleware)."""
    return scope.get("state", {}).get("request_id") or "-"


def _error_body(status: int, message: str, code: str, rid: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code},
                       "request_id": rid}).encode()


async def send_error(send: Callable, status: int, message: str, code: str, rid: str, *,
                     retry_after: float | None = None, close: bool = False) -> None:
    """A complete JSON error response through ASGI `send`."""
    body = _error_body(status, message, code, rid)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, int(-(-retry_after // 1)))).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class AdmissionMiddleware:
    """See the module docstring. `on_error(status)` counts the errors it answers itself."""

    def __init__(self, app: Any, *, limits: GuardLimits | None = None,
                 draining: Callable[[], bool] = lambda: False,
                 on_error: Callable[[int], None] | None = None,
                 at_door: Callable[[dict[str, Any]], APIError | None] | None = None,
                 left_door: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.app = app
        self.limits = limits or GuardLimits()
        self.budget = BodyBudget(self.limits.body_budget_bytes)
        self.draining = draining
        self.on_error = on_error or (lambda status: None)
        self.at_door, self.left_door = at_door, left_door

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _RID.fullmatch(given) else new_id("req-", 16)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        started = complete = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + \
                    [(b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        # A response before an unread body keeps the connection: uvicorn then reads the rest
        # and drops it (bounded by the header deadline), so the client can finish sending and
        # read the answer instead of meeting a reset.
        unread = scope.get("method") in BODY_METHODS and headers.get(b"content-length") != b"0"
        if self.draining() and scope.get("path") != "/health":
            self.on_error(503)
            await send_error(tracked_send, 503, "the server is shutting down; retry on another "
                             "replica or later", "draining", rid, retry_after=1,
                             close=not unread)
            return
        door = self.at_door is not None and scope.get("method") == "POST" and \
            scope.get("path") in GENERATION_PATHS
        if door:
            refused = self.at_door(state)
            if refused is not None:
                self.on_error(refused.status)
                await send_error(tracked_send, refused.status, refused.message,
                                 refused.code or "overloaded", rid,
                                 retry_after=refused.retry_after, close=not unread)
                return
        lease = None
        if scope.get("method") in BODY_METHODS:
            lease = await self._admit_body(headers)
            if lease is False:
                self.on_error(503)
                await send_error(tracked_send, 503, "the server is reading as many request "
                                 "bodies as it buffers at once; retry later", "server_busy",
                                 rid, retry_after=1)
                return
            state["body_lease"] = lease
        try:
            await self.app(scope, self._timed(receive), tracked_send)
        except Exception as exc:  # the one place an unexpected error becomes a response
            log.error("request %s %s %s failed", rid, scope.get("method"), scope.get("path"),
                      exc_info=exc)
            if not started:
                self.on_error(500)
                await send_error(tracked_send, 500, f"internal server error (request id {rid})",
                                 "internal_error", rid)
            elif not complete:
                try:  # end a chunked stream cleanly; the client sees it stop
                    await tracked_send({"type": "http.response.body", "body": b"",
                                        "more_body": False})
                except Exception:  # the transport is gone: nothing more to do
                    pass
        finally:
            if lease:
                lease.release()
            if door and self.left_door is not None:
                self.left_door(state)

    async def _admit_body(self, headers: dict[bytes, bytes]) -> BodyLease | None | bool:
        """None: a small body (no reservation); a lease; False: no room in time."""
        lim = self.limits
        declared = headers.get(b"content-length", b"").decode("latin-1").strip()
        size = int(declared) if declared.isdigit() and len(declared) < 19 else None
        if size is not None and (size <= lim.small_body_bytes or size > lim.max_body_bytes):
            return None  # small, or refused by its declared size before any byte is read
        lease = await self.budget.acquire(size or lim.max_body_bytes, lim.body_wait_s)
        return lease if lease is not None else False

    def _timed(self, receive: Callable) -> Callable:
        """`receive` that raises BodyTimeout when the body stalls or takes too long."""
        lim = self.limits
        deadline = time.monotonic() + lim.body_timeout_s
        done = False

        async def timed_receive() -> dict[str, Any]:
            nonlocal done
            if done:
                return await receive()
            left = deadline - time.monotonic()
            wait = min(lim.body_idle_timeout_s, left)
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except asyncio.TimeoutError:
                why = (f"no request body data for {lim.body_idle_timeout_s:g} s" if
                       wait < left else f"the request body took over {lim.body_timeout_s:g} s")
                raise BodyTimeout(why) from None
            if message["type"] != "http.request" or not message.get("more_body"):
                done = True
            return message

        return timed_receive
