"""The server on the tiny Qwen2-VL, live on loopback: the openai client and raw HTTP see exact
OpenAI formats, usage counts image tokens, and the tokens equal `Engine.generate`'s."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from spaceserve import SamplingParams
from spaceserve.server.openai.protocol import chat_messages, parse_request

from .conftest import MODEL, png

IMAGE = png(60, 90, seed=1)  # resized to 56x84: a 4x6 patch grid, 2x3 merged = 6 image tokens
URL = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                         {"type": "text", "text": "Describe this image."}]}]
PARAMS = dict(max_tokens=6, temperature=0.8, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_engine):
    """(prompt ids, output ids, text) from Engine.generate on the same chat prompt."""
    import io

    from PIL import Image

    engine, pre = tiny_engine
    text = pre.render(chat_messages(parse_request(json.dumps({"model": MODEL,
                                                              "messages": MESSAGES}).encode())))[0]
    img = Image.open(io.BytesIO(IMAGE)).convert("RGB")
    out = engine.generate({"prompt": text, "images": [img]},
                          SamplingParams(ignore_eos=True, **PARAMS))[0]
    text_only = pre.tokenizer(text)["input_ids"]
    return out.prompt_token_ids, out.token_ids, out.text, len(text_only)


@pytest.fixture(scope="module")
def openai_client(live_tiny):
    openai = pytest.importorskip("openai", reason="the serve extra is not installed")

    return openai.OpenAI(base_url=live_tiny[1].url + "/v1", api_key="unused", max_retries=0)


def test_nonstreaming_format_usage_and_tokens(openai_client, expected) -> None:
    prompt_ids, out_ids, text, n_text = expected
    r = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, **PARAMS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == text
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].token_ids == out_ids  # the same tokens as Engine.generate
    assert r.prompt_token_ids == prompt_ids
    # usage counts the image's tokens (6 of them replace one placeholder)
    assert r.usage.prompt_tokens == len(prompt_ids) == n_text - 1 + 6
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == len(prompt_ids) + 6


def test_streaming_chunks_and_usage(openai_client, expected) -> None:
    prompt_ids, out_ids, text, _ = expected
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, **PARAMS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == len(out_ids)
    assert all(c.usage is None for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in body[1:])
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text


def test_raw_sse_framing(live_tiny) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
            "max_completion_tokens": 3, "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live_tiny[1].url) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = r.text.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        objs = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert all(e.startswith("data: ") for e in events[:-1])
        assert all("usage" not in o for o in objs)  # no include_usage: no usage keys
        assert objs[-1]["choices"][0]["finish_reason"] == "length"
        # max_completion_tokens wins over max_tokens
        r = http.post("/v1/chat/completions", json=body | {"stream": False,
                                                           "return_token_ids": True})
        assert r.json()["usage"]["completion_tokens"] == 3


def test_models_health_and_metrics(openai_client, live_tiny) -> None:
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with httpx.Client(base_url=live_tiny[1].url) as http:
        assert http.get("/health").json()["status"] == "ok"
        text = http.get("/metrics").text
    for name in ("num_requests_waiting", "num_requests_running", "encoder_queue_depth",
                 "encoder_sms", "decoder_sms", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_count", "request_slo_total", "slo_info"):
        assert f"spaceserve:{name}" in text, name
    count = [ln for ln in text.splitlines()
             if ln.startswith("spaceserve:time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[1]) >= 1
