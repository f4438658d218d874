"""Body shapes and slow readers (rows 10 and 11 of `bench.attack`): bodies cheap in bytes and
costly to parse, and streams whose clients never read.

Row 10 sends each shape alone and then two at once: a chat "hi" carrying an ignored list of
15,000,000 zeros (30 MB), 900,000 empty messages (28 MB), 200,000 empty text parts in one
message, and a /v1/completions prompt of 15,000,000 token ids. Each must get its 4xx within
2 s while ``/health`` (polled every 0.1 s from a thread) answers within 0.5 s, a "hi" within
2 s, and the server's RSS stays within the documented bound. ``--quick`` sends the same sizes
(refused by the pre-scan in milliseconds) but each shape once and two at once only for the
ignored list.

Row 11 opens 100 streams (``top_logprobs: 20``, 2,000 tokens each, a small receive buffer)
whose clients never read: a "hi" must be answered within 2 s and RSS stay bounded (they are
paused after ``--stream-stall-timeout``). Then one seeded stream is read slowly enough to be
paused and resumed (`pauses` counted from ``num_requests_paused``) and must give the same text
as the same request read at once (``--quick``: 20 streams).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from typing import Any

import httpx

from bench.attack.run import HI_LIMIT_S, RSS_BOUND_MB, Ctx, Probe, Row, watched

HEALTH_LIMIT_S = 0.5
PAUSE_WAIT_S = 120.0  # the deaf streams fill the kernel's socket buffers first (MBs each)
ANSWER_LIMIT_S = 2.0


class HealthProbe:
    """``GET /health`` every `interval` s on its own connection, from a thread, while open:
    the worst latency (an error counts as infinitely slow)."""

    def __init__(self, ctx: Ctx, interval: float = 0.1) -> None:
        self.ctx, self.interval = ctx, interval
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.ctx.host, self.ctx.port, timeout=10)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                conn.request("GET", "/health")
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(self.ctx.host, self.ctx.port, timeout=10)
            self.latencies.append(time.monotonic() - t0)
            self.errors += not ok
            self._stop.wait(self.interval)
        conn.close()

    def __enter__(self) -> HealthProbe:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(self.interval)
        self._stop.set()
        self._t.join()

    @property
    def worst(self) -> float:
        return float("inf") if self.errors or not self.latencies else max(self.latencies)


def shape_bodies(model: str, scale: float = 1.0) -> list[tuple[str, str, bytes, int]]:
    """(name, path, body, status expected) of the four shapes, built as bytes (fast); `scale`
    shrinks every count (a unit test's small versions)."""
    m = json.dumps(model).encode()
    big, msgs_n, parts_n = (max(2, int(k * scale)) for k in (15_000_000, 900_000, 200_000))
    hi = b'{"model":' + m + b',"max_tokens":4,"messages":[{"role":"user","content":"hi"}]'
    zeros = hi + b',"ignored":[' + b"0," * (big - 1) + b"0]}"
    msgs = b'{"model":' + m + b',"max_tokens":4,"messages":[' + \
        b'{"role":"user","content":""},' * (msgs_n - 1) + b'{"role":"user","content":""}]}'
    parts = b'{"model":' + m + b',"max_tokens":4,"messages":[{"role":"user","content":[' + \
        b'{"type":"text","text":""},' * (parts_n - 1) + b'{"type":"text","text":""}]}]}'
    ids = b'{"model":' + m + b',"max_tokens":4,"prompt":[' + b"1," * (big - 1) + b"1]}"
    mb = lambda raw: f"{len(raw) / 1e6:.0f} MB"  # noqa: E731
    return [(f"a {big:,}-element ignored list ({mb(zeros)})", "/v1/chat/completions", zeros,
             413),
            (f"{msgs_n:,} empty messages ({mb(msgs)})", "/v1/chat/completions", msgs, 400),
            (f"{parts_n:,} empty parts in one message ({mb(parts)})", "/v1/chat/completions",
             parts, 400),
            (f"a {big:,}-id prompt ({mb(ids)})", "/v1/completions", ids, 400)]


async def _post(ctx: Ctx, path: str, raw: bytes) -> tuple[int, str, float]:
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=ctx.url, timeout=60) as c:
        try:
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return -1, type(exc).__name__, time.monotonic() - t0
    msg = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
    return r.status_code, msg, time.monotonic() - t0


async def attack_shapes(ctx: Ctx) -> list[Row]:
    rows = []
    for i, (name, path, raw, status) in enumerate(shape_bodies(ctx.model)):
        for copies in (1, 2) if not ctx.quick or i == 0 else (1,):
            with watched(ctx) as rss, HealthProbe(ctx) as health:
                async with Probe(ctx) as probe:
                    res = await asyncio.gather(*(_post(ctx, path, raw)
                                                 for _ in range(copies)))
            slowest = max(t for *_, t in res)
            ok = all(s == status for s, _, _ in res) and slowest < ANSWER_LIMIT_S and \
                health.worst < HEALTH_LIMIT_S and probe.worst < HI_LIMIT_S and \
                rss[0] < RSS_BOUND_MB
            rows.append(Row(
                f"10{'abcd'[i]} body: {name}{' x2 at once' if copies > 1 else ''}",
                f"{status} within {ANSWER_LIMIT_S:g} s; /health < {HEALTH_LIMIT_S} s; hi < "
                f"{HI_LIMIT_S:g} s; RSS bounded",
                f"{' '.join(str(s) for s, _, _ in res)} in <= {slowest:.2f} s "
                f"({res[0][1][:60]!r}); /health worst {health.worst:.3f} s; "
                f"{probe.summary()}; RSS +{rss[0]:.0f} MB", ok, probe.worst, rss[0]))
    return rows


def _stream_request(ctx: Ctx, **extra: Any) -> bytes:
    body = json.dumps(ctx.hi(max_tokens=2000, ignore_eos=True, stream=True, logprobs=True,
                             top_logprobs=20, seed=1234) | extra).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {ctx.host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _deaf_socket(ctx: Ctx) -> socket.socket:
    """A connection with a small receive buffer whose owner sends a stream request and never
    reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((ctx.host, ctx.port))
    s.sendall(_stream_request(ctx))
    return s


def _sse_text(raw: bytes) -> tuple[str, bool]:
    """The streamed content of a raw HTTP response (chunked SSE), and whether it ended with
    [DONE]."""
    head, _, body = raw.partition(b"\r\n\r\n")
    text, done = [], False
    for line in body.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            obj = json.loads(line[6:])
            for ch in obj.get("choices", []):
                text.append(ch.get("delta", {}).get("content") or "")
        elif line == b"data: [DONE]":
            done = True
    return "".join(text), done


def _read_all(s: socket.socket, pace: float = 0.0, until: float = 120.0) -> bytes:
    """Read a response to its end (`pace`: sleep between 4 KiB reads)."""
    s.settimeout(until)
    out = bytearray()
    while True:
        part = s.recv(4096)
        if not part:
            break
        out += part
        if out.endswith(b"0\r\n\r\n"):
            break
        if pace:
            time.sleep(pace)
    return bytes(out)


async def _paused(ctx: Ctx) -> int:
    async with httpx.AsyncClient(base_url=ctx.url, timeout=5) as c:
        text = (await c.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("spaceserve:num_requests_paused "):
            return int(float(line.split()[1]))
    return -1


async def attack_slow_readers(ctx: Ctx) -> list[Row]:
    n = 20 if ctx.quick else 100
    socks: list[socket.socket] = []
    paused, most, t0 = 0, 0, time.monotonic()
    with watched(ctx) as rss, HealthProbe(ctx) as health:
        async with Probe(ctx) as probe:
            try:
                for _ in range(n):
                    socks.append(await asyncio.to_thread(_deaf_socket, ctx))
                while time.monotonic() - t0 < PAUSE_WAIT_S and paused < n:
                    await asyncio.sleep(0.5)
                    paused = await _paused(ctx)
                    most = max(most, paused)
                took = time.monotonic() - t0
                await asyncio.sleep(3.0)  # all paused: the server is as idle as before
            finally:
                for s in socks:
                    s.close()
    # the bar of issue 37 is the "hi" and RSS; /health is reported (while the streams still
    # read, 100 x top_logprobs 20 is a real load for a CPU server)
    ok = probe.worst < HI_LIMIT_S and rss[0] < RSS_BOUND_MB and paused == n
    rows = [Row(f"11a {n} SSE streams (top_logprobs 20) whose clients never read",
                f"all paused; hi < {HI_LIMIT_S:g} s; RSS bounded",
                f"{paused}/{n} paused {took:.1f} s after the first opened; /health worst "
                f"{health.worst:.3f} s; {probe.summary()}; RSS +{rss[0]:.0f} MB", ok,
                probe.worst, rss[0])]
    t0 = time.monotonic()  # the deaf streams' requests end when their connections close
    while time.monotonic() - t0 < 30 and await _paused(ctx) != 0:
        await asyncio.sleep(0.25)
    # one seeded stream read at once, and the same read only after it was paused
    ref = await asyncio.to_thread(lambda: _read_all(_sent(ctx)))
    s = await asyncio.to_thread(_deaf_socket, ctx)
    t0, seen = time.monotonic(), 0
    while time.monotonic() - t0 < 30 and seen < 1:
        await asyncio.sleep(0.25)
        seen = await _paused(ctx)
    late = await asyncio.to_thread(_read_all, s)
    s.close()
    (a, a_done), (b, b_done) = _sse_text(ref), _sse_text(late)
    same = a == b and a_done and b_done and len(a) > 0
    rows.append(Row("11b a paused stream whose client reads again", "resumed; same seeded "
                    "text as an uninterrupted stream", f"paused {seen}; {len(b)} chars, "
                    f"{'identical' if same else 'DIFFERENT'} to the uninterrupted stream's "
                    f"{len(a)}", same and seen >= 1))
    return rows


def _sent(ctx: Ctx) -> socket.socket:
    s = socket.create_connection((ctx.host, ctx.port))
    s.sendall(_stream_request(ctx))
    return s


ATTACKS = [("shapes", attack_shapes), ("slow_readers", attack_slow_readers)]
__all__ = ["ATTACKS", "HealthProbe", "attack_shapes", "attack_slow_readers", "shape_bodies"]
