"""The fair-share rows of `bench.attack`: one client's parallel-sampling requests that would
hold every sequence slot and KV block, and a "hi" from another client beside them.

A chat request with ``n=128, max_tokens=4000`` first runs alone (the reference), then again
with the "hi" probe running beside it from 8 s after its start for 10 s, then eight such
requests at once with the probe (``--quick``: the one request only, of 300 tokens, the probe
from 2 s for 3 s: still long enough to hold every slot and block past the "hi" bound). Each
"hi" must be answered within 2 s, and every big request must end with the reference's 128
choices (the same seed: the same texts and finish reasons), however much of it was preempted
for the "hi". With ``--server-arg=--no-fair-share`` (first-come first-served) the "hi" waits.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bench.attack.run import HI_LIMIT_S, Ctx, Probe, Row

N, MAX_TOKENS, QUICK_TOKENS = 128, 4000, 300
WARM_S, PROBE_S, QUICK_WARM_S, QUICK_PROBE_S = 8.0, 10.0, 2.0, 3.0


def big_body(ctx: Ctx) -> dict[str, Any]:
    return {"model": ctx.model, "messages": [{"role": "user", "content": "tell me a story"}],
            "n": N, "max_tokens": QUICK_TOKENS if ctx.quick else MAX_TOKENS, "seed": 1234,
            "temperature": 1.0}


async def _big(ctx: Ctx, client: httpx.AsyncClient) -> tuple[int, list[tuple] | str, float]:
    """(status, the choices as (index, text, finish reason) or the error, seconds)."""
    t0 = time.monotonic()
    r = await client.post("/v1/chat/completions", json=big_body(ctx))
    took = time.monotonic() - t0
    if r.status_code != 200:
        return r.status_code, r.text[:200], took
    choices = sorted((c["index"], c["message"]["content"], c["finish_reason"])
                     for c in r.json()["choices"])
    return 200, choices, took


async def _with_probe(ctx: Ctx, count: int) -> tuple[Probe, list[tuple[int, Any, float]]]:
    """`count` big requests at once, each on its own connection; the probe runs from
    `WARM_S` after their start for `PROBE_S`."""
    limits = httpx.Limits(max_connections=count + 2)
    async with httpx.AsyncClient(base_url=ctx.url, timeout=3600, limits=limits) as c:
        tasks = [asyncio.ensure_future(_big(ctx, c)) for _ in range(count)]
        await asyncio.sleep(QUICK_WARM_S if ctx.quick else WARM_S)
        probe = Probe(ctx)
        async with probe:
            await asyncio.sleep(QUICK_PROBE_S if ctx.quick else PROBE_S)
        return probe, await asyncio.gather(*tasks)


async def attack_fair_share(ctx: Ctx) -> list[Row]:
    tokens = QUICK_TOKENS if ctx.quick else MAX_TOKENS
    async with httpx.AsyncClient(base_url=ctx.url, timeout=3600) as c:
        status, ref, alone_s = await _big(ctx, c)
    if status != 200:
        return [Row("10 fair share: the reference run", "200", f"{status} {ref}", False)]
    rows = []
    for count in (1,) if ctx.quick else (1, 8):
        probe, res = await _with_probe(ctx, count)
        same = sum(1 for s, choices, _ in res if s == 200 and choices == ref)
        slowest = max(t for _, _, t in res)
        ok = probe.worst < HI_LIMIT_S and same == count
        rows.append(Row(
            f"10 fair share: {count} x chat n={N} max_tokens={tokens} (one client), \"hi\" from "
            "another", f"hi < {HI_LIMIT_S:.0f} s; each big = its run alone",
            f"{probe.summary()}; {same}/{count} equal to the run alone ({alone_s:.0f} s), "
            f"slowest {slowest:.0f} s", ok, hi_worst_s=probe.worst))
    return rows


__all__ = ["attack_fair_share", "big_body"]
