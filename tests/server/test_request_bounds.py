"""Per-request bounds (server/openai/bounds.py) on the null model, in-process: prompts x n
sequences and sequences x max_tokens tokens per request, each refusal a 400 naming the
parameter, the bound and its flag; a request without max_tokens capped at its share; the same
answers from engine replicas. And the small defects around them: every bad prompt of
/v1/completions is ``param: "prompt"``, logit_bias keys are ASCII decimal token ids only."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from spaceserve.runtime.inputs import ImageLimits
from spaceserve.server.openai.bounds import RequestBounds
from spaceserve.server.transport.errors import APIError

from .conftest import MODEL, make_app, null_engine

pytest.importorskip("fastapi", reason="the serve extra is not installed")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CMPL = {"model": MODEL, "prompt": "The cat"}


def limits(**kw):
    from spaceserve.server.settings import ServerLimits

    kw.setdefault("max_tokens_per_request", 1024)  # what the test engine's KV cache holds
    return ServerLimits(max_body_bytes=1 << 20, images=ImageLimits(), **kw)


@pytest.fixture(scope="module")
def engine(preprocessor):
    # max_num_seqs 16, 256 blocks of 4 tokens: the KV cache holds 1024 tokens
    return null_engine(preprocessor, max_model_len=512)


@pytest.fixture(scope="module")
def app(engine, preprocessor):
    client, app = make_app(engine, preprocessor, limits=limits())
    yield app
    client.close()


def send(app, path: str, body: dict) -> list[httpx.Response]:
    return sends(app, [(path, body)])[0]


def sends(app, reqs: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            return [await c.post(path, json=body) for path, body in reqs]

    return asyncio.run(go())


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


def test_bounds_check_unit() -> None:
    b = RequestBounds(max_seqs=8, max_tokens=100)
    assert b.check(1, 8, 12) is None and b.check(2, 4, None) == 12
    with pytest.raises(APIError) as e:
        b.check(1, 9, 1)
    assert e.value.param == "n" and "--max-seqs-per-request" in e.value.message
    with pytest.raises(APIError) as e:
        b.check(3, 4, 1)
    assert e.value.param == "prompt" and "3 prompts x n=4 = 12 sequences" in e.value.message
    with pytest.raises(APIError) as e:
        b.check(1, 4, 26, "max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "max_completion_tokens <= 25" in \
        e.value.message and "--max-tokens-per-request" in e.value.message
    with pytest.raises(APIError):
        RequestBounds(max_tokens=4).check(1, 5, None)
    assert RequestBounds().check(64, 128, 4000) is None
    with pytest.raises(ValueError, match="max_seqs_per_request"):
        RequestBounds(max_seqs=0)


def test_sequences_per_request_are_bounded(app) -> None:
    """64 prompts x n=16 (each n within max_num_seqs): a 400 naming the bound, param prompt;
    n alone over the bound: param n; at the bound: served."""
    got = sends(app, [
        ("/v1/completions", CMPL | {"prompt": ["a"] * 64, "n": 16, "max_tokens": 1}),
        ("/v1/completions", CMPL | {"prompt": ["a", "b"], "n": 9, "max_tokens": 1}),
        ("/v1/completions", CMPL | {"prompt": ["a", "b"], "n": 8, "max_tokens": 1}),
        ("/v1/chat/completions", CHAT | {"n": 16, "max_tokens": 1})])
    e = error(got[0])
    assert e["param"] == "prompt" and "64 prompts x n=16 = 1024 sequences" in e["message"]
    assert "at most 16, --max-seqs-per-request" in e["message"]
    assert error(got[1])["param"] == "prompt"
    assert got[2].status_code == 200 and len(got[2].json()["choices"]) == 16
    assert got[3].status_code == 200 and len(got[3].json()["choices"]) == 16


def test_tokens_per_request_are_bounded(app) -> None:
    """16 sequences x 65 tokens > the 1024 the KV cache holds: 400 naming the field that set
    the length; without max_tokens each sequence gets its share (64 tokens)."""
    got = sends(app, [
        ("/v1/chat/completions", CHAT | {"n": 16, "max_tokens": 65}),
        ("/v1/chat/completions", CHAT | {"n": 16, "max_completion_tokens": 65}),
        ("/v1/completions", CMPL | {"prompt": ["a", "b"], "n": 8, "max_tokens": 65}),
        ("/v1/chat/completions", CHAT | {"n": 16, "max_tokens": 64, "ignore_eos": True}),
        ("/v1/chat/completions", CHAT | {"n": 16, "ignore_eos": True})])
    for r, param in zip(got[:3], ("max_tokens", "max_completion_tokens", "max_tokens"),
                        strict=True):
        e = error(r)
        assert e["param"] == param and "1040 tokens" in e["message"], e
        assert "at most 1024, --max-tokens-per-request" in e["message"]
        assert f"{param} <= 64" in e["message"]
    for r in got[3:]:
        assert r.status_code == 200, r.text
        assert [len(c["message"]["content"]) > 0 for c in r.json()["choices"]] == [True] * 16
        assert r.json()["usage"]["completion_tokens"] == 16 * 64


def test_bounds_from_flags(engine, preprocessor) -> None:
    client, app = make_app(engine, preprocessor, limits=limits(
        max_seqs_per_request=3, max_tokens_per_request=10))
    try:
        got = sends(app, [("/v1/chat/completions", CHAT | {"n": 4, "max_tokens": 1}),
                          ("/v1/completions", CMPL | {"prompt": ["a", "b"], "n": 2}),
                          ("/v1/completions", CMPL | {"prompt": ["a"] * 3, "max_tokens": 4}),
                          ("/v1/completions", CMPL | {"prompt": ["a"] * 3, "ignore_eos": True})])
    finally:
        client.close()
    assert error(got[0])["param"] == "n" and "at most 3" in error(got[0])["message"]
    assert error(got[1])["param"] == "prompt"
    assert error(got[2])["param"] == "max_tokens" and "at most 10" in error(got[2])["message"]
    assert got[3].status_code == 200 and got[3].json()["usage"]["completion_tokens"] == 9


def test_replicas_answer_alike(engine, app, preprocessor) -> None:
    """A replica client built from what a replica reports of this engine (`info`, as
    replicas/deploy.py builds it) gives the same 400s."""
    from types import SimpleNamespace

    from spaceserve.server.app import create_app
    from spaceserve.server.replicas.client import ReplicaClient
    from spaceserve.server.replicas.replica import EngineReplica

    from .test_replica_client import FakeReplicas, two_replicas

    replica = EngineReplica.__new__(EngineReplica)  # no Ray: only its report of the engine
    replica.rank, replica.client = 0, SimpleNamespace(engine=engine, mode="temporal",
                                                      mode_note=None, device=None)
    info = replica.info()
    replica.client = None  # its __del__ would close the engine
    assert info["max_num_seqs"] == 16
    tracker = two_replicas()
    client = ReplicaClient(FakeReplicas(tracker), tracker, max_model_len=info["max_model_len"],
                           mode="temporal", num_replicas=2, max_num_seqs=info["max_num_seqs"],
                           vocab_size=info["vocab_size"],
                           image_token_id=preprocessor.image_token_id)
    replicas = create_app(client, preprocessor, model_name=MODEL, limits=limits())
    bad = [("/v1/completions", CMPL | {"prompt": ["a"] * 64, "n": 16}),
           ("/v1/chat/completions", CHAT | {"n": 16, "max_tokens": 65}),
           ("/v1/completions", CMPL | {"prompt": [[1, 2, 10 ** 6]]})]
    try:
        for one, other in zip(sends(app, bad), sends(replicas, bad), strict=True):
            assert error(one) == error(other)
    finally:
        client.close()


BAD_PROMPTS = [None, 5, True, {"a": 1}, "", [], [[]], ["a", ""], ["a", 1], [1, "a"], [1.5],
               [[1], "a"], [[[1]]], ["a", None], [-1], [10 ** 9], [[1, 2], [3, -4]],
               ["a"] * 65, "hello " * 400, [1] * 600]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=range(len(BAD_PROMPTS)))
def test_every_bad_prompt_names_prompt(app, prompt) -> None:
    body = {k: v for k, v in (CMPL | {"prompt": prompt, "max_tokens": 2}).items()
            if v is not None}
    e = error(send(app, "/v1/completions", body))
    assert e["param"] == "prompt", e
    assert e["message"].startswith(("prompt", "This model's")), e


def test_context_message_reads_well(app) -> None:
    e = error(send(app, "/v1/completions", CMPL | {"prompt": [1] * 600}))
    assert e["message"] == "prompt: more than 512 token ids (the context length)"  # pre-scan
    e = error(send(app, "/v1/completions", CMPL | {"prompt": "hello " * 600}))
    assert re.search(r"and the prompt alone is \d+ tokens long", e["message"]), e
    e = error(send(app, "/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": "hello " * 600}]}))
    assert "the messages alone are" in e["message"] and e["param"] == "messages"


@pytest.mark.parametrize("key", ["١٢", "۳", "²", "1\u0660", " 12", "12 ", "+1", "0x1", "1e3",
                                 "", "1" * 20])
def test_logit_bias_keys_are_ascii_decimal(app, key) -> None:
    e = error(send(app, "/v1/chat/completions", CHAT | {"logit_bias": {key: 1.0},
                                                         "max_tokens": 1}))
    assert e["param"] == "logit_bias" and "ASCII decimal" in e["message"]


def test_logit_bias_ascii_keys_work(app) -> None:
    r = send(app, "/v1/chat/completions", CHAT | {"logit_bias": {"12": 100.0}, "max_tokens": 3,
                                                   "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [12, 12, 12]


def test_by_default_one_request_may_ask_for_many_tokens(engine) -> None:
    """No default token budget: one n=128, max_tokens=4000 request is served, the fair share
    keeping it to its share (issue: a 'hi' beside it answered within 2 s)."""
    b = RequestBounds.for_engine(engine)
    assert b.max_tokens is None and b.max_seqs == 16
    assert b.check(1, 16, 4000) is None
