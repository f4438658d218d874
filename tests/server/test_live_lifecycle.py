"""A live server on loopback with the null model: a client that disconnects (streaming or not)
aborts its request and frees its KV blocks; a full queue answers 503 and recovers; image work
runs off the event loop; the per-request overhead over in-process generate stays small."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from spaceserve.server.app import ServerThread

from .conftest import MODEL, make_app, null_engine, wait_until

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 400, "ignore_eos": True}


@pytest.fixture
def slow_server(preprocessor):
    """A server whose engine steps take 5 ms each (400 tokens ~ 2 s)."""
    engine = null_engine(preprocessor, delay=0.005, max_model_len=512)
    client, app = make_app(engine, preprocessor, max_pending=2)
    with ServerThread(app) as server:
        yield engine, client, server
    engine.runner.gate.set()
    client.close()


def idle(engine, client) -> bool:
    return (engine.num_active == 0 and client.num_pending == 0
            and engine.block_manager.num_free == engine.memory.num_blocks)


def raw_post(server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " +
                 str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_streaming_disconnect_aborts_and_frees_blocks(slow_server) -> None:
    engine, client, server = slow_server
    sock = raw_post(server, LONG | {"stream": True})
    got = b""
    while got.count(b"data: ") < 3:  # a few tokens streamed: the request holds blocks
        got += sock.recv(65536)
    assert engine.num_active == 1
    assert engine.block_manager.num_free < engine.memory.num_blocks
    steps = engine.num_steps
    sock.close()
    assert wait_until(lambda: idle(engine, client), timeout=3.0)
    assert engine.num_steps - steps < 200  # stopped long before its 400 tokens
    assert client.metrics.finished.get("abort") == 1
    engine.check_idle()


def test_nonstreaming_disconnect_aborts_and_frees_blocks(slow_server) -> None:
    engine, client, server = slow_server
    sock = raw_post(server, LONG)
    assert wait_until(lambda: engine.block_manager.num_free < engine.memory.num_blocks)
    sock.close()
    assert wait_until(lambda: idle(engine, client), timeout=3.0)
    assert engine.num_steps < 200  # stopped long before its 400 tokens
    assert client.metrics.finished.get("abort") == 1


def test_full_queue_answers_503_and_recovers(slow_server) -> None:
    engine, client, server = slow_server
    engine.runner.gate.clear()  # steps block: admitted requests stay in flight

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            held = [asyncio.ensure_future(http.post("/v1/chat/completions", json=LONG | {
                "max_tokens": 3})) for _ in range(2)]
            assert await asyncio.to_thread(wait_until, lambda: client.num_pending == 2)
            busy = await http.post("/v1/chat/completions", json=LONG)
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "queue_full"
            assert busy.headers["retry-after"] == "1"
            assert (await http.get("/health")).status_code == 200
            engine.runner.gate.set()
            done = await asyncio.gather(*held)
            assert [r.status_code for r in done] == [200, 200]
            again = await http.post("/v1/chat/completions", json=LONG | {"max_tokens": 2})
            assert again.status_code == 200

    asyncio.run(go())
    assert wait_until(lambda: idle(engine, client))


def test_preprocessing_runs_off_the_event_loop(slow_server, monkeypatch) -> None:
    engine, client, server = slow_server
    import spaceserve.runtime.inputs.chat as chat

    original = chat.ChatPreprocessor.start_plan  # the server's first preprocessing step

    def slow_plan(self, req, limits, *args, **kw):
        time.sleep(0.8)  # a huge image being decoded
        return original(self, req, limits, *args, **kw)

    monkeypatch.setattr(chat.ChatPreprocessor, "start_plan", slow_plan)

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            slow = asyncio.ensure_future(http.post("/v1/chat/completions",
                                                   json=LONG | {"max_tokens": 2}))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            health = await http.get("/health")
            waited = time.monotonic() - t0
            assert health.status_code == 200 and waited < 0.4, waited
            assert (await slow).status_code == 200

    asyncio.run(go())


def test_server_overhead_benchmark_runs(tiny_engine) -> None:
    """The overhead benchmark drives both paths (its figure is a benchmark's, not asserted)."""
    import math

    from bench.serving.server_overhead import measure

    engine, pre = tiny_engine
    res = measure(engine, pre, requests=8, rounds=2)
    assert res["requests"] == 8 and math.isfinite(res["overhead_ms"])
    assert res["inprocess_ms"] > 0 and res["server_ms"] > 0
