"""Multi-turn image chat against a live tiny server with the default engine settings (encoder
cache and prefix caching on): the second turn runs no encoder job and prefills only what the
prefix cache lacks - read from /metrics - and its greedy tokens equal those of a cold engine;
n = 3 processes its prompt once; the flags that switch the caches off parse."""

from __future__ import annotations

import base64

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from spaceserve.server.app import ServerThread, build_parser
from spaceserve.server.engine_client import load_engine
from spaceserve.server.metrics import parse_gauges

from .conftest import MODEL, make_app, png, wait_until

URL = "data:image/png;base64," + base64.b64encode(png(84, 112, seed=3)).decode()
QUESTION = [{"type": "image_url", "image_url": {"url": URL}},
            {"type": "text", "text": "What is in this picture?"}]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
COUNTERS = ("encoder_cache_queries_total", "encoder_cache_hits_total", "encoder_jobs_total",
            "prefix_cache_queried_tokens_total", "prefix_cache_hit_tokens_total",
            "prefill_tokens_computed_total")


@pytest.fixture(scope="module")
def default_server(tiny_path):
    """A live server whose engine has `spaceserve serve`'s defaults (only the device named)."""
    engine, pre, _ = load_engine(str(tiny_path), device="cpu")
    assert engine.config.enable_prefix_caching and engine.encoder_cache.enabled
    client, app = make_app(engine, pre)
    with ServerThread(app) as server:
        yield engine, server
    client.close()


def counters(http: httpx.Client) -> dict[str, float]:
    found = parse_gauges(http.get("/metrics").text)
    return {k: found["spaceserve:" + k] for k in COUNTERS}


def chat(http: httpx.Client, messages: list) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages} | GREEDY)
    assert r.status_code == 200, r.text
    return r.json()


def test_second_turn_skips_the_encoder_and_the_cached_prefill(default_server, tiny_path) -> None:
    engine, server = default_server
    bs = engine.config.block_size
    turn1 = [{"role": "user", "content": QUESTION}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        c0 = counters(http)
        r1 = chat(http, turn1)
        c1 = counters(http)
        assert c1["encoder_jobs_total"] - c0["encoder_jobs_total"] == 1
        n1 = r1["usage"]["prompt_tokens"]
        # the same conversation again: nothing encoded, only its last block prefilled
        again = chat(http, turn1)
        c2 = counters(http)
        assert again["choices"][0]["token_ids"] == r1["choices"][0]["token_ids"]
        hit = (n1 - 1) // bs * bs
        assert c2["encoder_jobs_total"] == c1["encoder_jobs_total"]
        assert c2["encoder_cache_hits_total"] - c1["encoder_cache_hits_total"] == 1
        assert c2["encoder_cache_queries_total"] - c1["encoder_cache_queries_total"] == 1
        assert c2["prefix_cache_hit_tokens_total"] - c1["prefix_cache_hit_tokens_total"] == hit
        assert c2["prefix_cache_queried_tokens_total"] - \
            c1["prefix_cache_queried_tokens_total"] == n1
        assert c2["prefill_tokens_computed_total"] - c1["prefill_tokens_computed_total"] \
            == n1 - hit
        # the next turn: the first one's prompt, its answer and a new question
        turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And what colour is it?"}]
        r2 = chat(http, turn2)
        c3 = counters(http)
    n2 = r2["usage"]["prompt_tokens"]
    new_hit = c3["prefix_cache_hit_tokens_total"] - c2["prefix_cache_hit_tokens_total"]
    assert c3["encoder_jobs_total"] == c1["encoder_jobs_total"], "the image was encoded again"
    assert c3["encoder_cache_hits_total"] - c2["encoder_cache_hits_total"] == 1
    assert new_hit >= n1 // bs * bs, "turn 1's prompt was not reused"
    assert c3["prefill_tokens_computed_total"] - c2["prefill_tokens_computed_total"] \
        == n2 - new_hit
    # a cold engine (caches empty) gives the same greedy tokens for the second turn
    cold, pre, _ = load_engine(str(tiny_path), device="cpu")
    client, app = make_app(cold, pre)
    with ServerThread(app) as fresh, httpx.Client(base_url=fresh.url, timeout=60) as http:
        ref = chat(http, turn2)
        assert counters(http)["prefix_cache_hit_tokens_total"] == 0
    client.close()
    assert r2["prompt_token_ids"] == ref["prompt_token_ids"]
    assert r2["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    engine.check_idle()


def test_cache_flags() -> None:
    args = build_parser().parse_args([])
    assert args.encoder_cache_bytes is None and args.prefix_caching is True
    args = build_parser().parse_args(["--encoder-cache-bytes", "0", "--no-prefix-caching"])
    assert args.encoder_cache_bytes == 0 and args.prefix_caching is False


def test_n3_through_the_openai_client(default_server) -> None:
    """n = 3 through the official client: three choices (indexes 0, 1, 2), choice 1 equal to
    an n = 1 request with seed + 1; the prompt looked up and computed once (the counters rise
    as for that n = 1 request), its image encoded once, every block free afterwards."""
    openai = pytest.importorskip("openai")
    engine, server = default_server
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    image = "data:image/png;base64," + base64.b64encode(png(56, 84, seed=11)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "Three guesses, please."}]}]
    sample = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    with httpx.Client(base_url=server.url, timeout=60) as http:
        c0 = counters(http)
        three = oa.chat.completions.create(n=3, seed=5, **sample)
        c1 = counters(http)
        one = oa.chat.completions.create(n=1, seed=6, **sample)
        c2 = counters(http)
        assert wait_until(lambda: not engine.has_unfinished())
        kv = parse_gauges(http.get("/metrics").text)["spaceserve:kv_cache_usage_perc"]
    assert [c.index for c in three.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in three.choices]
    assert all(len(t) == 6 for t in ids) and len({tuple(t) for t in ids}) > 1
    assert {c.finish_reason for c in three.choices} == {"length"}
    assert ids[1] == one.choices[0].model_extra["token_ids"]
    assert three.choices[1].message.content == one.choices[0].message.content
    n = one.usage.prompt_tokens
    assert three.usage.prompt_tokens == n and three.usage.completion_tokens == 18
    assert three.usage.total_tokens == n + 18
    d3 = {k: c1[k] - c0[k] for k in COUNTERS}
    d1 = {k: c2[k] - c1[k] for k in COUNTERS}
    # looked up and computed once: as much as the n = 1 request (which hit the cache instead)
    assert d3["prefix_cache_queried_tokens_total"] == d1["prefix_cache_queried_tokens_total"] == n
    assert d3["prefill_tokens_computed_total"] + d3["prefix_cache_hit_tokens_total"] == n
    assert d1["prefill_tokens_computed_total"] + d1["prefix_cache_hit_tokens_total"] == n
    assert d3["encoder_jobs_total"] == 1 and d1["encoder_jobs_total"] == 0
    assert kv == 0.0
    engine.check_idle()
