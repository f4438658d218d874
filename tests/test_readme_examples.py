"""The README's examples run as written: its `spaceserve serve` command starts a server on the
tiny random checkpoint, and its curl and official-client examples send that server a real PNG as
a base64 ``data:`` URL; its Python example runs the engine on the same checkpoint. Only the
model directory, the host and the port are substituted. (The commands' flags are checked
against the CLI in tests/test_docs.py.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_docs import FENCE, README, spaceserve_argv

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("openai", reason="the serve extra is not installed")

README_MODEL = "models/Qwen2-VL-2B-Instruct"
README_ADDRESS = "localhost:8000"


def blocks(lang: str, needle: str) -> list[str]:
    """The README's fenced `lang` blocks that contain `needle`."""
    return [body for kind, body in FENCE.findall(README.read_text())
            if kind == lang and needle in body]


def serve_argv() -> list[str]:
    """The README's `spaceserve serve` command's arguments."""
    for body in blocks("bash", "spaceserve serve"):
        for line in body.replace("\\\n", " ").splitlines():
            argv = spaceserve_argv(line)
            if argv and argv[0] == "serve":
                return argv[1:]
    raise AssertionError("README.md shows no `spaceserve serve` command")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_png(path: Path) -> None:
    """A real 56x84 PNG (an image of 2x3 LLM tokens' worth of pixels), not a placeholder."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(path, format="PNG")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_path) -> Path:
    """A folder holding the README's `cat.png` and, at the README's model path, the tiny
    checkpoint."""
    work = tmp_path_factory.mktemp("readme")
    write_png(work / "cat.png")
    (work / README_MODEL).parent.mkdir(parents=True)
    (work / README_MODEL).symlink_to(tiny_path, target_is_directory=True)
    return work


@pytest.fixture(scope="module")
def server(workdir):
    """The README's server command, run from `workdir` on a free port; yields host:port."""
    argv = serve_argv()
    assert argv[argv.index("--model") + 1] == README_MODEL, argv
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    env = dict(os.environ, PYTHONPATH=str(README.parent), OMP_NUM_THREADS="1")
    log = open(workdir / "server.log", "w")  # a file, not a pipe nobody drains
    proc = subprocess.Popen([sys.executable, "-m", "spaceserve.cli", "serve", *argv],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_healthy(proc, port, workdir / "server.log")
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = 90.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the README's server exited {proc.returncode}: "
                                 f"{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the README's server did not become healthy")


def at(code: str, address: str) -> str:
    assert README_ADDRESS in code, f"the example does not talk to {README_ADDRESS}"
    return code.replace(README_ADDRESS, address)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_readme_curl_example(server, workdir) -> None:
    (code,) = blocks("bash", "curl ")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", at(code, server)], cwd=workdir,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body.get("object") == "chat.completion", body
    assert body["model"] == "Qwen/Qwen2-VL-2B-Instruct"
    assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    assert body["usage"]["prompt_tokens"] >= 6, body  # the image's 2x3 tokens are counted


def test_readme_openai_client_example(server, workdir, monkeypatch) -> None:
    (code,) = blocks("python", "from openai import OpenAI")
    monkeypatch.chdir(workdir)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(at(code, server), "README.md (openai example)", "exec"), scope)
    reply = scope["reply"]
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens >= 6
    assert reply.usage.completion_tokens >= 1


def test_readme_python_example(workdir, monkeypatch, capsys) -> None:
    (code,) = blocks("python", "Engine.from_pretrained")
    assert f'"{README_MODEL}"' in code
    monkeypatch.chdir(workdir)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md (Python example)", "exec"), scope)
    outs = scope["outs"]
    assert len(outs) == 1 and outs[0].finish_reason in ("stop", "length"), outs
    assert len(outs[0].token_ids) >= 1
    assert capsys.readouterr().out.strip(), "the example prints nothing"


def test_the_examples_send_an_image_as_a_data_url() -> None:
    for lang, needle in (("bash", "curl "), ("python", "from openai import OpenAI")):
        (code,) = blocks(lang, needle)
        assert "data:image/png;base64," in code and '"image_url"' in code, needle
    assert re.search(r'"images": \["cat\.png"\]', blocks("python", "Engine.")[0])
    assert shlex.split(blocks("bash", "curl ")[0], comments=True)
