"""The body pre-scan (transport/prescan.py) and parsing off the event loop: every shape of
issue 37, scaled down, is refused before a full parse with a status naming its bound; bodies
within the bounds parse as before; a scan stops at a cancel point; bodies over 64 KiB are
parsed on the preprocessing pool under the request's deadline."""

from __future__ import annotations

import json
import threading
import time

import pytest

from spaceserve.server.openai import protocol as P
from spaceserve.server.transport.errors import APIError
from spaceserve.server.transport.prescan import ScanLimits, scan_json

pytest.importorskip("fastapi", reason="the serve extra is not installed")

LIM = ScanLimits(max_messages=50, max_parts=20, max_prompts=4, max_prompt_ids=64,
                 max_array=500, max_strings=2_000, max_containers=400, max_values=5_000)
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(body: dict | str, lim: ScanLimits = LIM) -> APIError:
    text = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(APIError) as info:
        scan_json(text, lim)
    return info.value


@pytest.mark.parametrize(("body", "status", "needle"), [
    (HI | {"ignored": [0] * 501}, 413, "more than 500 elements"),           # 15M zeros
    (HI | {"ignored": {str(i): 0 for i in range(501)}}, 413, "more than 500 elements"),
    ({"model": "m", "messages": [{"role": "user", "content": ""}] * 51}, 400,
     "--max-messages-per-request"),                                         # 900,000 messages
    ({"model": "m", "messages": [HI["messages"][0], {"role": "user", "content": [
        {"type": "text", "text": ""}] * 21}]}, 400, "messages[1].content: more than 20"),
    ({"model": "m", "prompt": [1] * 65}, 400, "more than 64 token ids"),   # 15M-id prompt
    ({"model": "m", "prompt": [[1, 2], [1] * 65]}, 400, "prompt[1]: more than 64 token ids"),
    ({"model": "m", "prompt": ["a"] * 5}, 400, "more than 4 prompts"),
    ({"model": "m", "prompt": [[1]] * 5}, 400, "more than 4 prompts"),
    (HI | {"x": [[]] * 401}, 413, "more than 400 arrays and objects"),
    (HI | {"x": [[""] * 400] * 6}, 413, "more than 2000 strings"),
    (HI | {"x": [[0] * 400] * 14}, 413, "more than 5256 JSON values"),
])
def test_each_shape_is_refused_naming_its_bound(body, status, needle) -> None:
    err = refused(body)
    assert err.status == status and needle in str(err), str(err)


def test_depth_bound_matches_the_parser_limit() -> None:
    ok = '{"model":"m","x":' + "[" * 31 + "]" * 31 + "}"
    scan_json(ok, LIM)
    err = refused('{"model":"m","x":' + "[" * 32 + "]" * 32 + "}")
    assert err.status == 400 and "deeper than 32" in str(err)


def test_bodies_within_the_bounds_pass_and_parse_as_before() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be {brief}, [ok] \\\" \u00e9"},
        {"role": "user", "content": [{"type": "text", "text": "a\"],}{" * 50}] * 20}] * 2,
        "logit_bias": {str(i): 1.0 for i in range(400)}, "stop": ["]", "}"], "seed": 3}
    scan_json(json.dumps(body), LIM)
    scan_json(json.dumps(body, indent=2), LIM)
    req = P.parse_body(json.dumps(body).encode(), P.ChatCompletionRequest, LIM)
    assert len(req.messages) == 4 and req.logit_bias["399"] == 1.0
    for junk in ('{"a": "unterminated', "[" * 10, "]]]", "", "nul", '{"a":1}}}', '"\\x"'):
        scan_json(junk, LIM)  # not JSON: the parser says what is wrong


def test_parse_body_refuses_before_json_loads(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(P.json, "loads", lambda *a, **k: calls.append(1))
    raw = bytearray(json.dumps(HI | {"ignored": [0] * 600}).encode())
    with pytest.raises(APIError) as info:
        P.parse_body(raw, P.ChatCompletionRequest, LIM)
    assert info.value.status == 413 and not calls and len(raw) == 0  # decoded, then freed


def test_surrogates_are_still_400s_and_pairs_pass() -> None:
    for raw in (b'{"model":"m","messages":[{"role":"user","content":"a\\ud800b"}]}',
                b'{"model":"m","messages":[{"role":"user","content":"a\xed\xa0\x80b"}]}'):
        with pytest.raises(APIError) as info:
            P.parse_body(raw, P.ChatCompletionRequest, LIM)
        assert info.value.status == 400 and "surrogate" in str(info.value)
    req = P.parse_body(b'{"model":"m","messages":[{"role":"user","content":"\\ud83d\\ude00"}]}',
                       P.ChatCompletionRequest, LIM)
    assert req.messages[0].content == "\U0001f600"


def test_a_scan_stops_at_a_cancel_point() -> None:
    from spaceserve.runtime.inputs import DeadlineExceeded, PreprocessPool, cancel_point

    text = json.dumps(HI | {"x": [{"a": [""]}] * 300_000})  # seconds of scanning
    lim = ScanLimits(max_containers=10**7, max_strings=10**7, max_values=10**7)
    pool = PreprocessPool(light_workers=1, heavy_workers=1)
    started = threading.Event()
    fut = pool.submit(lambda: (started.set(), scan_json(text, lim, cancel_point)))
    assert started.wait(5)
    t0 = time.monotonic()
    fut.cancel()  # the caller gives up: the running scan raises at its next cancel point
    assert isinstance(fut.exception(timeout=5), DeadlineExceeded)
    assert time.monotonic() - t0 < 1.0
    pool.shutdown()


def test_large_bodies_parse_on_the_pool_under_the_deadline(tiny_engine, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from tests.server.conftest import MODEL, make_app

    engine, pre = tiny_engine
    client, app = make_app(engine, pre)
    threads = []
    real = P.parse_body

    def spy(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(P, "parse_body", spy)
    hi = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as tc:
        assert tc.post("/v1/chat/completions", json=hi).status_code == 200
        big = hi | {"pad": "x" * 100_000}
        assert tc.post("/v1/chat/completions", json=big).status_code == 200
        r = tc.post("/v1/chat/completions", json=hi | {"ignored": [0] * 300_000})
        assert r.status_code == 413 and "200000 elements" in r.json()["error"]["message"]
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 70_000})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        app.state.preprocess_timeout_s = 1e-6  # the deadline passes while parsing: 503
        r = tc.post("/v1/chat/completions", json=big)
        assert r.status_code == 503 and "parsing" in r.json()["error"]["message"]
    assert threads[0] == "MainThread" or not threads[0].startswith("spaceserve-prep")
    assert all(t.startswith("spaceserve-prep-light") for t in threads[1:]), threads
    client.close()


def test_flags_set_the_bounds_and_bad_values_name_the_flag() -> None:
    from spaceserve.server.flags import build_parser
    from spaceserve.server.settings import ServeSettings

    parse = build_parser().parse_args
    s = ServeSettings.from_args(parse([]))
    assert (s.limits.scan.max_messages, s.limits.scan.max_parts) == (10_000, 1_000)
    assert (s.limits.stream.stall_s, s.limits.stream.write_timeout_s) == (2.0, 60.0)
    s = ServeSettings.from_args(parse(["--max-messages-per-request", "7",
                                       "--max-parts-per-message", "3",
                                       "--stream-stall-timeout", "0.5",
                                       "--stream-write-timeout", "9"]))
    assert (s.limits.scan.max_messages, s.limits.scan.max_parts) == (7, 3)
    assert (s.limits.stream.stall_s, s.limits.stream.write_timeout_s) == (0.5, 9.0)
    for argv, needle in ((["--max-messages-per-request", "0"], "--max-messages-per-request"),
                         (["--max-parts-per-message", "-1"], "--max-parts-per-message"),
                         (["--stream-stall-timeout", "0"], "--stream-stall-timeout"),
                         (["--stream-stall-timeout", "9", "--stream-write-timeout", "3"],
                          "--stream-write-timeout >= --stream-stall-timeout")):
        with pytest.raises(ValueError, match=needle):
            ServeSettings.from_args(parse(argv))
