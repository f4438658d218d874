"""bench/attack/bounds.py's rows against a live tiny server with default flags
(``python -m bench.attack --quick --only bounds clients``): 64 prompts x n=128 is a 400
naming its bound, and 300 idle connections from 127.0.0.2 leave a
client on 127.0.0.3 served within 2 s while 127.0.0.2's next request gets 503."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.test_attack import ROOT, free_port

pytest.importorskip("fastapi", reason="the serve extra is not installed")


def test_bounds_rows_hold(tmp_path) -> None:
    out = tmp_path / "attack.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "bench.attack", "--quick", "--only", "bounds",
                           "clients", "--port", str(free_port()), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2, rows
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(f"{r['attack']}: {r['observed']}" for r in bad)
    assert proc.returncode == 0
