"""Server hardening on the null model: unexpected exceptions are JSON 500s that keep the
connection, malformed Unicode and deep JSON are 400s on a connection that serves the next
request, pixel budgets answer 413 / 429, preprocessing has a deadline, bodies reserve room
before they are read and must keep arriving, headers have a deadline, connections a cap, and
every 503 / 429 carries Retry-After."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import logging
import socket
import time

import httpx
import pytest

from spaceserve.runtime.inputs import ImageLimits, PixelBudget, PreprocessPool
from spaceserve.server.app import ServerLimits, ServerThread, create_app
from spaceserve.server.engine_client import AsyncEngine
from spaceserve.server.openai import protocol as P
from spaceserve.server.transport.connections import ConnectionLimits
from spaceserve.server.transport.guard import GuardLimits

from .conftest import MODEL, null_engine, wait_until

OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def flat_png(w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def images(url: str, n: int) -> dict:
    return OK | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}] * n + [
        {"type": "text", "text": "what?"}]}]}


def build(pre, *, max_pending=64, pixels=10**9, request_pixels=10**8, timeout_s=30.0,
          guard=None, pool=None):
    engine = null_engine(pre, max_model_len=640)
    client = AsyncEngine(engine, max_pending=max_pending, pixels=PixelBudget(pixels),
                         pool=pool or PreprocessPool())
    limits = ServerLimits(max_body_bytes=1 << 20, images=ImageLimits(
        max_image_bytes=1 << 20, max_image_pixels=1 << 24, max_images_per_request=8,
        max_request_pixels=request_pixels), preprocess_timeout_s=timeout_s)
    app = create_app(client, pre, model_name=MODEL, limits=limits, guard=guard)
    return engine, client, app


@pytest.fixture(scope="module")
def live(preprocessor):
    """A live null-model server with short timeouts and a small connection cap."""
    engine, client, app = build(preprocessor, guard=GuardLimits(
        max_body_bytes=1 << 20, body_budget_bytes=2 << 20, body_wait_s=0.3,
        body_idle_timeout_s=0.5, body_timeout_s=3.0))
    conns = ConnectionLimits(max_connections=6, header_timeout_s=0.6)
    with ServerThread(app, connections=conns, client=client) as server:
        yield engine, client, server
    client.close()


def post(app, body=None, raw: bytes | None = None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            if raw is not None:
                return await c.post("/v1/chat/completions", content=raw,
                                    headers={"content-type": "application/json"})
            return await c.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


def keepalive(server, bodies: list[bytes]) -> list[tuple[int, dict, dict]]:
    """POST each body on one connection: (status, headers, json) each, and that the socket
    stayed the same."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    out, sock = [], None
    for raw in bodies:
        conn.request("POST", "/v1/chat/completions", body=raw,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        out.append((resp.status, dict(resp.getheaders()), data))
        assert conn.sock is not None, "the server closed the connection"
        assert sock is None or conn.sock is sock
        sock = conn.sock
    conn.close()
    return out


def test_bad_unicode_and_deep_json_are_400s_on_a_kept_connection(live) -> None:
    _, _, server = live
    ok = json.dumps(OK).encode()
    cases = [
        (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "messages": [{"role": "user",'
         b' "content": "a\\ud800b"}]}', "messages[0].content: a lone UTF-16 surrogate (U+D800)"),
        (b'{"model": "ti\\udfffny", "messages": [{"role": "user", "content": "x"}]}',
         "model: a lone UTF-16 surrogate (U+DFFF)"),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests JSON deeper than 32 levels"),
        (b'{"model": "m", "messages": ' + b"[" * 40 + b"]" * 40 + b"}",
         "nests JSON deeper than 32 levels"),
    ]
    got = keepalive(server, [c for raw, _ in cases for c in (raw, ok)])
    for (_, needle), bad, good in zip(cases, got[::2], got[1::2], strict=True):
        assert bad[0] == 400 and needle in bad[2]["error"]["message"], bad
        assert good[0] == 200 and good[2]["usage"]["completion_tokens"] == 2


def test_unexpected_exception_is_json_500_with_request_id(live, monkeypatch, caplog) -> None:
    _, _, server = live

    def boom(*a, **k):
        raise TypeError("secret <object at 0x7f00deadbeef>")

    monkeypatch.setattr(P, "start_chat", boom)  # the server's first step
    with caplog.at_level(logging.ERROR):
        got = keepalive(server, [json.dumps(OK | {"max_tokens": 1}).encode()] * 2)
    for status, headers, body in got:
        rid = headers["x-request-id"]
        assert status == 500 and body["request_id"] == rid
        assert body["error"]["message"] == f"internal server error (request id {rid})"
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 2 and all("TypeError" in r.exc_text or r.exc_info for r in logged)
    monkeypatch.undo()
    assert keepalive(server, [json.dumps(OK).encode()])[0][0] == 200


def test_pixel_budgets_answer_413_and_429(preprocessor) -> None:
    engine, client, app = build(preprocessor, pixels=3 * 300 * 300, request_pixels=2 * 300 * 300)
    try:
        big = flat_png(300, 300)
        r = post(app, images(big, 3))
        assert r.status_code == 413
        assert r.json()["error"]["message"] == "messages: the images decode to 270000 pixels; " \
            "at most 180000 per request"
        held = client.pixels.acquire(2 * 300 * 300)  # another request decoding now
        r = post(app, images(big, 2))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "retry later" in r.json()["error"]["message"]
        held.release()
        r = post(app, images(big, 2))
        assert r.status_code == 200 and client.pixels.in_use == 0
    finally:
        client.close()


def test_preprocessing_deadline_is_503_with_retry_after(preprocessor, monkeypatch) -> None:
    import spaceserve.runtime.inputs.chat as chat

    engine, client, app = build(preprocessor, timeout_s=0.3)
    original = chat.ChatPreprocessor.start_plan  # the server's first preprocessing step
    monkeypatch.setattr(chat.ChatPreprocessor, "start_plan",
                        lambda *a, **k: time.sleep(1.0) or original(*a, **k))
    try:
        t0 = time.monotonic()
        r = post(app, OK)
        assert time.monotonic() - t0 < 0.9
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "preprocess_timeout"
        assert wait_until(lambda: client.num_pending == 0 and engine.num_active == 0, 3)
    finally:
        client.close()


def test_full_preprocessing_queue_is_503(preprocessor) -> None:
    import threading

    pool = PreprocessPool(light_workers=1, heavy_workers=1, max_queue=1)
    engine, client, app = build(preprocessor, pool=pool)
    gate = threading.Event()
    try:
        pool.submit(gate.wait)
        wait_until(lambda: pool.depth()["light_running"] == 1)
        pool.submit(lambda: None)  # the queue's one place
        r = post(app, OK)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        gate.set()
        client.close()


def raw_conn(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `sock`, or None if it stayed open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_slow_headers_and_idle_connections_are_closed(live) -> None:
    _, _, server = live
    idle = raw_conn(server)
    slow = raw_conn(server)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
    t0 = time.monotonic()
    assert closed_within(idle, 3.0) == b""
    assert closed_within(slow, 3.0) == b""
    assert time.monotonic() - t0 < 2.0


def test_stalled_body_is_408_and_closes(live) -> None:
    _, _, server = live
    sock = raw_conn(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
    got = closed_within(sock, 3.0)
    assert got is not None and got.startswith(b"HTTP/1.1 408 ")
    assert b"no request body data for 0.5 s" in got


def test_body_budget_admits_before_reading_and_small_bodies_pass(live) -> None:
    import threading

    _, _, server = live
    held = []
    for _ in range(2):  # two 1 MiB bodies take the 2 MiB budget while they trickle
        s = raw_conn(server)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1048576\r\n\r\n{")
        held.append(s)
    stop = threading.Event()

    def trickle() -> None:  # a byte now and then: within the body idle timeout
        while not stop.wait(0.15):
            for s in held:
                s.sendall(b" ")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=b"x" * 200_000,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 503 and resp.getheader("retry-after") == "1"
        assert json.loads(resp.read())["error"]["code"] == "server_busy"
        assert keepalive(server, [json.dumps(OK).encode()])[0][0] == 200  # small: no wait
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()


def test_connection_cap_answers_503_with_retry_after(live) -> None:
    _, _, server = live
    assert wait_until(lambda: len(server.server.server_state.connections) == 0, 5)
    hold = [raw_conn(server) for _ in range(6)]
    time.sleep(0.1)
    extra = raw_conn(server)
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    got = closed_within(extra, 3.0)
    assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in got.lower()
    assert b"too_many_connections" in got
    for s in hold:
        s.close()
    assert wait_until(lambda: len(server.server.server_state.connections) == 0, 5)
    assert keepalive(server, [json.dumps(OK).encode()])[0][0] == 200


def test_drain_ends_streams_with_an_error_event_and_refuses_new_work(preprocessor) -> None:
    engine = null_engine(preprocessor, delay=0.02, max_model_len=512)
    client = AsyncEngine(engine)
    app = create_app(client, preprocessor, model_name=MODEL)
    long = OK | {"max_tokens": 400, "ignore_eos": True, "stream": True}
    with ServerThread(app, client=client, graceful_timeout_s=0.5) as server:
        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                async with http.stream("POST", "/v1/chat/completions", json=long) as r:
                    lines = r.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    server.server.begin_drain()
                    health = await http.get("/health")
                    new = await http.post("/v1/chat/completions", json=OK)
                    rest = [line async for line in lines if line]
                return health, new, rest

        t0 = time.monotonic()
        health, new, rest = asyncio.run(go())
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert health.headers["retry-after"] == "1"
        assert new.status_code == 503 and new.headers["retry-after"] == "1"
        assert new.json()["error"]["code"] == "draining"
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "shutdown"
        server.thread.join(timeout=5)  # the stream alone would take over 8 s
        assert not server.thread.is_alive() and time.monotonic() - t0 < 6.0
    assert wait_until(lambda: engine.num_active == 0 and client.num_pending == 0, 3)
    client.close()


def test_pixel_values_stay_on_the_budget_until_encoded(preprocessor) -> None:
    engine, client, app = build(preprocessor, pixels=1000 * 1000)
    engine.runner.gate.clear()  # no step runs: the request waits for the encoder
    try:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/chat/completions",
                                                     json=images(flat_png(1000, 1000), 1)))
                # decoded: 10^6 pixels; then its pixel values, 448x448 twice (the temporal
                # patch) over 3 channels, stay held until the encoder takes them
                assert await asyncio.to_thread(
                    wait_until, lambda: client.pixels.in_use == 2 * 448 * 448, 10)
                held = client.pixels.in_use
                busy = await c.post("/v1/chat/completions", json=images(flat_png(1000, 1000),
                                                                        1))
                engine.runner.gate.set()
                return held, busy, await first

        held, busy, first = asyncio.run(go())
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert first.status_code == 200
        assert wait_until(lambda: client.pixels.in_use == 0, 3)
    finally:
        engine.runner.gate.set()
        client.close()


def test_pixel_lease_split_moves_part_without_a_capacity_check() -> None:
    budget = PixelBudget(100)
    lease = budget.acquire(80)
    part = lease.split(30)
    assert (lease.pixels, part.pixels, budget.in_use) == (50, 30, 80)
    lease.release()
    assert budget.in_use == 30
    assert lease.split(10).pixels == 0  # nothing left to move from a released lease
    part.release()
    assert budget.in_use == 0


def test_long_text_is_tokenised_in_the_heavy_lane(preprocessor, monkeypatch) -> None:
    import threading

    from spaceserve.server.openai import preprocess

    monkeypatch.setattr(preprocess, "LIGHT_TEXT_BYTES", 1000)
    engine, client, app = build(preprocessor)
    lanes = []
    original = client.pool.run

    async def spy(fn, **kw):
        lanes.append((kw.get("lane"), threading.current_thread().name))
        return await original(fn, **kw)

    monkeypatch.setattr(client.pool, "run", spy)
    try:
        assert post(app, OK).status_code == 200
        assert [lane for lane, _ in lanes] == ["light"]  # plan, tokenise and add: one hop
        lanes.clear()
        long = OK | {"messages": [{"role": "user", "content": "The street is busy. " * 60}]}
        r = post(app, long)
        assert r.status_code == 200, r.text
        assert [lane for lane, _ in lanes] == ["light", "heavy"]
    finally:
        client.close()


def test_second_signal_exits_at_once(preprocessor) -> None:
    import signal

    engine = null_engine(preprocessor, delay=0.01, max_model_len=512)
    client = AsyncEngine(engine)
    app = create_app(client, preprocessor, model_name=MODEL)
    long = OK | {"max_tokens": 400, "ignore_eos": True, "stream": True}
    with ServerThread(app, client=client, graceful_timeout_s=30) as server:
        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                async with http.stream("POST", "/v1/chat/completions", json=long) as r:
                    lines = r.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    server.server.handle_exit(signal.SIGTERM, None)  # drain: 30 s allowed
                    await asyncio.sleep(0.3)
                    assert server.thread.is_alive() and client.draining
                    t0 = time.monotonic()
                    server.server.handle_exit(signal.SIGINT, None)  # now
                    await asyncio.to_thread(server.thread.join, 5)
                    return time.monotonic() - t0

        took = asyncio.run(go())
        assert not server.thread.is_alive() and took < 2.0
    assert wait_until(lambda: engine.num_active == 0, 3)
    client.close()
