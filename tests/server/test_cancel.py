"""Work behind a request that timed out or whose client went away is cancelled: the pool's
worker stops at its next cancel point instead of running on after the answer (issue 37: "the
worker still busy after the answer")."""

from __future__ import annotations

import json
import socket
import time

import pytest

from spaceserve.runtime.inputs import cancel_point
from tests.server.conftest import wait_until
from tests.server.test_hardening import OK, build, post

pytest.importorskip("fastapi", reason="the serve extra is not installed")


def slow_start(monkeypatch, ran: list) -> None:
    """The first preprocessing step takes 10 s unless cancelled (checking every 10 ms)."""
    import spaceserve.runtime.inputs.chat as chat

    original = chat.ChatPreprocessor.start_plan

    def start_plan(*a, **k):
        for _ in range(1000):
            cancel_point()
            time.sleep(0.01)
            ran.append(1)
        return original(*a, **k)

    monkeypatch.setattr(chat.ChatPreprocessor, "start_plan", start_plan)


def test_a_timed_out_request_stops_its_worker(preprocessor, monkeypatch) -> None:
    ran: list = []
    slow_start(monkeypatch, ran)
    engine, client, app = build(preprocessor, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        r = post(app, OK)
        assert r.status_code == 503 and time.monotonic() - t0 < 0.9
        assert wait_until(lambda: client.pool.depth()["light_running"] == 0, 0.5)
        n = len(ran)
        time.sleep(0.1)
        assert len(ran) == n < 100  # stopped, not running on for 10 s
    finally:
        client.close()


def test_a_client_that_goes_away_stops_its_preprocessing(preprocessor, monkeypatch) -> None:
    from spaceserve.server.app import ServerThread

    ran: list = []
    slow_start(monkeypatch, ran)
    engine, client, app = build(preprocessor, timeout_s=30)
    try:
        with ServerThread(app) as server:
            raw = json.dumps(OK).encode()
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
            assert wait_until(lambda: len(ran) > 5, 5)
            s.close()
            assert wait_until(lambda: client.pool.depth()["light_running"] == 0, 1.0)
            assert wait_until(lambda: client.num_pending == 0, 1.0)
            assert len(ran) < 300
    finally:
        client.close()
