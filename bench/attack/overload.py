"""Overload a live tiny server running SLO-aware admission and check that it fails fast.

    PYTHONPATH=. python -m bench.attack.overload [--factor 3] [--duration 30] [--json out.json]

Starts ``spaceserve serve --model tiny --admission slo --slo ttft:T,tpot:P`` on 127.0.0.1,
measures what it sustains (`--calibrate` closed-loop streams of small image requests: completed
requests per second), then sends Poisson arrivals at `--factor` x that rate for `--duration`
seconds from 16 client addresses (127.0.0.2-17; many clients, not one past its connection
bound), every request a streamed chat completion with one small PNG. It records, per request,
the HTTP status, the time to the first content chunk (TTFT) of the served ones and the time to
the answer of the refused ones, then reads /metrics once everything has ended. Checks (issue
35): every request gets an answer (200 or 503 with Retry-After), the p99 TTFT of the served
ones is within 2x the TTFT bound, the requests refused at arrival get their 503 in under
100 ms (p99), and the gauges are back to 0 (nothing leaks). Requests ended while they waited
(admitted, then predicted to miss) get their 503 once that is known; they are counted and
timed apart (``ended_while_waiting``). Exit status 1 if a check fails.

The load generator shares the server's CPU on one machine, so it keeps its own time small:
aiohttp (a C HTTP parser), bodies serialised before the clock starts, its start-up objects
frozen out of the garbage collector, and ``lag_s`` records how late it sent each request.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import gc
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from bench.attack.run import wait_healthy

GAUGES = ("num_requests_waiting", "num_requests_running", "num_requests_in_flight",
          "encoder_queue_depth", "encoder_embeddings_held", "kv_cache_usage_perc")


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * 0.99
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@functools.lru_cache(maxsize=16)
def png_url(seed: int, size: int = 112) -> str:
    """One of 16 small solid PNGs as a data URL (made once: the client's CPU is the server's
    on one machine)."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(model: str, seed: int, max_tokens: int) -> bytes:
    """One request's JSON body, serialised before the clock starts."""
    return json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_url(seed % 16)}},
            {"type": "text", "text": f"describe picture {seed}"}]}]}).encode()


CLIENTS = 16  # arrivals come from this many client addresses, 127.0.0.2 and on


def session(url: str, timeout: float, client: int = 0) -> Any:
    """An aiohttp session (its C HTTP parser keeps the load generator's own time small; the
    server's CPU is the client's on one machine) from client address 127.0.0.(2 + `client`):
    the arrivals are many clients', each under the server's per-client connection bound."""
    import aiohttp

    return aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=timeout),
                                 connector=aiohttp.TCPConnector(
                                     limit=0, local_addr=(f"127.0.0.{2 + client}", 0)))


async def one(http: Any, payload: bytes) -> dict[str, Any]:
    """Send one streamed request: status, Retry-After, TTFT or time to the refusal, from the
    moment it is sent."""
    import aiohttp

    t0 = time.monotonic()
    try:
        async with http.post("/v1/chat/completions", data=payload,
                             headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                text = await r.read()
                return {"status": r.status, "answer_s": time.monotonic() - t0,
                        "retry_after": r.headers.get("retry-after"),
                        "while_waiting": b"can no longer meet" in text}
            ttft = None
            error = False
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data: {"):
                    continue
                if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                    ttft = time.monotonic() - t0
                if line.startswith(b'data: {"error"'):
                    error = True
                    break
            return {"status": 200, "ttft_s": ttft, "stream_error": error,
                    "e2e_s": time.monotonic() - t0}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}",
                "answer_s": time.monotonic() - t0}


async def calibrate(url: str, model: str, seconds: float, streams: int,
                    max_tokens: int) -> float:
    """Requests per second the server completes with `streams` closed-loop clients."""
    done = 0
    end = time.monotonic() + seconds

    async def client(http: Any, k: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < end:
            res = await one(http, body(model, 10_000 * k + i, max_tokens))
            i += 1
            if res["status"] == 200:
                done += 1

    t0 = time.monotonic()
    sessions = [session(url, 60, c) for c in range(CLIENTS)]
    try:
        await asyncio.gather(*(client(sessions[k % CLIENTS], k) for k in range(streams)))
    finally:
        for http in sessions:
            await http.close()
    return done / (time.monotonic() - t0)


async def flood(url: str, model: str, rate: float, duration: float, max_tokens: int,
                seed: int = 0) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate` for `duration` s; each result records `lag_s`, how late the
    load generator sent it against its schedule."""
    rng = random.Random(seed)
    times, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        times.append(t)
    payloads = [body(model, i, max_tokens) for i in range(len(times))]

    sessions = [session(url, 120, c) for c in range(CLIENTS)]
    try:
        tasks = []
        t0 = time.monotonic()
        for i, t in enumerate(times):
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            lag = time.monotonic() - (t0 + t)
            task = asyncio.ensure_future(one(sessions[i % CLIENTS], payloads[i]))
            tasks.append((task, lag))
        out = []
        for task, lag in tasks:
            res = await task
            res["lag_s"] = lag
            out.append(res)
        return out
    finally:
        for http in sessions:
            await http.close()


def gauges(url: str) -> dict[str, float]:
    from spaceserve.server.metrics import parse_gauges

    text = httpx.get(url + "/metrics", timeout=10).text
    g = {k.removeprefix("spaceserve:"): v for k, v in parse_gauges(text).items()}
    shed = {line.split('"')[1]: int(line.split()[-1]) for line in text.splitlines()
            if line.startswith("spaceserve:requests_shed_total{")}
    # the engine's own TTFT (from add_request): the p99's histogram bucket, whole run
    buckets = [(float(line.split('"')[1]), int(line.split()[-1])) for line in text.splitlines()
               if line.startswith("spaceserve:time_to_first_token_seconds_bucket{")]
    total = buckets[-1][1] if buckets else 0
    p99_le = next((le for le, n in buckets if total and n >= 0.99 * total), float("nan"))
    return {**{k: g.get(k, float("nan")) for k in GAUGES}, "shed": shed,
            "engine_ttft_p99_le_s": p99_le}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--factor", type=float, default=3.0, help="arrivals x sustained rate")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--calibrate", type=float, default=10.0, help="seconds measuring")
    ap.add_argument("--streams", type=int, default=48,
                    help="closed-loop clients measuring (enough to saturate the batch)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slo", default="ttft:1000,tpot:200")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from spaceserve.runtime.policy.slo import Slo

    bound_s = Slo.parse(args.slo).ttft / 1e3
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "spaceserve.cli", "serve", "--model", "tiny", "--port",
           str(args.port), "--log-level", "warning", "--admission", "slo", "--slo", args.slo]
    log = tempfile.TemporaryFile("w+")  # the server's log (a pipe nobody reads could fill)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True,
                            start_new_session=True)
    proc.stderr = log  # wait_healthy reads it if the server exits
    try:
        wait_healthy(url, proc)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        sustained = asyncio.run(calibrate(url, model, args.calibrate, args.streams,
                                          args.max_tokens))
        rate = args.factor * sustained
        gc.collect()
        gc.freeze()  # the load generator's own collections stay short too
        t0 = time.monotonic()
        res = asyncio.run(flood(url, model, rate, args.duration, args.max_tokens))
        took = time.monotonic() - t0
        time.sleep(1.0)  # the last requests' ends reach the gauges
        after = gauges(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.seek(0)
    server_errors = [ln for ln in log.read().splitlines() if "Error" in ln or "error" in ln]
    served = [r for r in res if r["status"] == 200 and not r.get("stream_error")]
    ttfts = [r["ttft_s"] for r in served if r.get("ttft_s") is not None]
    shed = [r for r in res if r["status"] == 503]
    other = [r for r in res if r["status"] not in (200, 503)]
    stream_errors = [r for r in res if r.get("stream_error")]
    shed_s = [r["answer_s"] for r in shed]
    at_arrival = [r["answer_s"] for r in shed if not r.get("while_waiting")]
    ended = [r["answer_s"] for r in shed if r.get("while_waiting")]
    out = {"slo": args.slo, "sustained_rps": sustained, "arrival_rps": rate,
           "duration_s": args.duration, "wall_s": took, "requests": len(res),
           "served": len(served), "shed": len(shed), "other": len(other),
           "stream_errors": len(stream_errors),
           "served_ttft_p99_s": p99(ttfts), "served_ttft_mean_s":
               sum(ttfts) / len(ttfts) if ttfts else float("nan"),
           "client_lag_p99_s": p99([r["lag_s"] for r in res]),
           "client_lag_max_s": max((r["lag_s"] for r in res), default=0.0),
           "shed_answer_p99_s": p99(shed_s), "shed_answer_max_s": max(shed_s, default=0.0),
           "refused_at_arrival": len(at_arrival), "refused_answer_p99_s": p99(at_arrival),
           "ended_while_waiting": len(ended), "ended_answer_p99_s": p99(ended),
           "shed_without_retry_after": sum(1 for r in shed if not r.get("retry_after")),
           "gauges_after": after, "errors": [r.get("error") or r["status"] for r in other][:5],
           "server_errors": server_errors[:20]}
    checks = {
        "every request answered (200 or 503)": not other,
        f"served p99 TTFT <= 2 x {bound_s:g} s": out["served_ttft_p99_s"] <= 2 * bound_s,
        "503 at arrival p99 < 100 ms": not at_arrival or out["refused_answer_p99_s"] < 0.1,
        "every 503 has Retry-After": out["shed_without_retry_after"] == 0,
        "gauges back to 0": all(after[k] == 0 for k in GAUGES),
    }
    out["checks"] = checks
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
