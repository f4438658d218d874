"""The attacks of `bench.attack` on the per-request and per-client bounds (docs/hardening.md):

- one request asking for more sequences than one request may run: 64 prompts x ``n=128`` on
  /v1/completions must be a 400 at once naming the parameter, the bound and its flag (one
  ``n=128, max_tokens=4000`` chat is served, fairly: fairness.py);
- many idle connections from one address (127.0.0.2: Linux routes all of 127/8 to the
  loopback, so a client may bind any of it as its source): a client on 127.0.0.3 must still be
  served, within 2 s each time, while another request from 127.0.0.2 gets 503 naming
  ``--max-connections-per-client``.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.attack.run import HI_LIMIT_S, Ctx, Row

ATTACKER, OTHER = "127.0.0.2", "127.0.0.3"


async def attack_request_bounds(ctx: Ctx) -> list[Row]:
    cases = [
        ("10 one request: /v1/completions, 64 prompts x n=128", "/v1/completions",
         {"model": ctx.model, "prompt": ["hi"] * 64, "n": 128, "max_tokens": 16},
         "prompt", "--max-seqs-per-request"),
    ]
    rows = []
    async with httpx.AsyncClient(base_url=ctx.url, timeout=30) as c:
        for name, path, body, param, flag in cases:
            t0 = time.monotonic()
            r = await c.post(path, json=body)
            took = time.monotonic() - t0
            err = r.json().get("error", {}) if r.status_code != 200 else {}
            msg = str(err.get("message", ""))
            ok = r.status_code == 400 and err.get("param") == param and flag in msg \
                and took < HI_LIMIT_S
            rows.append(Row(name, f"400 at once, param {param}, naming {flag}",
                            f"{r.status_code} in {took * 1000:.0f} ms, param "
                            f"{err.get('param')}: {msg[:90]}", ok))
    return rows


async def _idle(ctx: Ctx, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(ctx.host, ctx.port, local_addr=(source, 0))


async def attack_client_connections(ctx: Ctx) -> list[Row]:
    n = 300 if ctx.quick else 1000  # the default bound is 256 per client
    opened = await asyncio.gather(*(_idle(ctx, ATTACKER) for _ in range(n)),
                                  return_exceptions=True)
    conns = [c for c in opened if not isinstance(c, BaseException)]
    try:
        await asyncio.sleep(0.5)  # every connection accepted
        lat, statuses = [], []
        for _ in range(6):  # a "hi" from another address, again and again
            async with httpx.AsyncClient(base_url=ctx.url, timeout=30, transport=httpx.
                                         AsyncHTTPTransport(local_address=OTHER)) as other:
                t0 = time.monotonic()
                r = await other.post("/v1/chat/completions", json=ctx.hi())
                lat.append(time.monotonic() - t0)
                statuses.append(r.status_code)
            await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=ctx.url, timeout=30, transport=httpx.
                                     AsyncHTTPTransport(local_address=ATTACKER)) as same:
            more = await same.post("/v1/chat/completions", json=ctx.hi())
    finally:
        for _, w in conns:
            w.close()
    refused = more.status_code == 503 and "retry-after" in more.headers and \
        "--max-connections-per-client" in more.text
    ok = len(conns) == n and statuses == [200] * len(statuses) and max(lat) < HI_LIMIT_S \
        and refused
    return [Row(f"10 {n} idle connections from {ATTACKER}, a client on {OTHER}",
                f"{OTHER} served < 2 s each time; {ATTACKER}'s next request 503 + Retry-After "
                "naming --max-connections-per-client",
                f"{len(conns)}/{n} open; {OTHER}: {'/'.join(map(str, sorted(set(statuses))))} "
                f"x{len(statuses)}, worst {max(lat):.2f} s; {ATTACKER} again: "
                f"{more.status_code}", ok, max(lat))]


ATTACKS = [("bounds", attack_request_bounds), ("clients", attack_client_connections)]
__all__ = ["ATTACKS"]
