"""The per-client connection bound (server/transport/connections.py) on a live null-model
server: one address's idle connections beyond its bound neither serve nor count toward the
server's cap, so another address is still served; behind a trusted proxy the client is the
one its forwarded header names, for as long as its request runs."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from spaceserve.server.transport.connections import ConnectionLimits, parse_proxies

from .conftest import MODEL, make_app, null_engine, wait_until

pytest.importorskip("uvicorn", reason="the serve extra is not installed")

HI = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 2}).encode()


def connect(server, source: str) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10,
                                    source_address=(source, 0))


def request(server, source: str, path: str = "/v1/chat/completions",
            headers: dict | None = None) -> tuple[int, dict, dict]:
    """One request on a new connection from `source`: (status, headers, json)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30,
                                      source_address=(source, 0))
    try:
        if path == "/health":
            conn.request("GET", path, headers=headers or {})
        else:
            conn.request("POST", path, body=HI, headers={"Content-Type": "application/json",
                                                         **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def engine(preprocessor):
    return null_engine(preprocessor)


def serve(engine, preprocessor, limits: ConnectionLimits):
    from spaceserve.server.app import ServerThread

    client, app = make_app(engine, preprocessor)
    return client, ServerThread(app, connections=limits)


def counts(server):
    return server.server.config.http.counts


def test_limits_parse_and_name_the_forwarded_client() -> None:
    assert parse_proxies(" 10.0.0.1, 10.0.0.0/8,::1 ,") == ("10.0.0.1/32", "10.0.0.0/8",
                                                            "::1/128")
    with pytest.raises(ValueError, match="'nope' is not an address"):
        parse_proxies("10.0.0.1,nope")
    with pytest.raises(ValueError, match="--forwarded-client-header"):
        ConnectionLimits(trusted_proxies=("10.0.0.1",))
    with pytest.raises(ValueError, match="max_per_client"):
        ConnectionLimits(max_per_client=0)
    lim = ConnectionLimits(client_header="X-Forwarded-For",
                           trusted_proxies=parse_proxies("10.0.0.0/8"))
    h = [(b"x-forwarded-for", b"1.2.3.4, 5.6.7.8, 10.1.1.1"), (b"host", b"x")]
    assert lim.forwarded_client(h) == "5.6.7.8"  # the right-most hop not a trusted proxy
    assert lim.forwarded_client([(b"X-Forwarded-For", b"10.0.0.2, 10.0.0.3")]) == "10.0.0.2"
    assert lim.forwarded_client([(b"host", b"x")]) is None
    assert lim.trusted("10.9.9.9") and not lim.trusted("11.0.0.1")
    assert not ConnectionLimits().trusted("10.0.0.1")  # no header: nobody is a proxy


def test_idle_connections_of_one_client_do_not_lock_out_another(engine, preprocessor) -> None:
    """Cap 4, two per client: ten idle sockets from 127.0.0.2 hold two slots; 127.0.0.3 is
    served; a request on 127.0.0.2's third socket is a 503 naming the flag; the server's cap
    still holds for connections within their bounds; closing frees the counts."""
    client, thread = serve(engine, preprocessor, ConnectionLimits(
        max_connections=4, header_timeout_s=5.0, max_per_client=2))
    with thread as server:
        idle = [connect(server, "127.0.0.2") for _ in range(10)]
        assert wait_until(lambda: counts(server).per_client["127.0.0.2"] == 10)
        assert counts(server).admitted == 2
        status, _, body = request(server, "127.0.0.3")
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, headers, body = request(server, "127.0.0.2")
        assert status == 503 and headers["retry-after"] == "1"
        assert "--max-connections-per-client" in body["error"]["message"]
        more = [connect(server, "127.0.0.3") for _ in range(2)]  # 2 + 2 = the cap of 4
        assert wait_until(lambda: counts(server).admitted == 4)
        status, _, body = request(server, "127.0.0.4")
        assert status == 503 and body["error"]["message"].startswith("too many open conn")
        for s in idle + more:
            s.close()
        assert wait_until(lambda: counts(server).admitted == 0 and not counts(server).per_client)
        assert request(server, "127.0.0.2")[0] == 200
    client.close()


def test_behind_a_trusted_proxy_the_forwarded_client_is_bounded(engine, preprocessor) -> None:
    """One request at a time per forwarded client: while 1.1.1.1's chat runs (the engine
    held), its next request through the proxy is a 503 on a kept connection, another client
    behind the same proxy is served, and an untrusted peer's header is ignored."""
    client, thread = serve(engine, preprocessor, ConnectionLimits(
        max_per_client=1, client_header="X-Forwarded-For", trusted_proxies=("127.0.0.5",)))
    xff = {"X-Forwarded-For": "1.1.1.1"}
    engine.runner.gate.clear()
    try:
        with thread as server:
            held: list = []
            t = threading.Thread(target=lambda: held.append(request(server, "127.0.0.5",
                                                                    headers=xff)))
            t.start()
            assert wait_until(lambda: counts(server).per_client["1.1.1.1"] == 1)
            assert counts(server).per_client["127.0.0.5"] == 0  # the proxy is not a client
            status, headers, body = request(server, "127.0.0.5", "/health", headers=xff)
            assert status == 503 and "connection" not in headers
            assert "behind the proxy" in body["error"]["message"]
            status, _, _ = request(server, "127.0.0.5", "/health",
                                   headers={"X-Forwarded-For": "1.1.1.1, 127.0.0.5"})
            assert status == 503
            assert request(server, "127.0.0.5", "/health",
                           headers={"X-Forwarded-For": "2.2.2.2"})[0] == 200
            assert request(server, "127.0.0.6", "/health", headers=xff)[0] == 200
            engine.runner.gate.set()
            t.join(30)
            assert held and held[0][0] == 200
            assert wait_until(lambda: not counts(server).per_client)
    finally:
        engine.runner.gate.set()
        client.close()
