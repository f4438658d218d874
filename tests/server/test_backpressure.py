"""Slow readers (transport/backpressure.py): a send blocked past the stall timeout pauses the
request and resumes it when it goes through; past the write timeout the stream ends. Live: a
stream whose client does not read is paused (its KV blocks freed), a "hi" is served meanwhile,
and when the client reads again it gets the same seeded text as an uninterrupted stream."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from spaceserve.server.transport.backpressure import (  # noqa: E402
    SlowReaderGuard,
    StreamLimits,
    WriteTimeout,
    listening_socket,
)

FAST = StreamLimits(stall_s=0.05, write_timeout_s=0.3, final_wait_s=0.05)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="write_timeout_s"):
        StreamLimits(stall_s=5, write_timeout_s=1)
    with pytest.raises(ValueError, match="stall_s"):
        StreamLimits(stall_s=0)


def test_a_blocked_send_pauses_then_resumes_or_times_out() -> None:
    events: list[str] = []

    async def main() -> None:
        gate = asyncio.Event()

        async def send(message: dict) -> None:
            await gate.wait()
            events.append("sent")

        guard = SlowReaderGuard(FAST, lambda: events.append("pause"),
                                lambda: events.append("resume"))
        wrapped = guard.wrap(send)
        gate.set()
        await wrapped({})  # a reading client: nothing happens
        gate.clear()
        asyncio.get_running_loop().call_later(0.15, gate.set)
        await wrapped({})  # blocked past the stall, then read
        assert guard.pauses == 1 and not guard.paused
        gate.clear()
        with pytest.raises(WriteTimeout):
            await wrapped({})  # never read
        with pytest.raises(WriteTimeout):
            await wrapped({})  # given up: no more sends

    asyncio.run(main())
    assert events == ["sent", "pause", "sent", "resume", "pause"]


def _serve(app, sock: socket.socket):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return server, t


def _request(port: int, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


def _text(raw: bytes) -> tuple[str, bool]:
    out = []
    for line in raw.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            out += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(out), raw.rstrip().endswith(b"0") and b"data: [DONE]" in raw


def _read(s: socket.socket) -> bytes:
    s.settimeout(60)
    out = bytearray()
    while not out.endswith(b"0\r\n\r\n"):
        part = s.recv(65536)
        if not part:
            break
        out += part
    return bytes(out)


def _paused_stream(client, port: int, body: dict) -> socket.socket:
    """A streamed request on a socket with a tiny receive buffer that is never read, once the
    server has paused it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(_request(port, body))
    end = time.monotonic() + 30
    while client.num_paused < 1:
        assert time.monotonic() < end, "the stream was never paused"
        time.sleep(0.02)
    return s


def test_a_deaf_stream_is_paused_and_resumes_with_the_same_text(tiny_engine, monkeypatch
                                                                ) -> None:
    from spaceserve.server.app import ServerLimits
    from tests.server.conftest import MODEL, make_app

    engine, pre = tiny_engine
    execute = engine.runner.execute

    def paced(*args, **kwargs):  # 400 tokens outlast the stall on any machine: the stream
        time.sleep(0.002)  # stalls, and is paused, long before the request could finish
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", paced)
    limits = ServerLimits(max_body_bytes=1 << 20,
                          stream=StreamLimits(stall_s=0.3, write_timeout_s=30))
    client, app = make_app(engine, pre, limits=limits)
    sock = listening_socket("127.0.0.1", 0, 4096)
    port = sock.getsockname()[1]
    server, thread = _serve(app, sock)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 400, "ignore_eos": True, "seed": 5, "logprobs": True,
            "top_logprobs": 5}
    try:
        ref = socket.create_connection(("127.0.0.1", port))
        ref.sendall(_request(port, body))
        want, done = _text(_read(ref))
        ref.close()
        assert done and want
        deaf = _paused_stream(client, port, body)
        time.sleep(0.2)  # the pause reaches the engine at its next step
        seqs = [r for r in engine.scheduler.waiting if r.request_id.startswith("chatcmpl-")]
        assert len(seqs) == 1 and not seqs[0].block_ids  # no KV blocks while paused
        hi = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        hi.sendall(_request(port, {"model": MODEL, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]}))
        hi.settimeout(10)
        assert b"200 OK" in hi.recv(65536) and time.monotonic() - t0 < 2.0
        hi.close()
        got, done = _text(_read(deaf))  # the client reads again: resumed to the end
        deaf.close()
        assert done and got == want
        assert client.num_paused == 0
        # a client that goes away while paused frees its slot at once
        gone = _paused_stream(client, port, body)
        gone.close()
        t0 = time.monotonic()
        while client.num_paused or client.num_pending:
            assert time.monotonic() - t0 < 3.0, (client.num_paused, client.num_pending)
            time.sleep(0.02)
    finally:
        server.should_exit = True
        thread.join(10)
        client.close()


def test_a_write_timeout_ends_the_request_and_offers_the_error_event() -> None:
    from spaceserve.server.transport.backpressure import WatchedStreamingResponse

    ended, sent, calls = [], [], []

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            ended.append(True)  # the route's stream ends its request here

    async def main() -> None:
        async def send(message: dict) -> None:
            calls.append(message)
            if len(calls) > 3:
                await asyncio.Event().wait()  # the client stopped reading for good
            sent.append(message)

        async def receive() -> dict:
            await asyncio.Event().wait()

        guard = SlowReaderGuard(FAST, lambda: None, lambda: None)
        response = WatchedStreamingResponse(body(), guard=guard,
                                            media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        t0 = time.monotonic()
        await asyncio.wait_for(response(scope, receive, send), 5)
        assert time.monotonic() - t0 < FAST.write_timeout_s + FAST.final_wait_s + 0.5

    asyncio.run(main())
    assert ended == [True] and guard_timed_out(calls)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body",
                                         "http.response.body"]


def guard_timed_out(calls: list) -> bool:
    """The last send was the final error event and [DONE] (it blocked too: the client never
    reads)."""
    last = calls[-1]
    return len(calls) == 5 and not last["more_body"] and \
        b'"code": "stream_write_timeout"' in last["body"] and last["body"].endswith(
            b"data: [DONE]\n\n")
