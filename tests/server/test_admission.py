"""SLO-aware admission through the server (``--admission slo``): a request the engine refuses
is a 503 with Retry-After at once, streaming or not; a request ended while it waited gets the
same 503 (no byte was sent); /metrics counts them as shed and every gauge goes back to 0.
The engine's costs are pinned (0.6 s of prefill per request, a 1 s TTFT bound) and its steps
gated, so the verdicts do not depend on the machine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from spaceserve.server.app import ServerThread, create_app
from spaceserve.server.engine_client import AsyncEngine
from spaceserve.server.metrics import parse_gauges

from .conftest import MODEL, null_engine, wait_until

OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def served(preprocessor):
    engine = null_engine(preprocessor, admission="slo", slo="ttft:1000,tpot:50")
    adm = engine.admission
    adm.enc_s = lambda patches, layers: 0.0
    adm.pre_s = lambda tokens: 0.6  # counted while the request has no first token
    adm.policy.calibrate = False
    client = AsyncEngine(engine)
    app = create_app(client, preprocessor, model_name=MODEL)
    with ServerThread(app, client=client) as server:
        yield engine, client, server
    client.close()


def test_refused_and_hopeless_requests_are_503s_with_retry_after(served) -> None:
    engine, client, server = served
    gate = engine.runner.gate

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            gate.clear()  # the first request's step blocks: it holds the queue
            first = asyncio.ensure_future(http.post("/v1/chat/completions", json=OK))
            running = lambda: len(engine.scheduler.running) == 1  # noqa: E731
            await asyncio.to_thread(wait_until, running, 5)
            # 0.6 s of prefill ahead + its own 0.6 s > 1 s: refused at once
            refused = []
            for body in (OK, OK | {"stream": True}):
                t0 = time.monotonic()
                r = await http.post("/v1/chat/completions", json=body)
                refused.append((r, time.monotonic() - t0))
            gate.set()
            assert (await first).status_code == 200
            # admitted (0.6 s predicted), then it waits 0.5 s behind a blocked step
            engine.admission.pre_s = lambda tokens: 0.6 if tokens > 0 else 0.0
            gate.clear()
            blocker = asyncio.ensure_future(http.post("/v1/chat/completions", json=OK))
            await asyncio.to_thread(wait_until, running, 5)
            late = asyncio.ensure_future(http.post("/v1/chat/completions",
                                                   json=OK | {"stream": True}))
            await asyncio.to_thread(wait_until, lambda: len(engine.admission.waiting) == 2, 5)
            await asyncio.sleep(0.5)
            gate.set()
            blocked = await blocker
            assert blocked.status_code == 200, blocked.text
            return refused, await late, (await http.get("/metrics")).text

    refused, late, _ = asyncio.run(go())
    for r, took in refused:
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        body = r.json()["error"]
        assert body["code"] == "overloaded" and "cannot meet its TTFT bound" in body["message"]
        assert took < 0.5  # measured well under 0.1 s; generous for a shared CPU
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert "can no longer meet its TTFT bound" in late.json()["error"]["message"]
    assert wait_until(lambda: engine.num_active == 0 and client.num_pending == 0, 3)
    adm = engine.admission  # nothing tracked is left: past the door, in front, waiting
    assert wait_until(lambda: not adm.entering and not adm.front and not adm.waiting, 3)
    text = httpx.get(server.url + "/metrics").text
    assert 'spaceserve:requests_shed_total{when="arrival"} 2' in text
    assert 'spaceserve:requests_shed_total{when="waiting"} 1' in text
    g = parse_gauges(text)
    for name in ("num_requests_waiting", "num_requests_running", "num_requests_in_flight",
                 "encoder_queue_depth", "kv_cache_usage_perc"):
        assert g["spaceserve:" + name] == 0.0, name
    engine.check_idle()


def test_an_ended_requests_output_maps_to_its_retry_after() -> None:
    from spaceserve.runtime.core.request import RequestMetrics, RequestOutput
    from spaceserve.server.openai.streams import error_of

    out = RequestOutput("r", [1], [], [], True, "error", "overloaded",
                        RequestMetrics(0.0, None, (), 0.1),
                        extra={"status": 503, "retry_after": 7})
    exc = error_of(out)
    assert exc.status == 503 and exc.headers()["Retry-After"] == "7"


def test_the_door_refuses_before_the_body_is_read(served) -> None:
    """Past the bound for even an empty request, a generation POST is refused on its headers
    alone: the 503 comes while the declared body has not been sent."""
    engine, client, server = served
    gate = engine.runner.gate
    host, port = server.url.removeprefix("http://").split(":")

    async def raw_post(path: str) -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = time.monotonic()
        writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     "content-length: 100000\r\n\r\n".encode())  # and no body at all
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        took = time.monotonic() - t0
        body = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        return head + body, took

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            gate.clear()
            first = asyncio.ensure_future(http.post("/v1/chat/completions", json=OK))
            await asyncio.to_thread(wait_until, lambda: len(engine.scheduler.running) == 1, 5)
            engine.admission.pre_s = lambda tokens: 1.2  # its prefill alone passes the bound
            answers = [await raw_post(p) for p in ("/v1/chat/completions", "/v1/completions")]
            health = (await http.get("/health")).status_code
            gate.set()
            assert (await first).status_code == 200
            return answers, health

    answers, health = asyncio.run(go())
    for raw, took in answers:
        assert raw.startswith(b"HTTP/1.1 503"), raw[:200]
        assert b"retry-after: 1" in raw.lower() and b'"code":"overloaded"' in raw.replace(b" ", b"")
        assert b"cannot meet its TTFT bound" in raw
        assert took < 0.5
    assert health == 200  # other routes are not the door's
    text = httpx.get(server.url + "/metrics").text
    assert 'spaceserve:requests_shed_total{when="arrival"} 2' in text
    assert wait_until(lambda: engine.num_active == 0 and client.num_pending == 0, 3)
    adm = engine.admission
    assert wait_until(lambda: not adm.entering and not adm.front and not adm.waiting, 3)


def test_requests_past_the_door_count_ahead_of_later_ones(served) -> None:
    """A request the door let in is priced ahead of the next arrival (as the smallest recent
    request) until it reaches the engine; its wait is counted from the door."""
    engine, client, _ = served
    adm = engine.admission
    adm.recent.append((0.0, 0.6, False))
    state: dict = {}
    assert client.at_door(state) is None and len(adm.entering) == 1
    # 0.6 s ahead (the one past the door) + its own 0.6 s > 0.9 x 1 s: refused
    refused = client.at_door({})
    assert refused is not None and refused.status == 503 and refused.code == "overloaded"
    client.left_door(state)  # it ended before reaching the engine
    assert not adm.entering and client.at_door({"x": 1}) is None
    adm.entering.clear()


def test_a_request_whose_preprocessing_fails_leaves_the_front(served) -> None:
    """A request past the door whose image fails to decode in preprocessing (400, after it
    was counted in front of the engine) does not count ahead of later arrivals: nothing is
    left in `entering` or `front`."""
    import base64
    import io
    import random

    from PIL import Image

    engine, client, server = served
    rng = random.Random(0)
    img = Image.new("RGB", (64, 64))
    img.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(64 * 64)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    cut = buf.getvalue()[: len(buf.getvalue()) // 2]  # its header reads; decoding fails
    url = "data:image/png;base64," + base64.b64encode(cut).decode()
    bad = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for _ in range(3):
            assert http.post("/v1/chat/completions", json=bad).status_code == 400
        assert http.post("/v1/chat/completions", json=OK).status_code == 200
    adm = engine.admission
    assert wait_until(lambda: not adm.entering and not adm.front and not adm.waiting, 3)
