"""What the HTTP server adds per request over in-process `Engine.generate`, at low load.

One request at a time (no queueing), the same chat prompt and sampling parameters both ways:

- in-process: the prompt rendered and tokenised by the same `ChatPreprocessor`, then
  ``engine.generate`` on the caller's thread;
- server: ``POST /v1/chat/completions`` (non-streaming) to uvicorn on loopback over one
  keep-alive connection (``http.client``, the lightest client), through parsing, validation,
  the worker pool, the engine thread and JSON encoding.

Both paths run the same engine in alternating rounds (the in-process rounds while the server's
engine thread is idle), so slow drift of a shared CPU hits both alike. Reported: median latency
of each path and their difference; goal <= 2 ms (CPU).

    PYTHONPATH=. python3 bench/serving/server_overhead.py [--model tiny] [--requests 200]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from typing import Any

from spaceserve.runtime.core.request import SamplingParams
from spaceserve.server.app import ServerThread, create_app
from spaceserve.server.engine_client import AsyncEngine, load_engine
from spaceserve.server.openai.protocol import chat_messages, parse_request

GOAL_MS = 2.0


def _wait_idle(client: AsyncEngine, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while client.engine.has_unfinished() and time.monotonic() < end:
        time.sleep(0.001)


def measure(engine: Any, pre: Any, *, requests: int = 200, max_tokens: int = 4,
            rounds: int = 4, text: str = "Describe this image.") -> dict[str, float]:
    """Median ms per request in-process and through the server, and the difference."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    raw = json.dumps(body).encode()
    prompt = pre.encode(pre.render(chat_messages(parse_request(raw)))[0], [])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    client = AsyncEngine(engine)
    local: list[float] = []
    remote: list[float] = []
    try:
        with ServerThread(create_app(client, pre, model_name="m")) as srv:
            conn = http.client.HTTPConnection(srv.host, srv.port)
            headers = {"Content-Type": "application/json"}
            per_round = max(1, requests // rounds)
            for _ in range(2):  # warm-up of both paths
                engine.generate(dict(prompt), params)
                conn.request("POST", "/v1/chat/completions", raw, headers)
                conn.getresponse().read()
            for _ in range(rounds):
                _wait_idle(client)
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    # rendering + tokenising is part of the in-process path too
                    p = pre.encode(pre.render(chat_messages(parse_request(raw)))[0], [])
                    engine.generate(p, params)
                    local.append(time.perf_counter() - t0)
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    conn.request("POST", "/v1/chat/completions", raw, headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    remote.append(time.perf_counter() - t0)
                    if resp.status != 200:
                        raise RuntimeError(f"server answered {resp.status}: {data[:200]!r}")
            conn.close()
    finally:
        client.close()
    lo, hi = 1e3 * statistics.median(local), 1e3 * statistics.median(remote)
    return {"inprocess_ms": lo, "server_ms": hi, "overhead_ms": hi - lo,
            "requests": len(local), "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    engine, pre, _ = load_engine(args.model, device="cpu", num_kv_blocks=256)
    r = measure(engine, pre, requests=args.requests, max_tokens=args.max_tokens)
    verdict = "ok" if r["overhead_ms"] <= GOAL_MS else "OVER GOAL"
    print(f"{r['requests']} requests of {r['max_tokens']} tokens each way, one at a time")
    print(f"in-process generate: {r['inprocess_ms']:.3f} ms   server (HTTP, loopback): "
          f"{r['server_ms']:.3f} ms   overhead: {r['overhead_ms']:.3f} ms "
          f"(goal <= {GOAL_MS} ms: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
