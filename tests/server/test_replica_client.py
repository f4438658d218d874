"""The replica set's engine client behind the single server's app, with fake replicas (no Ray):
routing through the tracker, retry once before anything was sent, clear 503s after, no hang
when no replica takes a request, and /metrics with totals plus per-replica series."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from spaceserve.runtime.core.request import RequestMetrics, RequestOutput
from spaceserve.runtime.routing.tracker import ReplicaTracker
from spaceserve.server.replicas.client import ReplicaClient
from spaceserve.server.replicas.metrics import families, merge, with_label

from .conftest import MODEL, wait_until

openai = pytest.importorskip("openai", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")


class Died(Exception):
    """A fake replica's process died."""


class FakeReplicas:
    """Replicas "0" and "1" behind the tracker, routed as the Ray router routes. `plans[label]`
    = outputs a replica sends before it dies (None: never dies); `hang` makes routing never
    happen; `raise_other` raises an unrelated exception."""

    def __init__(self, tracker: ReplicaTracker) -> None:
        self.tracker = tracker
        self.plans: dict[str, int | None] = {}
        self.hang = False
        self.raise_other = False
        self.error_item: tuple | None = None
        self.served: list[str] = []
        self.params: list = []
        self.cancelled = 0
        self.delay = 0.002  # seconds per token

    def is_replica_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, Died)

    async def stream(self, kwargs):
        if self.hang:
            await asyncio.sleep(3600)
        if self.raise_other:
            raise ValueError("a bug")
        route, exclude = kwargs["route"], kwargs["exclude"]
        key = self.tracker.rank(route, self.tracker.keys(),
                                exclude=() if exclude is None else (exclude,))[0]
        self.tracker.on_routed(key, route, stream=kwargs["stream"])
        label = str(self.tracker.info_of(key)["rank"])
        self.served.append(label)
        self.params.append(kwargs["params"])
        if self.error_item is not None:
            yield self.error_item
            return
        rid, params, stream = kwargs["request_id"], kwargs["params"], kwargs["stream"]
        prompt = kwargs["prompt"]["prompt_token_ids"]
        budget = self.plans.get(label)
        now = time.monotonic()
        tokens: list[list[int]] = [[] for _ in range(params.n)]  # choice j writes chr(x + j)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay)
                last = i == params.max_tokens - 1
                for j, toks in enumerate(tokens):  # the n choices' outputs interleave
                    toks.append(100 + i + 50 * j)
                    if not (stream or last):
                        continue
                    if budget is not None and budget <= 0:
                        raise Died("The actor died unexpectedly before finishing this task.")
                    budget = None if budget is None else budget - 1
                    yield ("out", label, RequestOutput(
                        rid, prompt, list(toks), [toks[-1]], last,
                        "length" if last else None, None,
                        RequestMetrics(now, now + 0.001, tuple(now + 0.001 * (k + 1) for k in
                                                              range(len(toks))),
                                       now + 0.01 if last else None),
                        delta_text=chr(ord("x") + j), text_source=chr(ord("x") + j) * len(toks),
                        index=j))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def two_replicas() -> ReplicaTracker:
    tracker = ReplicaTracker(None)
    tracker.sync({"k0": {"rank": 0, "pid": 10, "gauges": [["num_requests_running", "h", 1],
                                                     ["kv_cache_usage_perc", "h", 0.5]],
                         "kv_blocks_total": 10, "kv_blocks_free": 5},
                  "k1": {"rank": 1, "pid": 11, "gauges": [["num_requests_running", "h", 2],
                                                     ["kv_cache_usage_perc", "h", 0.0]],
                         "kv_blocks_total": 10, "kv_blocks_free": 10}})
    return tracker


@pytest.fixture
def fake(preprocessor):
    """(fake replicas, live server URL, client)."""
    from spaceserve.server.app import ServerThread, create_app

    tracker = two_replicas()
    reps = FakeReplicas(tracker)
    client = ReplicaClient(reps, tracker, max_model_len=256, mode="temporal", num_replicas=2,
                           image_token_id=preprocessor.image_token_id, max_pending=8,
                           route_timeout_s=1.0)
    app = create_app(client, preprocessor, model_name=MODEL)
    with ServerThread(app) as server:
        yield reps, server.url, client
    client.close()


def oai(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, stream: bool = False, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4,
        stream=stream, **kw)


def test_requests_spread_and_metrics_carry_each_replica(fake) -> None:
    reps, url, client = fake
    c = oai(url)
    for i in range(6):
        if i % 2:
            assert "".join(ch.choices[0].delta.content or "" for ch in chat(c, True)
                           if ch.choices) == "xxxx"
        else:
            assert chat(c).choices[0].message.content == "xxxx"
    assert sorted(set(reps.served)) == ["0", "1"]
    text = httpx.get(url + "/metrics").text
    fams = families(text)
    current = None
    for line in text.splitlines():  # a family's samples all follow its one TYPE line
        if line.startswith("# TYPE "):
            current = line.split()[2]
            assert text.count(f"# TYPE {current} ") == 1, current
        elif not line.startswith("#"):
            assert current and line.startswith(current), (current, line)
    ok = fams["spaceserve:request_success_total"][1]
    assert 'spaceserve:request_success_total{finished_reason="length"} 6' in ok
    per = {lab: sum(int(s.rsplit(" ", 1)[1]) for s in ok if f'replica="{lab}"' in s)
           for lab in "01"}
    assert per["0"] + per["1"] == 6 and min(per.values()) > 0
    running = fams["spaceserve:num_requests_running"][1]
    assert running[:3] == ["spaceserve:num_requests_running 3.0",
                           'spaceserve:num_requests_running{replica="0"} 1.0',
                           'spaceserve:num_requests_running{replica="1"} 2.0']
    assert "spaceserve:kv_cache_usage_perc 0.25" in text  # 5 of 20 blocks in use
    assert "spaceserve:num_replicas 2.0" in text
    assert 'spaceserve:replica_info{replica="1",node="",pid="11",replica_id="k1"} 1' in text
    assert text.rstrip().endswith('spaceserve:mode_info{mode="temporal"} 1')


def test_completions_go_through_the_replicas(fake) -> None:
    """/v1/completions over the replica set: a list of prompts is one request per prompt, each
    routed; plain and streamed; its sampling parameters reach the replica."""
    reps, url, _ = fake
    c = oai(url)
    r = c.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3,
                             stop=["zz"], seed=5, extra_body={"top_k": 4})
    assert [ch.text for ch in r.choices] == ["xxx"] * 3
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 9
    assert len(reps.served) == 3 and sorted(set(reps.served)) == ["0", "1"]
    assert {(p.stop, p.seed, p.top_k) for p in reps.params} == {(("zz",), 5, 4)}
    chunks = list(c.completions.create(model=MODEL, prompt="four", max_tokens=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "xx"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_parallel_sampling_goes_through_the_replicas(fake, preprocessor) -> None:
    """n = 2 over the replica set: one replica call per prompt carrying n, both choices back
    (plain and streamed, their chunks interleaved), usage over both; a replica that dies
    mid-stream ends it with an error event; n above the replicas' max_num_seqs is a 400
    naming n before any replica sees it."""
    reps, url, client = fake
    c = oai(url)
    r = chat(c, n=2)
    assert [(ch.index, ch.message.content, ch.finish_reason) for ch in r.choices] == \
        [(0, "xxxx", "length"), (1, "yyyy", "length")]
    assert r.usage.completion_tokens == 8 and len(reps.params) == 1 and reps.params[0].n == 2
    chunks = [ch for ch in chat(c, True, n=2, stream_options={"include_usage": True})]
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert texts == {0: "xxxx", 1: "yyyy"} and chunks[-1].usage.completion_tokens == 8
    assert [ch.choices[0].index for ch in chunks[:4]] == [0, 1, 0, 1]
    reps.plans = {"0": 3, "1": 3}  # dies after three outputs: no retry once sent
    got = []
    with pytest.raises(openai.APIError) as err:
        for ch in chat(c, True, n=2):
            got.append(ch)
    assert len(got) == 3 and "after part of the answer was sent" in str(err.value.message)
    reps.plans = {}
    served = len(reps.served)
    client.engine = type(client.engine)(256, 2)  # the replicas run 2 sequences at most
    from spaceserve.server.app import create_app
    from spaceserve.server.transport.thread import ServerThread

    with ServerThread(create_app(client, preprocessor, model_name=MODEL)) as server:
        with pytest.raises(openai.BadRequestError) as err:
            chat(oai(server.url), n=3)
        assert err.value.body["param"] == "n" and "max_num_seqs=2" in err.value.body["message"]
        assert chat(oai(server.url), n=2).choices[1].message.content == "yyyy"
    assert len(reps.served) == served + 1
    assert client.num_pending == 0 and wait_until(lambda: not client.tracker._flights)


def test_a_replica_that_dies_before_answering_is_retried_once(fake) -> None:
    reps, url, client = fake
    reps.plans = {"0": 0}  # replica 0 dies before its first output
    c = oai(url)
    for stream in (False, True):
        if stream:
            assert "".join(ch.choices[0].delta.content or "" for ch in chat(c, True)
                           if ch.choices) == "xxxx"
        else:
            assert chat(c).choices[0].message.content == "xxxx"
    text = httpx.get(url + "/metrics").text
    retried = client.metrics.retried
    assert retried >= 1 and f"spaceserve:request_retries_total {retried}" in text
    assert f'spaceserve:replica_failures_total{{replica="0"}} {retried}' in text


def test_failures_end_with_clear_503s(fake) -> None:
    reps, url, client = fake
    reps.plans = {"0": 0, "1": 0}  # every replica dies: the retry fails too
    c = oai(url)
    with pytest.raises(openai.InternalServerError) as err:
        chat(c)
    assert err.value.status_code == 503
    body = err.value.body
    assert body["type"] == "server_error" and "replica" in body["message"]
    assert "retried on" in body["message"]
    # a stream that already sent tokens is not retried: it ends with an SSE error event
    reps.plans = {"0": 2, "1": 2}
    chunks = []
    with pytest.raises(openai.APIError) as err:
        for ch in chat(c, True):
            chunks.append(ch)
    assert chunks and "after part of the answer was sent" in str(err.value.message)
    assert client.num_pending == 0 and wait_until(lambda: not client.tracker._flights)


def test_no_replica_taking_the_request_does_not_hang(fake) -> None:
    reps, url, client = fake
    reps.hang = True
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        chat(oai(url))
    assert err.value.status_code == 503 and "no replica took" in err.value.body["message"]
    assert time.monotonic() - start < 10
    reps.hang = False
    assert chat(oai(url)).choices[0].message.content == "xxxx"


def test_other_errors_and_replica_errors(fake) -> None:
    reps, url, _ = fake
    reps.raise_other = True
    with pytest.raises(openai.InternalServerError) as err:
        chat(oai(url))
    assert err.value.status_code == 500 and "internal error: ValueError" in str(err.value)
    reps.raise_other = False
    reps.error_item = ("error", 400, "max_tokens is too large")  # a replica refused it
    with pytest.raises(openai.BadRequestError, match="too large"):
        chat(oai(url))


def test_a_client_that_goes_away_cancels_the_replica_call(fake) -> None:
    reps, url, client = fake
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["choices"]
                break
    assert wait_until(lambda: reps.cancelled == 1 and client.num_pending == 0)
    assert wait_until(lambda: not client.tracker._flights)


def test_health_follows_the_replicas(fake) -> None:
    reps, url, client = fake
    assert httpx.get(url + "/health").json() == {"status": "ok", "mode": "temporal",
                                                  "note": None}
    client.tracker.remove("k1")
    assert httpx.get(url + "/health").json()["note"] == "1 of 2 replicas running"
    client.tracker.remove("k0")
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["status"] == "dead"


def test_label_merge_helpers() -> None:
    assert with_label('a{b="c"} 1', "replica", "0") == 'a{replica="0",b="c"} 1'
    assert with_label("a 1", "replica", "2") == 'a{replica="2"} 1'
    total = "# HELP x X\n# TYPE x gauge\nx 3\n# TYPE y counter\ny 1\n"
    out = merge(total, {"0": "# TYPE x gauge\nx 1\n# TYPE z gauge\nz 5\n", "1": "x 2\n"})
    assert out.splitlines() == ["# HELP x X", "# TYPE x gauge", "x 3", 'x{replica="0"} 1',
                                'x{replica="1"} 2', "# TYPE y counter", "y 1",
                                "# TYPE z gauge", 'z{replica="0"} 5']


def test_the_replica_set_is_bounded_and_drains_as_one_server(preprocessor) -> None:
    """The single server's hardening holds over replicas: a request over its pixel budget is
    a 413 no replica sees, a lone surrogate a 400; a drain answers new work 503 with
    Retry-After, ends a live stream with a final shutdown error event, cancels the replica's
    call, and the server exits within its bound."""
    import base64
    import io

    from PIL import Image

    from spaceserve.runtime.inputs import ImageLimits
    from spaceserve.server.app import ServerLimits, ServerThread, create_app

    tracker = two_replicas()
    reps = FakeReplicas(tracker)
    reps.delay = 0.05  # 200 tokens: 10 s, far past the drain's bound
    client = ReplicaClient(reps, tracker, max_model_len=256, mode="temporal", num_replicas=2,
                           image_token_id=preprocessor.image_token_id, max_pending=8)
    limits = ServerLimits(images=ImageLimits(max_request_pixels=100 * 100))
    app = create_app(client, preprocessor, model_name=MODEL, limits=limits)
    buf = io.BytesIO()
    Image.new("RGB", (120, 100)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    big = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}
    long = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "stream": True}
    with ServerThread(app, client=client, graceful_timeout_s=0.5) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413 and "12000 pixels" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       content=b'{"model":"%s","messages":[{"role":"user","content":"\\ud800"}]}'
                       % MODEL.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert not reps.served

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                async with http.stream("POST", "/v1/chat/completions", json=long) as r:
                    lines = r.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    server.server.begin_drain()
                    health = await http.get("/health")
                    new = await http.post("/v1/chat/completions", json=long)
                    rest = [line async for line in lines if line]
                # the request's end cancelled its replica call (not the server's exit)
                await asyncio.sleep(0.1)
                return health, new, rest, reps.cancelled

        t0 = time.monotonic()
        health, new, rest, cancelled = asyncio.run(go())
        assert cancelled == 1
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert new.status_code == 503 and new.headers["retry-after"] == "1"
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "shutdown"
        server.thread.join(timeout=5)
        assert not server.thread.is_alive() and time.monotonic() - t0 < 6.0
    assert wait_until(lambda: reps.cancelled == 1 and client.num_pending == 0)
    client.close()


def test_bad_engine_settings_fail_once_before_any_replica_starts() -> None:
    """A setting every replica would refuse (a bad field, or green contexts demanded on a
    device without them) fails at once in the driver, not in each replica Ray restarts."""
    from spaceserve.server.replicas.deploy import DataParallelServer

    bad = DataParallelServer(MODEL, data_parallel_size=2, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        bad._check_engine_kwargs()
    green = DataParallelServer(MODEL, data_parallel_size=2, device="cpu", mode="spatial",
                               green_contexts="on")
    with pytest.raises(ValueError, match="--green-contexts on"):
        green._check_engine_kwargs()
    DataParallelServer(MODEL, data_parallel_size=2, device="cpu", mode="spatial",
                       green_contexts=True)._check_engine_kwargs()


def test_the_ingress_sheds_with_503_when_no_replica_can_meet_the_bound(preprocessor) -> None:
    """SLO-aware admission at the ingress: every replica's queue is past the TTFT bound, so
    the request is answered 503 with Retry-After at once and never sent to a replica; a
    replica's own refusal keeps its Retry-After through the ingress."""
    from spaceserve.runtime.policy.admission import AdmissionPolicy
    from spaceserve.runtime.policy.analytic.model import analytic_curves
    from spaceserve.runtime.routing.router import RouteRequest, WorkModel
    from spaceserve.server.app import ServerThread, create_app

    tracker = ReplicaTracker(WorkModel(analytic_curves()), admission=AdmissionPolicy(
        "ttft:1000,tpot:50", order="fifo", calibrate=False))
    tracker.sync({"k0": {"rank": 0}, "k1": {"rank": 1}})
    for key in ("k0", "k1"):
        for i in range(40):
            tracker.on_routed(key, RouteRequest(f"{key}-{i}", 2723, image_tokens=(2691,)))
    reps = FakeReplicas(tracker)
    client = ReplicaClient(reps, tracker, max_model_len=256, mode="temporal", num_replicas=2,
                           image_token_id=preprocessor.image_token_id, max_pending=8)
    app = create_app(client, preprocessor, model_name=MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with ServerThread(app) as server:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 2
        assert r.json()["error"]["code"] == "overloaded" and took < 1.0
        assert reps.served == [] and tracker.admission.refused == 1
        assert 'requests_shed_total{when="arrival"} 1' in httpx.get(server.url + "/metrics").text
        for key in ("k0", "k1"):  # the queues drain: a replica takes requests again
            for i in range(40):
                tracker.on_finished(f"{key}-{i}")
        reps.error_item = ("error", 503, "overloaded: replica refusal", None, 7)
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert reps.served == ["0"]
    client.close()
