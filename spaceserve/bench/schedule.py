"""One benchmark run: a workload's requests sent on their arrival schedule, their results
collected (cut at a deadline), the SM split timeline sampled, the metrics summarised."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from spaceserve.bench.backends import chat_body
from spaceserve.bench.metrics import Result, summarize_results
from spaceserve.bench.report.timeline import poll_split, thin_timeline
from spaceserve.bench.workload import ServeWorkload, build_requests
from spaceserve.runtime.policy.slo import Slo

CUT = "unfinished at the time limit"


async def _collect(tasks: list[asyncio.Future], reqs: list[Any], t0: float,
                   deadline: float | None) -> list[Result]:
    """Every task's result; with a `deadline` (monotonic), the ones still running then are
    cancelled (their requests aborted) and count as failed."""
    if deadline is None or not tasks:
        return list(await asyncio.gather(*tasks))
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return [Result(r.idx, r.kind, r.resolution, t0 + r.arrival, error=CUT) if t in pending
            else t.result() for r, t in zip(reqs, tasks, strict=False)]


async def run_one(backend: Any, workload: ServeWorkload, model: str, slo: Slo | None,
                  client: Any = None, *, deadline: float | None = None,
                  drain_s: float | None = None) -> dict[str, Any]:
    """Send one workload on schedule; metrics, per-request results and the split timeline.

    `deadline` (time.monotonic()): requests due later are not sent (counted as "unsent"), and
    those unfinished then are aborted and fail with `CUT`, so a run ends in time. `drain_s`
    sets such a deadline that long after the arrival window."""
    reqs = build_requests(workload)
    make = getattr(backend, "body", None)
    # images encoded (or token prompts drawn) before the clock starts
    bodies = [make(r, model) if make is not None else chat_body(r, model) for r in reqs]
    t0 = time.monotonic()
    if drain_s is not None:
        end_by = t0 + workload.duration_s + drain_s
        deadline = end_by if deadline is None else min(deadline, end_by)
    polled: list[dict[str, float]] = []
    poller = asyncio.ensure_future(poll_split(backend, polled, t0)) \
        if getattr(backend, "poll_metrics", False) else None
    tasks = []
    for r, body in zip(reqs, bodies, strict=True):
        if deadline is not None and t0 + r.arrival >= deadline:
            break
        delay = t0 + r.arrival - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(backend.send(r, body)))
    results = await _collect(tasks, reqs, t0, deadline)
    end = time.monotonic()
    if poller is not None:
        poller.cancel()
    if client is not None:
        polled = [{"t": s.time - t0, "encoder_sms": s.encoder_sms, "decoder_sms": s.decoder_sms}
                  for s in list(client.timeline) if t0 <= s.time <= end]
    unsent = reqs[len(tasks):]
    metrics = summarize_results(results, slo, t0, duration=end - t0,
                                window_s=workload.duration_s,
                                unsent_images=sum(r.kind == "image" for r in unsent))
    return {"rate": workload.request_rate, "num_requests": len(tasks), "unsent": len(unsent),
            "metrics": metrics, "timeline": thin_timeline(polled), "results": results, "t0": t0}
