"""The CI subset of `bench.attack`'s rows 10 (body shapes) against a live tiny server with
default limits: the four shapes of issue 37 at a tenth of their size (3 MB of zeros, 90,000
messages, 20,000 parts, 1,500,000 token ids), each alone and two at once, must get their 4xx
within 2 s while ``/health`` answers within 0.5 s. (Row 11, slow readers, runs live in
tests/server/test_backpressure.py; the full sizes in ``python -m bench.attack``.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")


@pytest.fixture(scope="module")
def live_server():
    from spaceserve.server.app import ServerThread, create_app
    from spaceserve.server.engine_client import AsyncEngine, load_engine

    engine, pre, _ = load_engine("tiny", device="cpu", num_kv_blocks=64, block_size=8,
                                 max_num_seqs=4)
    client = AsyncEngine(engine)
    app = create_app(client, pre, model_name="tiny")
    with ServerThread(app) as server:
        yield server
    client.close()
    engine.close()


def test_body_shapes_are_refused_fast_and_health_stays_up(live_server) -> None:
    import httpx

    from bench.attack.shapes import ANSWER_LIMIT_S, HEALTH_LIMIT_S, shape_bodies

    worst, stop = [0.0], threading.Event()

    def health() -> None:
        with httpx.Client(base_url=live_server.url, timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - t0)
                stop.wait(0.05)

    async def post(path: str, raw: bytes) -> tuple[int, str, float]:
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as c:
            r = await c.post(path, content=raw, headers={"content-type": "application/json"})
        return r.status_code, r.json()["error"]["message"], time.monotonic() - t0

    async def attack(path: str, raw: bytes, copies: int) -> list:
        return await asyncio.gather(*(post(path, raw) for _ in range(copies)))

    t = threading.Thread(target=health, daemon=True)
    t.start()
    try:
        for name, path, raw, status in shape_bodies("tiny", scale=0.1):
            for copies in (1, 2):
                for got, message, took in asyncio.run(attack(path, raw, copies)):
                    assert got == status, (name, message)
                    assert took < ANSWER_LIMIT_S, (name, took)
    finally:
        stop.set()
        t.join()
    assert worst[0] < HEALTH_LIMIT_S, worst[0]
