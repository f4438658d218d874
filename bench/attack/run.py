"""Attack a live SpaceServe server on 127.0.0.1 as a hostile client would, and print a table
attack / expected / observed.

    PYTHONPATH=. python -m bench.attack [--quick] [--json out.json] [--port 8321]

Starts ``spaceserve serve --model tiny`` with default flags, plus ``--allowed-local-media-path``
(a temporary folder, so file:// URLs can be attacked at all) and ``--graceful-shutdown-timeout
5`` (for the shutdown attack), then runs, in order (bench/attack/cases.py):

1. prompt-size amplification: concurrent 8 MB text messages;
2. image-decode amplification: requests of eight 4096x4096 solid PNGs, and requests at the
   per-request pixel budget (two 4096x4096 images); the same with videos (a 4K clip whose
   sampled frames are over the budget, two 1080p clips at it);
3. memory before admission: concurrent 30 MB uploads;
4. malformed bodies that used to be 500s (lone surrogates in text and `model`, JSON 5,000 deep);
5. role injection through special tokens; placeholders in text;
6. leaks in messages (object reprs, a file-existence oracle, percent-encoded file URLs);
7. untrusted image formats (EPS, TIFF, a type that lies about the bytes);
8. slowloris: connections that trickle headers or a body, beyond the connection cap in full
   mode;
9. shutdown: SIGTERM with 100 streams in flight;
10. (before 9; bench/attack/bounds.py) one request over the per-request bounds (64 prompts x
    n=128, n=128 x 4000 tokens), and 1000 idle connections from 127.0.0.2 while a client on
    127.0.0.3 is served.

During 1-3 and 8 a "hi" request is sent every 0.25 s on its own connection; its worst latency
must stay under 2 s. The server's RSS is sampled every 20 ms; its peak above the idle baseline
is reported per attack and checked against the bound the README documents. Cases 4-7 are sent
on one keep-alive connection, each followed by a "hi" that must be served on that same
connection. Every count and wait is bounded: the full run takes about two minutes, ``--quick``
(CI: 2 messages of 8 MB, 2 max-size image requests, 200 slow connections, every malformed
case once, the shutdown) under one. Exit status 1 if any row fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

HI_LIMIT_S = 2.0


def rss_bound_mb(body_budget: int = 64 << 20, connections: int = 1000,
                 pixels: int = 4 * 4096 * 4096) -> float:
    """docs/hardening.md's bound on server RSS above idle: bodies with their text and what is
    parsed from them at most 8x (4-byte characters), each connection's buffers and small body
    (~208 KiB), 12 bytes per pixel of the server's pixel budget (float32 pixel values of 3
    channels). Defaults: the server's."""
    return (8 * body_budget + connections * 208 * 1024 + 12 * pixels) / 2**20


RSS_BOUND_MB = round(rss_bound_mb())


@dataclass
class Row:
    attack: str
    expected: str
    observed: str
    ok: bool
    hi_worst_s: float | None = None
    rss_peak_mb: float | None = None


@dataclass
class Ctx:
    """What every attack gets: the server's address, process and model name, and options."""

    url: str
    host: str
    port: int
    model: str
    pid: int
    quick: bool
    media_dir: str
    proc: subprocess.Popen | None = None
    baseline_mb: float = 0.0
    rows: list[Row] = field(default_factory=list)

    def hi(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4} | extra


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RSSWatch:
    """Peak RSS of `pid` while the context is open (sampled every 20 ms on a thread)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> RSSWatch:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


class Probe:
    """Sends "hi" every `interval` s while open, from its own process (bench/attack/probe.py)
    on its own keep-alive connection, so the attack's client work never delays it; records
    latencies (an error counts as infinitely slow)."""

    def __init__(self, ctx: Ctx, interval: float = 0.25) -> None:
        self.ctx, self.interval = ctx, interval
        self.latencies: list[float] = []
        self.errors: list[str] = []

    async def __aenter__(self) -> Probe:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.attack.probe", self.ctx.host, str(self.ctx.port),
             self.ctx.model, str(self.interval)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        first = await asyncio.to_thread(self._proc.stdout.readline)  # connected and served
        if not first:
            raise RuntimeError("the probe did not start")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.sleep(self.interval)  # at least one probe after the attack's end
        out, _ = await asyncio.to_thread(self._proc.communicate, "", 60)
        for line in out.splitlines():
            seconds, status = json.loads(line)
            self.latencies.append(seconds)
            if status != 200:
                self.errors.append(str(status))

    @property
    def worst(self) -> float:
        return float("inf") if self.errors or not self.latencies else max(self.latencies)

    def summary(self) -> str:
        err = f", errors {self.errors[:3]}" if self.errors else ""
        return f"hi x{len(self.latencies)} worst {self.worst:.2f} s{err}"


@contextmanager
def watched(ctx: Ctx):
    """RSS peak (MB above baseline) while the block runs: yields a list filled at exit."""
    out: list[float] = []
    with RSSWatch(ctx.pid) as w:
        yield out
    out.append(max(0.0, w.peak - ctx.baseline_mb))


def start_server(port: int, media_dir: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spaceserve.cli", "serve", "--model", "tiny", "--port",
           str(port), "--log-level", "warning", "--graceful-shutdown-timeout", "5",
           "--allowed-local-media-path", media_dir, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def table(rows: list[Row]) -> str:
    head = ("attack", "expected", "observed", "ok")
    cells = [(r.attack, r.expected, r.observed, "yes" if r.ok else "NO") for r in rows]
    widths = [min(60, max(len(c[i]) for c in [head, *cells])) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))
    return "\n".join(lines)


async def run_all(ctx: Ctx, only: list[str] | None) -> None:
    from bench.attack import cases

    for name, fn in cases.ATTACKS:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            rows = await fn(ctx)
        except Exception as exc:  # an attack that breaks the harness is a failed row
            rows = [Row(name, "runs", f"harness error {type(exc).__name__}: {exc}", False)]
        for r in rows:
            print(f"[{time.monotonic() - t0:5.1f} s] {'ok ' if r.ok else 'BAD'} {r.attack}: "
                  f"{r.observed}", flush=True)
        ctx.rows += rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CI subset (smaller counts)")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--only", nargs="*", help="attack names to run (default: all)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for the server (repeatable)")
    args = p.parse_args(argv)
    media = tempfile.mkdtemp(prefix="spaceserve-attack-")
    proc = start_server(args.port, media, args.server_arg)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc)
        ctx = Ctx(url, "127.0.0.1", args.port, "tiny", proc.pid, args.quick, media, proc)
        time.sleep(1.0)
        ctx.baseline_mb = rss_mb(proc.pid)
        print(f"server pid {proc.pid}, idle RSS {ctx.baseline_mb:.0f} MB; bound +"
              f"{RSS_BOUND_MB} MB", flush=True)
        asyncio.run(run_all(ctx, args.only))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print()
    print(table(ctx.rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_rss_mb": ctx.baseline_mb, "rss_bound_mb": RSS_BOUND_MB,
                       "quick": args.quick, "rows": [asdict(r) for r in ctx.rows]}, f,
                      indent=1)
    return 0 if ctx.rows and all(r.ok for r in ctx.rows) else 1


if __name__ == "__main__":  # one copy of this module: the attacks import it by name
    from bench.attack.run import main as _main

    sys.exit(_main())
