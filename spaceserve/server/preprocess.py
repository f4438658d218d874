"""A chat request's preprocessing, as the server runs it: cheap checks first, in the light lane
of the pool (text bounds, template, image headers and the per-request pixel budget), then, for
requests with images, a lease on the server's pixel budget (429 when taken) and decoding in
the heavy lane, ordered by pixel cost; all under one deadline from the request's arrival
(503 when it passes or a lane's queue is full)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spaceserve.runtime.inputs import DeadlineExceeded, ImageLimits, InputError
from spaceserve.runtime.inputs import QueueFull as PoolFull

from . import protocol as P
from .engine_client import AsyncEngine, RequestHandle
from .protocol import APIError


async def prepare_chat_request(client: AsyncEngine, preprocessor: Any,
                               req: P.ChatCompletionRequest, handle: RequestHandle,
                               limits: ImageLimits, params: Callable[[Any], Any], *,
                               timeout_s: float, max_text_bytes: int | None,
                               context_len: int | None,
                               on_body_done: Callable[[], Any] = lambda: None) -> None:
    """Preprocess `req` and add it to the engine through `handle` (`params(prompt)` gives its
    sampling parameters); APIError for what the client got wrong or the server cannot take
    now, Cancelled if the server ends the request meanwhile. Afterwards the request's message
    text is dropped and `on_body_done()` called (the body's memory is free)."""
    deadline = time.monotonic() + timeout_s

    def plan_job() -> Any:
        plan = P.plan_chat(preprocessor, req, limits, max_text_bytes=max_text_bytes,
                           context_len=context_len)
        if plan.prompt is not None:  # text only: tokenised already, add it in the same job
            handle.add(plan.prompt, params, stream=req.stream)
        return plan

    try:
        plan = await handle.wait(client.pool.run(plan_job, lane="light", deadline=deadline))
        if plan.prompt is not None:
            return
        try:
            lease = client.pixels.acquire(plan.pixels)
        except InputError as exc:
            raise P.input_error(exc) from None
        await handle.start(lambda: P.finish_chat(preprocessor, plan, deadline), params,
                           stream=req.stream, lane="heavy", cost=plan.pixels,
                           deadline=deadline, on_done=lease.release)
    except DeadlineExceeded:
        raise APIError(503, f"preprocessing did not finish within {timeout_s:g} s; retry "
                       "later", type="server_error", code="preprocess_timeout") from None
    except PoolFull as exc:
        raise APIError(503, f"server busy: {exc}; retry later", type="server_error",
                       code="queue_full", retry_after=exc.retry_after) from None
    finally:
        req.messages.clear()  # the prompt holds what is needed: drop the body's text
        on_body_done()
