"""The SM split over a benchmark run: scraped from a server's /metrics (HTTP backend), or read
from the in-process engine thread's timeline, then thinned to its changes."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any


async def poll_split(backend: Any, samples: list[dict[str, float]], t0: float,
                     period: float | None = None) -> None:
    """Append the server's encoder / decoder SMs (from its /metrics) to `samples` every
    `period` seconds (default: the backend's POLL_S, else 0.1) until cancelled; `t` is
    seconds since `t0` (monotonic)."""
    from spaceserve.server.metrics import parse_gauges

    while True:
        try:
            g = parse_gauges(await backend.metrics_text())
            samples.append({"t": time.monotonic() - t0,
                            "encoder_sms": g.get("spaceserve:encoder_sms", math.nan),
                            "decoder_sms": g.get("spaceserve:decoder_sms", math.nan)})
        except Exception:  # a missed scrape is a gap in the timeline, not a failure
            pass
        await asyncio.sleep(period or getattr(backend, "POLL_S", 0.1))


def thin_timeline(samples: list[dict[str, float]], period: float = 0.1) -> list[dict[str, float]]:
    """Keep split changes and one sample per `period` otherwise."""
    out: list[dict[str, float]] = []
    for s in samples:
        if not out or (s["encoder_sms"], s["decoder_sms"]) != (
                out[-1]["encoder_sms"], out[-1]["decoder_sms"]) or s["t"] - out[-1]["t"] >= \
                period:
            out.append(s)
    return out
