"""Parallel sampling (``n`` > 1) through both endpoints of a live tiny server (max_num_seqs 4,
no encoder cache, so every encoder pass shows in the counter): streamed chat choices carry
their indexes and finish on their own last chunks, completions number choices prompt * n + j,
each choice equal to an n = 1 request with seed + j; n above max_num_seqs is a 400 naming n;
an image prompt is encoded and prefilled once for all its choices; a client that goes away
ends every choice."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
openai = pytest.importorskip("openai", reason="the serve extra is not installed")

from spaceserve.runtime.core.request import SamplingParams  # noqa: E402
from spaceserve.server.app import ServerThread  # noqa: E402
from spaceserve.server.engine_client import load_engine  # noqa: E402
from spaceserve.server.metrics import parse_gauges  # noqa: E402
from spaceserve.server.transport.errors import APIError  # noqa: E402

from .conftest import MODEL, make_app, png, wait_until  # noqa: E402

SAMPLE = dict(max_tokens=5, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True})
MSG = [{"role": "user", "content": "Tell me two stories."}]
COUNTERS = ("encoder_jobs_total", "prefix_cache_queried_tokens_total",
            "prefix_cache_hit_tokens_total", "prefill_tokens_computed_total")


@pytest.fixture(scope="module")
def server(tiny_path):
    """(engine, client, live server): at most 4 sequences at once, no encoder cache."""
    engine, pre, _ = load_engine(str(tiny_path), device="cpu", max_num_seqs=4,
                                 encoder_cache_bytes=0)
    client, app = make_app(engine, pre)
    with ServerThread(app) as srv:
        yield engine, client, srv
    client.close()


def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def idle(engine) -> None:
    assert wait_until(lambda: not engine.has_unfinished(), 10)
    engine.check_idle()


def test_streamed_chat_choices_carry_their_index(server) -> None:
    engine, _, srv = server
    oa = oai(srv)
    plain = oa.chat.completions.create(model=MODEL, messages=MSG, n=2, **SAMPLE)
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.usage.completion_tokens == 10
    chunks = list(oa.chat.completions.create(model=MODEL, messages=MSG, n=2, stream=True,
                                             stream_options={"include_usage": True}, **SAMPLE))
    *body, last = chunks
    assert last.choices == [] and last.usage == plain.usage  # one usage chunk, the totals
    per: dict[int, list] = {0: [], 1: []}
    for ch in body:
        assert len(ch.choices) == 1 and ch.usage is None
        per[ch.choices[0].index].append(ch.choices[0])
    for i, got in per.items():
        assert got[0].delta.role == "assistant" and all(c.delta.role is None for c in got[1:])
        assert [c.finish_reason for c in got] == [None] * (len(got) - 1) + ["length"]
        assert "".join(c.delta.content or "" for c in got) == plain.choices[i].message.content
        assert [t for c in got for t in c.model_extra["token_ids"]] == \
            plain.choices[i].model_extra["token_ids"]
    idle(engine)


def test_completions_number_choices_prompt_by_prompt(server) -> None:
    engine, _, srv = server
    oa = oai(srv)
    prompts = ["The cat", "A plate of bread"]
    r = oa.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, **SAMPLE)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    lengths = []
    for p, prompt in enumerate(prompts):
        for j in (0, 1):
            ref = oa.completions.create(model=MODEL, prompt=prompt, echo=True,
                                        **(SAMPLE | {"seed": 11 + j}))
            mine = r.choices[p * 2 + j]
            assert mine.text == ref.choices[0].text and mine.text.startswith(prompt)
            assert mine.model_extra["token_ids"] == ref.choices[0].model_extra["token_ids"]
        lengths.append(ref.usage.prompt_tokens)
    assert r.usage.prompt_tokens == sum(lengths) and r.usage.completion_tokens == 20
    chunks = list(oa.completions.create(model=MODEL, prompt=prompts, n=2, echo=True,
                                        stream=True, stream_options={"include_usage": True},
                                        **SAMPLE))
    *body, last = chunks
    assert last.choices == [] and last.usage == r.usage
    for i in range(4):
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == i]
        assert "".join(c.text for c in mine) == r.choices[i].text
        assert [t for c in mine for t in c.model_extra["token_ids"]] == \
            r.choices[i].model_extra["token_ids"]  # also those of text held back
        assert [c.finish_reason for c in mine][-1] == "length"
    idle(engine)


def test_n_above_max_num_seqs_is_a_400_naming_n(server) -> None:
    engine, client, srv = server
    oa = oai(srv)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(model=MODEL, messages=MSG, n=5, stream=stream, **SAMPLE)
        assert err.value.body["param"] == "n"
        assert "max_num_seqs=4" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model=MODEL, prompt=["a", "b"], n=5, stream=stream, **SAMPLE)
        assert err.value.body["param"] == "n"
    # best_of is neutral at n, refused above it
    assert len(oa.completions.create(model=MODEL, prompt="a", n=4, best_of=4,
                                     **SAMPLE).choices) == 4
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=MODEL, prompt="a", n=2, best_of=3, **SAMPLE)
    assert err.value.body["param"] == "best_of"

    async def engine_refuses() -> APIError:  # the engine's own check, past the server's
        handle = client.reserve("n-past-the-server")
        try:
            with pytest.raises(APIError) as refused:
                handle.add({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, n=5),
                           stream=False)
            return refused.value
        finally:
            handle.close()

    refused = asyncio.run(engine_refuses())
    assert refused.status == 400 and refused.param == "n", refused.message
    assert "max_num_seqs" in refused.message
    idle(engine)


def test_an_image_prompt_is_encoded_and_prefilled_once(server) -> None:
    engine, _, srv = server
    url = "data:image/png;base64," + base64.b64encode(png(56, 84, seed=21)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Two captions."}]}]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        before = parse_gauges(http.get("/metrics").text)
        r = oai(srv).chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLE)
        after = parse_gauges(http.get("/metrics").text)
    d = {k: after["spaceserve:" + k] - before["spaceserve:" + k] for k in COUNTERS}
    n = r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    assert d["encoder_jobs_total"] == 1
    assert d["prefix_cache_queried_tokens_total"] == n
    assert d["prefill_tokens_computed_total"] + d["prefix_cache_hit_tokens_total"] == n
    idle(engine)


def test_a_client_that_goes_away_ends_every_choice(server) -> None:
    engine, client, srv = server
    body = {"model": MODEL, "messages": MSG, "n": 3, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    assert wait_until(lambda: client.num_pending == 0, 10)
    idle(engine)
