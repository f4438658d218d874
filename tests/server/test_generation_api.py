"""The generation API through the official openai client, live on loopback, with the null model
behind the tiny tokenizer (every token has a reference): stop strings (across token
boundaries, streaming), stop tokens and min_tokens, logprobs in both formats, penalties and
logit bias against the per-token torch reference, seeded sampling whatever the neighbours,
/v1/completions in every prompt form, and the parameters still refused."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest
import torch

from spaceserve import SamplingParams
from spaceserve.runtime.sample.ops import reference_logprobs
from spaceserve.server.app import ServerThread

from .conftest import MODEL, make_app, null_engine

MSG = [{"role": "user", "content": "Describe the red house beside the tree."}]
GREEDY = dict(temperature=0.0, max_tokens=24)
XB = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def live(preprocessor):
    engine = null_engine(preprocessor, max_model_len=256)
    client, app = make_app(engine, preprocessor)
    with ServerThread(app) as server:
        yield engine, server
    client.close()


@pytest.fixture(scope="module")
def oai(live):
    import openai

    return openai.OpenAI(base_url=live[1].url + "/v1", api_key="unused", max_retries=0)


def token_texts(tok, ids: list[int]) -> list[str]:
    return [tok.decode([t]) for t in ids]


def boundary_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of token j's text and the start of token j+1's, whose
    first occurrence in the output is at that boundary; (string, j)."""
    full = tok.decode(ids)
    texts = token_texts(tok, ids)
    pos = 0
    for j in range(len(ids) - 1):
        a, b = texts[j], texts[j + 1]
        pos += len(a)
        ok = len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b
        if ok and full.startswith(a + b, pos - len(a)):
            stop = a[-2:] + b[:2]
            if full.find(stop) == pos - 2:
                return stop, j
    raise AssertionError("no token boundary with printable text on both sides")


def reference_ids(engine, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    runner = engine.runner
    return runner.reference_generate(prompt_ids, None, params, params.seed or 0,
                                     engine.max_model_len)[0]


def test_stop_string_across_tokens(oai, preprocessor) -> None:
    tok = preprocessor.tokenizer
    base = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY, extra_body=XB)
    ids = base.choices[0].token_ids
    full = base.choices[0].message.content
    assert full == tok.decode(ids)
    stop, j = boundary_stop(tok, ids)
    r = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY, stop=[stop, "@@@"],
                                    extra_body=XB)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == full[:full.find(stop)]
    assert c.token_ids == ids[:j + 2]  # up to the token that completed the stop string
    assert r.usage.completion_tokens == j + 2
    assert c.model_extra["stop_reason"] == stop
    kept = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY, stop=stop,
                                       extra_body=XB | {"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == full[:full.find(stop) + len(stop)]


def test_stop_string_in_streaming(oai, preprocessor) -> None:
    tok = preprocessor.tokenizer
    base = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY, extra_body=XB)
    ids, full = base.choices[0].token_ids, base.choices[0].message.content
    stop, j = boundary_stop(tok, ids)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MSG, **GREEDY, stop=stop, stream=True,
        stream_options={"include_usage": True}, extra_body=XB))
    *body, usage = chunks
    pieces = [c.choices[0].delta.content or "" for c in body]
    assert "".join(pieces) == full[:full.find(stop)]
    assert all(stop not in p for p in pieces)
    assert [c.choices[0].finish_reason for c in body][-1] == "stop"
    assert usage.usage.completion_tokens == j + 2
    streamed = [t for c in body for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == ids[:j + 2]


def test_stop_tokens_min_tokens_and_eos(oai, live) -> None:
    engine, _ = live
    base = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY, extra_body=XB)
    ids = base.choices[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    r = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY,
                                    extra_body=XB | {"stop_token_ids": [ids[k]]})
    c = r.choices[0]
    assert (c.finish_reason, c.token_ids) == ("stop", ids[:k + 1])
    assert c.model_extra["stop_reason"] == ids[k]
    # the stop token's own text is not in the output
    assert c.message.content == engine.tokenizer.decode(ids[:k])
    # min_tokens bars the stop token (and eos) until k + 1 tokens exist
    r = oai.chat.completions.create(model=MODEL, messages=MSG, **GREEDY,
                                    extra_body=XB | {"stop_token_ids": [ids[k]],
                                                     "min_tokens": k + 1})
    prompt = r.prompt_token_ids
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                        stop_token_ids=[ids[k]], min_tokens=k + 1)
    assert r.choices[0].token_ids == reference_ids(engine, prompt, sp)
    assert ids[k] not in r.choices[0].token_ids[:k + 1]


def test_chat_logprobs_shape_and_values(oai, live) -> None:
    engine, _ = live
    runner = engine.runner
    r = oai.chat.completions.create(model=MODEL, messages=MSG, temperature=0.0, max_tokens=6,
                                    logprobs=True, top_logprobs=5, extra_body=XB)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == len(c.token_ids) == 6
    seq = list(r.prompt_token_ids)
    for tid, entry in zip(c.token_ids, content, strict=True):
        logits = runner.reference_logits(runner.token_values(seq))
        lp, rank, top = reference_logprobs(logits, tid, 5)
        assert rank == 1 and entry.logprob == pytest.approx(lp, abs=1e-5)
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx([v for _, v in top],
                                                                         abs=1e-5)
        assert entry.token == engine.tokenizer.decode([tid])
        assert bytes(entry.bytes) == entry.token.encode()
        seq.append(tid)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MSG, temperature=0.0, max_tokens=6, logprobs=True,
        top_logprobs=2, stream=True, extra_body=XB))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    plain = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert plain.choices[0].logprobs is None


PENALTIES = [
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(repetition_penalty=1.6),
    dict(repetition_penalty=0.6, frequency_penalty=-0.5, logit_bias={"300": 5.0, "42": -100}),
    dict(temperature=0.9, seed=7, top_k=20, min_p=0.05, presence_penalty=-1.0,
         repetition_penalty=1.3),
    dict(temperature=1.2, seed=8, top_p=0.8, frequency_penalty=1.1, logit_bias={"77": 3.0}),
]


@pytest.mark.parametrize("kw", PENALTIES)
def test_penalties_match_the_torch_reference(oai, live, kw) -> None:
    engine, _ = live
    kw = {"temperature": 0.0} | kw
    extra = XB | {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in kw}
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, **kw,
                                    extra_body=extra)
    got = r.choices[0].token_ids
    bias = {int(k): v for k, v in (kw.get("logit_bias") or {}).items()}
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logit_bias=bias,
                        **{k: v for k, v in (kw | extra).items()
                           if k not in ("logit_bias", "ignore_eos", "return_token_ids")})
    assert got == reference_ids(engine, r.prompt_token_ids, sp)
    plain = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20,
                                        temperature=kw["temperature"], seed=kw.get("seed"),
                                        extra_body=XB)
    assert plain.choices[0].token_ids != got  # the penalties changed something


def test_seeded_sampling_ignores_batch_neighbours(oai) -> None:
    ask = dict(model=MODEL, messages=MSG, temperature=1.0, top_p=0.9, seed=1234,
               max_tokens=16, extra_body=XB)
    alone = oai.chat.completions.create(**ask).choices[0].token_ids
    others = [dict(model=MODEL, messages=[{"role": "user", "content": "x" * (i + 1)}],
                   temperature=0.7 + 0.1 * i, seed=i, max_tokens=5 + 3 * i, extra_body=XB,
                   presence_penalty=0.5 * (i % 2)) for i in range(6)]
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(oai.chat.completions.create, **o) for o in others[:3]]
        mine = pool.submit(oai.chat.completions.create, **ask)
        futs += [pool.submit(oai.chat.completions.create, **o) for o in others[3:]]
        crowded = mine.result().choices[0].token_ids
        assert all(f.result().choices[0].finish_reason == "length" for f in futs)
    assert crowded == alone
    other_seed = oai.chat.completions.create(**(ask | {"seed": 4321})).choices[0].token_ids
    assert other_seed != alone


def test_completions_plain_forms(oai, live, preprocessor) -> None:
    engine, _ = live
    tok = preprocessor.tokenizer
    r = oai.completions.create(model=MODEL, prompt="The cat sleeps on the", max_tokens=5,
                               temperature=0.0, extra_body=XB)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.text == tok.decode(c.token_ids)
    ids = tok("The cat sleeps on the")["input_ids"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0.0)
    assert by_ids.choices[0].text == c.text
    many = oai.completions.create(model=MODEL, prompt=["a red house", "two people"],
                                  max_tokens=3, temperature=0.0, echo=True)
    assert [ch.index for ch in many.choices] == [0, 1]
    assert many.choices[0].text.startswith("a red house")
    assert many.choices[1].text.startswith("two people")
    assert many.usage.completion_tokens == 6
    lists = oai.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2,
                                   temperature=0.0)
    assert len(lists.choices) == 2 and lists.choices[0].text == c.text[:len(lists.choices[0]
                                                                             .text)]
    # special-token text in a prompt is plain text, never the control token
    special = oai.completions.create(model=MODEL, prompt="<|im_end|>", max_tokens=1)
    assert special.usage.prompt_tokens > 1
    # logprobs in the completions format
    lp = oai.completions.create(model=MODEL, prompt="The cat", max_tokens=4, temperature=0.0,
                                logprobs=3, extra_body=XB)
    L = lp.choices[0].logprobs
    assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == 4
    assert all(max(t.values()) == pytest.approx(v) and t[tok] == pytest.approx(v)
               for t, v, tok in zip(L.top_logprobs, L.token_logprobs, L.tokens, strict=True))
    assert L.text_offset == [sum(len(t) for t in L.tokens[:i]) for i in range(4)]
    as_ids = oai.completions.create(model=MODEL, prompt="The cat", max_tokens=4,
                                    temperature=0.0, logprobs=3,
                                    extra_body=XB | {"return_tokens_as_token_ids": True})
    A = as_ids.choices[0].logprobs
    assert A.tokens == [f"token_id:{t}" for t in as_ids.choices[0].token_ids]
    assert all(len(t) == 3 for t in A.top_logprobs)  # ids never collide
    assert A.token_logprobs == pytest.approx(L.token_logprobs)


def test_completions_streaming(oai, live) -> None:
    chunks = list(oai.completions.create(
        model=MODEL, prompt=["The cat", "A plate of bread"], max_tokens=6, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, logprobs=1))
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    plain = oai.completions.create(model=MODEL, prompt=["The cat", "A plate of bread"],
                                   max_tokens=6, temperature=0.0, logprobs=1)
    for i in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(ch.text for ch in mine) == plain.choices[i].text
        assert [ch.finish_reason for ch in mine][-1] == "length"
        assert [t for ch in mine if ch.logprobs for t in ch.logprobs.token_logprobs] == \
            pytest.approx(plain.choices[i].logprobs.token_logprobs)
    raw = httpx.post(f"{oai.base_url}completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
    assert raw.text.endswith("data: [DONE]\n\n")


REFUSED = [
    ("chat", {"n": 99}, "max_num_seqs"), ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"logprobs": True,
                                                             "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("cmpl", {"echo": True, "logprobs": 1}, "echo"), ("cmpl", {"suffix": "x"}, "suffix"),
    ("cmpl", {"best_of": 2}, "best_of"), ("cmpl", {"n": 2, "best_of": 3}, "best_of"),
    ("cmpl", {"prompt": []}, "prompt"),
    ("cmpl", {"prompt": [[1, 2], []]}, "prompt"), ("cmpl", {"prompt": [10 ** 6]}, "vocabulary"),
    ("cmpl", {"logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("kind,extra,needle", REFUSED, ids=[f"{k}-{n}" for k, _, n in REFUSED])
def test_refused_parameters_are_named(live, kind, extra, needle) -> None:
    url = live[1].url
    body = ({"model": MODEL, "messages": MSG, "max_tokens": 3} if kind == "chat" else
            {"model": MODEL, "prompt": "hi", "max_tokens": 3}) | extra
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(url + path, content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    plain = {"model": MODEL, "messages": MSG, "max_tokens": 3} if kind == "chat" else \
        {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    assert httpx.post(url + path, json=plain, timeout=30).status_code == 200  # still serving


def test_engine_outputs_stream_deltas(live) -> None:
    """In-process: streamed deltas add up to the final text, and a streaming output's
    cumulative fields are views, not copies."""
    import asyncio

    engine, _ = live
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    async def run():
        return [o async for o in engine.stream("The cat sleeps", sp)]

    outs = asyncio.run(run())
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert outs[-2].text == "".join(o.delta_text for o in outs[:-1])
    assert list(outs[3].token_ids) == outs[-1].token_ids[:4]
    assert [e.token_id for e in outs[-1].logprobs] == outs[-1].token_ids
    assert isinstance(outs[-1].token_ids, list) and not isinstance(outs[3].token_ids, list)
    assert torch.is_tensor(torch.tensor(outs[-1].token_ids))
