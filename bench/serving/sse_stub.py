"""A stand-in OpenAI chat server whose timing is known exactly, to measure benchmark clients.

Every ``POST /v1/chat/completions`` (streamed) answers its first content chunk `ttft_ms` after
the request's last byte arrived, then one chunk every `itl_ms` until ``max_tokens``, a usage
chunk and ``data: [DONE]`` - on a plain asyncio server doing nothing else, so what a client
reports beyond ``ttft_ms``, ``itl_ms`` and ``ttft_ms + (max_tokens - 1) * itl_ms`` is the
client's own time (and the loopback's). ``GET /v1/models``, ``/health`` and ``/metrics`` answer
too, so the benchmark's preflight and split scraping work unchanged.

    python -m bench.serving.sse_stub --port 8400 --ttft-ms 20 --itl-ms 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

MODEL = "tiny"


def _chunk(i: int, text: str | None, usage: dict | None = None, finish: str | None = None
           ) -> bytes:
    obj: dict = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    if usage is not None:
        obj["choices"], obj["usage"] = [], usage
    else:
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
            f"\r\n").encode() + body


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     ttft: float, itl: float) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    t0 = time.monotonic()
    if method == "GET":
        if path.startswith("/v1/models"):
            data = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
        elif path.startswith("/health"):
            data = json.dumps({"status": "ok", "device": "stub"}).encode()
        else:
            data = b"spaceserve:encoder_sms 132.0\nspaceserve:decoder_sms 132.0\n"
        writer.write(_response("200 OK", data, "text/plain" if path == "/metrics"
                               else "application/json"))
        await writer.drain()
        return True
    req = json.loads(body or b"{}")
    n = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
    prompt = 50
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if not req.get("stream"):
        await asyncio.sleep(ttft + (n - 1) * itl)
        msg = {"role": "assistant", "content": "x" * n}
        data = json.dumps({"id": "stub", "object": "chat.completion", "model": MODEL,
                           "choices": [{"index": 0, "message": msg, "finish_reason": "length"}],
                           "usage": usage}).encode()
        writer.write(_response("200 OK", data))
        await writer.drain()
        return True
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")

    async def send(data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    for i in range(n):
        due = t0 + ttft + i * itl
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        await send(_chunk(i, "x", finish="length" if i == n - 1 else None))
    await send(_chunk(n, None, usage=usage) + b"data: [DONE]\n\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def serve(port: int, ttft_ms: float, itl_ms: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await _serve_one(reader, writer, ttft_ms / 1e3, itl_ms / 1e3):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.sse_stub", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=4.0)
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.ttft_ms, args.itl_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
