"""A chat request's preprocessing, as the server runs it: cheap checks first, in the light lane
of the pool (text bounds, template, media counts, then media bytes and headers and the
per-request pixel budget), then, for requests with images or videos, a lease on the server's
pixel budget (429 when taken) and decoding in the heavy lane, ordered by decoding work (text
longer than 64 KiB is tokenised there too, weighted by its bytes); all under one deadline from
the request's arrival (503 when it passes or a lane's queue is full). Remote media download on
the fetcher's own threads while the request waits on the event loop, so a slow media host
never holds a lane's worker. The part of the lease its pixel values need stays held by the
request's handle until its first output (its media are encoded then) or its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from spaceserve.runtime.inputs import DeadlineExceeded, ImageLimits, InputError, VideoLimits
from spaceserve.runtime.inputs import QueueFull as PoolFull
from spaceserve.server.handles import Admission, Handle
from spaceserve.server.openai import protocol as P
from spaceserve.server.openai.protocol import APIError

LIGHT_TEXT_BYTES = 64 * 1024  # longer text-only prompts are tokenised in the heavy lane
# Heavy-lane cost of a byte of text, in pixels: tokenising a byte takes about as long as
# decoding and resizing this many pixels (CPU, tiny tokenizer and Qwen2-VL's image processor).
TEXT_COST = 24


def held_pixels(prompt: dict[str, Any]) -> int:
    """Pixel-equivalents a prompt's preprocessed pixel values hold (values over 3 channels),
    images and videos."""
    return sum(int(pv.numel()) // 3 for pv in (prompt.get("pixel_values"),
                                               prompt.get("pixel_values_videos"))
               if pv is not None)


async def _fetched(plan: Any, deadline: float) -> None:
    """Wait (on the event loop) until the plan's remote media have arrived; DeadlineExceeded
    when the deadline passes first."""
    pending = [asyncio.wrap_future(f) for f in plan.fetching]
    if not pending:
        return
    try:
        _, late = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for f in pending:  # a fetch's error is read_media's to report, not the loop's to log
            if f.done() and not f.cancelled():
                f.exception()
            else:
                f.cancel()
    if late:
        raise DeadlineExceeded("preprocessing did not finish before its deadline")


def pool_error(exc: DeadlineExceeded | PoolFull, what: str, timeout_s: float) -> APIError:
    """The 503 for a preprocessing-pool job that passed its deadline (`what` did not finish
    within `timeout_s`) or found its lane's queue full."""
    if isinstance(exc, PoolFull):
        return APIError(503, f"server busy: {exc}; retry later", type="server_error",
                        code="queue_full", retry_after=exc.retry_after)
    return APIError(503, f"{what} did not finish within {timeout_s:g} s; retry later",
                    type="server_error", code="preprocess_timeout")


async def prepare_chat_request(client: Admission, preprocessor: Any,
                               req: P.ChatCompletionRequest, handle: Handle,
                               limits: ImageLimits, params: Callable[[Any], Any], *,
                               timeout_s: float, max_text_bytes: int | None,
                               context_len: int | None,
                               video_limits: VideoLimits | None = None, fetcher: Any = None,
                               on_body_done: Callable[[], Any] = lambda: None,
                               deadline: float | None = None) -> None:
    """Preprocess `req` and add it to the engine through `handle` (`params(prompt)` gives its
    sampling parameters); APIError for what the client got wrong or the server cannot take
    now, Cancelled if the server ends the request meanwhile. http(s) media go to `fetcher`
    (refused without one). Afterwards the request's message text is dropped and
    `on_body_done()` called (the body's memory is free). `deadline` (monotonic clock; by
    default `timeout_s` from now) is the request's, set when its body arrived: parsing took
    part of it already."""
    if deadline is None:
        deadline = time.monotonic() + timeout_s
    plan = None

    def read_job(plan: Any) -> Any:
        P.read_chat(preprocessor, plan, light_text_bytes=LIGHT_TEXT_BYTES)
        if plan.prompt is not None:  # text only: tokenised already, add it in the same job
            handle.add(plan.prompt, params, stream=req.stream)
        return plan

    def start_job() -> bool:
        """Start the plan; read its media now unless remote ones are still on their way
        (whether it read them: the fetches may finish any time after this looks)."""
        nonlocal plan
        plan = P.start_chat(preprocessor, req, limits, video_limits, fetcher=fetcher,
                            max_text_bytes=max_text_bytes, context_len=context_len)
        if plan.fetching:
            return False
        read_job(plan)
        return True

    try:
        read = await handle.wait(client.pool.run(start_job, lane="light", deadline=deadline))
        if not read:  # remote media on their way: wait here, not in a lane
            await handle.wait(_fetched(plan, deadline))
            await handle.wait(client.pool.run(lambda: read_job(plan), lane="light",
                                              deadline=deadline))
        if plan.prompt is not None:
            return
        if not plan.media:  # a long text: tokenised in the heavy lane, by its size
            await handle.start(lambda: P.finish_chat(preprocessor, plan, deadline), params,
                               stream=req.stream, lane="heavy", cost=TEXT_COST * plan.text_bytes,
                               deadline=deadline)
            return
        try:
            lease = client.pixels.acquire(plan.pixels, what=plan.describe())
        except InputError as exc:
            raise P.input_error(exc) from None

        def finish_job() -> Any:
            prompt = P.finish_chat(preprocessor, plan, deadline)
            # until they are encoded, the pixel values stay on the budget (values / 3 channels)
            handle.hold(lease.split(held_pixels(prompt)))
            return prompt

        await handle.start(finish_job, params, stream=req.stream, lane="heavy",
                           cost=plan.work, deadline=deadline, on_done=lease.release)
    except (DeadlineExceeded, PoolFull) as exc:
        raise pool_error(exc, "preprocessing", timeout_s) from None
    finally:
        if plan is not None:
            plan.close()  # remote fetches still running, if the request ends early
        req.messages.clear()  # the prompt holds what is needed: drop the body's text
        on_body_done()
