"""``spaceserve serve --data-parallel-size 2`` on a local Ray cluster (CPU, the tiny model).

One command (a subprocess, its own Ray cluster in a short temp dir) serves every test of this
module, in order: 40 requests (text and images, streamed and not) through the official openai
client all succeed on both replicas, a greedy request's tokens equal the single server's, and a
conversation's second turn goes to the replica that served its picture;
killing a replica's process mid-load ends every affected request with a clear error or a
retry, never a hang, and requests after Ray restarted it succeed; SIGTERM stops the replicas and
the cluster, leaving no Ray process behind (checked again at teardown, also after a failure).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import MODEL, make_app, png

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
openai = pytest.importorskip("openai", reason="the serve extra is not installed")

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
GREEDY = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True,
                                                          "return_token_ids": True})


def data_url(h: int, w: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(h, w, seed)).decode()


def image_message(h: int, w: int, seed: int, text: str = "Describe this image.") -> list:
    return [{"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": data_url(h, w, seed)}},
                                         {"type": "text", "text": text}]}]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.add(c)
            todo.append(c)
    return out


def ray_processes(temp_dir: str) -> list[str]:
    """Processes whose command line names `temp_dir` (Ray's gcs_server, raylet, agents)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
            if temp_dir in cmd:
                found.append(f"{entry.name}: {cmd[:120]}")
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(p)
    return out


def _term_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (Linux), so a crashed
    run leaves no server (and so no Ray cluster: its processes share the server's fate)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Served:
    """The `spaceserve serve -dp 2` process and how to reach it."""

    def __init__(self, tiny_path: Path) -> None:
        self.temp = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")  # short: socket paths
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(self.temp) / "serve.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spaceserve.cli", "serve", "--model", str(tiny_path),
                 "--served-model-name", MODEL, "--data-parallel-size", "2", "--port",
                 str(self.port), "--ray-temp-dir", self.temp, "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True, preexec_fn=_term_with_parent)
        self.ready_s: float | None = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"spaceserve serve exited with {self.proc.returncode}:\n"
                            f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"spaceserve serve not ready after {START_TIMEOUT_S} s:\n{self.tail()}")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> list[str]:
        """SIGTERM (SIGKILL to the whole session after 60 s); what was left behind."""
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (alive(family) or ray_processes(self.temp)):
            time.sleep(0.5)
        left = [f"{p}" for p in alive(family)] + ray_processes(self.temp)
        for p in alive(family):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        return left


def served_total(text: str, replica: str | None = None) -> int:
    where = f'replica="{replica}",' if replica is not None else ""
    pattern = rf'^spaceserve:request_success_total\{{{where}finished_reason="(\w+)"\}} (\d+)$'
    return sum(int(n) for reason, n in re.findall(pattern, text, re.M)
               if reason in ("stop", "length"))


def pids(text: str) -> dict[str, int]:
    return {lab: int(pid) for lab, pid in
            re.findall(r'^spaceserve:replica_info\{replica="(\d+)".*pid="(\d+)"', text, re.M)}


@pytest.fixture(scope="module")
def served(tiny_path):
    s = Served(tiny_path)  # Ray starts in the background while the single server loads
    yield s
    left = s.stop()
    shutil.rmtree(s.temp, ignore_errors=True)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def single(tiny_path):
    """The single server on the same checkpoint with the command's defaults."""
    from spaceserve.server.app import ServerThread
    from spaceserve.server.engine_client import load_engine

    engine, pre, _ = load_engine(str(tiny_path), device="cpu")
    client, app = make_app(engine, pre)
    with ServerThread(app) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.close()


@pytest.fixture(scope="module")
def dp(served, single):
    served.wait_ready()
    return served


def client_of(s: Served, timeout: float = 120.0):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def ask(c, i: int, *, max_tokens: int = 8, stream: bool | None = None) -> str:
    """Request i of a mixed load: text or an image of one of four sizes, streamed or not."""
    if i % 2:
        messages = image_message(*[(60, 90), (112, 112), (200, 150), (56, 84)][i % 4],
                                 seed=i % 5)
    else:
        messages = [{"role": "user", "content": f"Count the birds, number {i}."}]
    stream = bool(i % 3 == 0) if stream is None else stream
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, seed=i,
              extra_body={"ignore_eos": True})
    if not stream:
        r = c.chat.completions.create(**kw)
        assert r.usage.completion_tokens == max_tokens
        return r.choices[0].message.content
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_forty_requests_on_both_replicas_and_greedy_equals_single(dp, single) -> None:
    c = client_of(dp)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: ask(c, i), range(40)))
    assert len(texts) == 40 and all(isinstance(t, str) for t in texts)
    messages = image_message(60, 90, seed=1)
    want = single.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    for _ in range(2):  # the second one goes to the other replica when both are idle
        got = c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        assert got.choices[0].token_ids == want.choices[0].token_ids
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage == want.usage
    text = dp.metrics()
    assert served_total(text) == 42
    per = {lab: served_total(text, lab) for lab in ("0", "1")}
    assert per["0"] + per["1"] == 42 and min(per.values()) > 0, per
    # the same picture again (a new one, in a conversation's next turn) goes where it was served
    turn = image_message(128, 96, seed=77, text="What is in it?")
    c.chat.completions.create(model=MODEL, messages=turn, max_tokens=4)
    after_first = {lab: served_total(dp.metrics(), lab) for lab in ("0", "1")}
    first = next(lab for lab in after_first if after_first[lab] > per[lab])
    turn += [{"role": "assistant", "content": "A picture."},
             {"role": "user", "content": "And the colours?"}]
    c.chat.completions.create(model=MODEL, messages=turn, max_tokens=4)
    text = dp.metrics()
    assert served_total(text, first) == after_first[first] + 1, "the second turn moved"
    assert "spaceserve:num_replicas 2.0" in text
    health = httpx.get(dp.url + "/health").json()
    assert health.pop("device").startswith("CPU")  # the replicas', as the first one says
    assert health == {"status": "ok", "mode": "temporal", "note": None}


def test_completions_and_generation_parameters_through_the_replicas(dp, single) -> None:
    """/v1/completions and the generation parameters (seeded sampling, penalties, stop strings,
    logprobs) cross Ray to a replica and back as the single server answers them."""
    c = client_of(dp)
    kw = dict(model=MODEL, max_tokens=8, temperature=0.9, seed=3, logprobs=2,
              presence_penalty=0.5, extra_body={"ignore_eos": True, "top_k": 40})
    want = single.completions.create(prompt=["The birds", "Count them"], **kw)
    got = c.completions.create(prompt=["The birds", "Count them"], **kw)
    assert [ch.text for ch in got.choices] == [ch.text for ch in want.choices]
    assert [ch.logprobs.tokens for ch in got.choices] == \
        [ch.logprobs.tokens for ch in want.choices]
    # parallel sampling crosses too: n choices per prompt from one replica call each
    want_n = single.completions.create(prompt=["The birds", "Count them"], n=2, **kw)
    got_n = c.completions.create(prompt=["The birds", "Count them"], n=2, **kw)
    assert [(ch.index, ch.text) for ch in got_n.choices] == \
        [(ch.index, ch.text) for ch in want_n.choices] and len(got_n.choices) == 4
    assert got_n.usage == want_n.usage
    stop = want.choices[0].text[2:4]  # in the output: the same seed draws the same tokens

    def streamed(cl) -> tuple[str, str]:
        chunks = list(cl.completions.create(prompt="The birds", stream=True,
                                            **(kw | {"stop": [stop]})))
        return ("".join(ch.choices[0].text for ch in chunks if ch.choices),
                chunks[-1].choices[0].finish_reason)

    assert streamed(c) == streamed(single)
    assert streamed(single)[1] == "stop"
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                temperature=0.8, seed=9, logprobs=True, top_logprobs=2)
    a, b = c.chat.completions.create(**chat), single.chat.completions.create(**chat)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [t.token for t in a.choices[0].logprobs.content] == \
        [t.token for t in b.choices[0].logprobs.content]


def test_killing_a_replica_mid_load(dp) -> None:
    before = pids(dp.metrics())
    assert set(before) == {"0", "1"}
    c = client_of(dp)
    first_chunk = []

    def long_one(i: int) -> tuple[str, str]:
        try:
            if i % 2:
                stream = c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                    max_tokens=300, stream=True, extra_body={"ignore_eos": True})
                n = 0
                for _ in stream:
                    n += 1
                    first_chunk.append(i)
                return "ok", str(n)
            ask(c, i, max_tokens=300, stream=False)
            return "ok", ""
        except openai.APIStatusError as exc:
            return f"status {exc.status_code}", str(exc.body)
        except openai.APIError as exc:  # an SSE error event
            return "sse error", exc.message

    start = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(long_one, i) for i in range(12)]
        deadline = time.monotonic() + 60
        while not first_chunk and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(before["0"], signal.SIGKILL)
        during = [pool.submit(ask, c, 100 + i) for i in range(4)]  # new requests keep working
        results = [f.result(timeout=150) for f in futures]
        assert all(isinstance(f.result(timeout=150), str) for f in during)
    assert time.monotonic() - start < 150  # nobody hung
    for outcome, detail in results:
        assert outcome in ("ok", "status 503", "sse error"), (outcome, detail)
        if outcome != "ok":
            assert "replica 0 failed while serving this request" in detail, detail
    text = dp.metrics()
    assert re.search(r'^spaceserve:replica_failures_total\{replica="0"\} [1-9]', text, re.M), \
        text[-2000:]
    # Ray restarts the replica; then both serve again
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = pids(text)
        if set(now) == {"0", "1"} and now["0"] != before["0"]:
            break
        time.sleep(1)
        text = dp.metrics()
    else:
        pytest.fail(f"replica 0 was not restarted: {pids(text)}\n{dp.tail()}")
    served0 = served_total(text, "0")
    with ThreadPoolExecutor(4) as pool:
        assert all(isinstance(t, str) for t in pool.map(lambda i: ask(c, i), range(8)))
    assert served_total(dp.metrics(), "0") > served0


def test_sigterm_stops_replicas_and_cluster(dp) -> None:
    family = descendants(dp.proc.pid)
    assert ray_processes(dp.temp), "the cluster's processes name its temp dir"
    start = time.monotonic()
    left = dp.stop()
    took = time.monotonic() - start
    assert dp.proc.returncode == 0, dp.tail()
    assert not left, left
    assert not alive(family)
    print(f"\nready after {dp.ready_s:.1f} s; stopped {took:.1f} s after SIGTERM")
