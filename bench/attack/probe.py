"""The "hi" probe of `bench.attack`, in its own process so the attacking client's own work
never delays it: sends a small chat request every `interval` s on one keep-alive connection
(a new one after an error) and prints ``[seconds, status]`` per request, until stdin closes.

    python -m bench.attack.probe HOST PORT MODEL [INTERVAL]
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def main(argv: list[str]) -> int:
    host, port, model = argv[0], int(argv[1]), argv[2]
    interval = float(argv[3]) if len(argv) > 3 else 0.25
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}).encode()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            status: int | str = resp.status
        except (OSError, http.client.HTTPException) as exc:
            status = type(exc).__name__
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
        print(json.dumps([time.monotonic() - t0, status]), flush=True)
        stop.wait(interval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
