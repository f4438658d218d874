"""The attack script's quick subset (`python -m bench.attack --quick`) against a live tiny
server with default flags: 2 concurrent 8 MB messages, image bombs and 2 max-size image
requests, video clips over and at the pixel budget (2 requests each), 4 concurrent 30 MB
uploads, every malformed / injection / leak / format case once on a kept connection, 200 slow
connections, one n=128 request beside "hi"s (the fair share), SIGTERM with 100 streams in
flight (the per-request, per-client, body-shape and slow-reader rows run in their own tests).
Every row must pass:
"hi" under 2 s during the floods, RSS under the documented bound, 4xx with clear messages,
exit within 10 s."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# The attacked server needs the serve extra (fastapi, uvicorn, pydantic).
pytest.importorskip("fastapi", reason="the serve extra is not installed")

ROOT = Path(__file__).resolve().parents[2]
# rows with CI checks of their own: test_attack_bounds.py, test_attack_shapes.py and
# tests/server/test_backpressure.py
ELSEWHERE = {"bounds", "clients", "shapes", "slow_readers"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attack_quick_subset_holds(tmp_path) -> None:
    out = tmp_path / "attack.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)  # the server runs the torch backend on CPU anyway
    from bench.attack.cases import ATTACKS

    names = [n for n, _ in ATTACKS if n not in ELSEWHERE]
    proc = subprocess.run([sys.executable, "-m", "bench.attack", "--quick", "--port",
                           str(free_port()), "--json", str(out), "--only", *names], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=420)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(f"{r['attack']}: {r['observed']}" for r in bad)
    assert {r["attack"][0] for r in rows} == set("123456789")
    assert proc.returncode == 0, proc.stdout[-3000:]
