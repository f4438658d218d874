"""Incremental detokenisation and stop strings on the tiny byte-level BPE tokenizer (random
ids, partial UTF-8 bytes and special tokens included): released text adds up to a one-shot
decode, is never taken back, holds back only what may still change, and stops exactly before
the first stop string, across token boundaries."""

from __future__ import annotations

import random

import pytest

from spaceserve.models.tiny import _build_tokenizer
from spaceserve.runtime.engine.outputs import Detokenizer, held_prefix, make_decoder


@pytest.fixture(scope="module")
def tok():
    return _build_tokenizer(512)


def random_ids(rng: random.Random, n: int, vocab: int = 512) -> list[int]:
    # mostly merged (ASCII) tokens, some raw bytes (partial UTF-8), a few special tokens
    return [rng.choice([rng.randrange(260, vocab), rng.randrange(0, 260)]) if rng.random() < 0.9
            else rng.randrange(0, 7) for _ in range(n)]


def feed(det: Detokenizer, ids: list[int], start: int, upto: int | None = None):
    """Advance one token at a time; (texts released after each token, stop string)."""
    released, hit = [], None
    for n in range(start + 1, (upto or len(ids)) + 1):
        hit = det.advance(n)
        released.append(det.text())
        if hit is not None:
            break
    return released, hit


@pytest.mark.parametrize("seed", range(6))
def test_released_text_adds_up_to_one_decode(tok, seed: int) -> None:
    rng = random.Random(seed)
    prompt = random_ids(rng, 5)
    out = random_ids(rng, 60)
    ids = prompt + out
    decode = make_decoder(tok)
    det = Detokenizer(decode, ids, len(prompt))
    released, _ = feed(det, ids, len(prompt))
    det.advance(len(ids), final=True)
    final = det.text()
    assert final == tok.decode(out, skip_special_tokens=True)
    for text in released:  # never taken back
        assert final.startswith(text)
    for text in released[:-1]:
        assert not text.endswith("\ufffd") or final[len(text) - 1] == "\ufffd"
    assert det.read_offset - det.prefix_offset <= 8  # the decoded window stays small


def test_incomplete_utf8_is_held_back(tok) -> None:
    ids = tok("naïve café ok", add_special_tokens=False)["input_ids"]
    decode = make_decoder(tok)
    det = Detokenizer(decode, ids, 0)
    for n in range(1, len(ids) + 1):
        det.advance(n)
        assert "\ufffd" not in det.text()
    assert det.text() == "naïve café ok"


@pytest.mark.parametrize("seed", range(8))
def test_stop_strings_cut_before_the_first_match(tok, seed: int) -> None:
    rng = random.Random(100 + seed)
    out = [rng.randrange(260, 512) for _ in range(40)]  # printable tokens
    full = tok.decode(out)
    a = rng.randrange(5, len(full) - 6)
    stop = full[a:a + rng.randint(2, 5)]
    first = full.find(stop)
    for include in (False, True):
        det = Detokenizer(make_decoder(tok), list(out), 0, stops=["@never@", stop],
                          include_stop=include)
        released, hit = feed(det, out, 0)
        assert hit == stop
        want = full[:first + (len(stop) if include else 0)]
        assert det.text() == want
        assert all(want.startswith(t) for t in released)
        for t in released[:-1]:  # nothing of the stop string left before it matched
            assert len(t) <= first
        det.advance(len(out), final=True)
        assert det.text() == want


def test_held_prefix_and_min_tokens(tok) -> None:
    assert held_prefix("hello wo", ["world", "xyz"]) == 2
    assert held_prefix("hello w", ["wow", "w"]) == 1 and held_prefix("hello w", ["w"]) == 0
    assert held_prefix("abc", []) == 0
    ids = tok("stop here please stop now", add_special_tokens=False)["input_ids"]
    first = next(n for n in range(1, len(ids)) if "stop" in tok.decode(ids[:n]))
    # stop strings count from token `first` on (min_tokens): the first "stop" is text
    det = Detokenizer(make_decoder(tok), ids, 0, stops=["stop"], stop_at=first + 1)
    feed(det, ids, 0)
    assert det.stop == "stop" and det.text() == "stop here please "


def test_a_streamed_output_pickles_as_its_own_items() -> None:
    """An output sent to another process (a replica's answer over Ray) carries its views as
    plain values: what it showed when made, not the request's whole growing lists."""
    import pickle

    from spaceserve.runtime.core.request import RequestMetrics, RequestOutput, SeqView, TextSnapshot

    ids, parts = [1, 2, 3, 4, 5], ["a", "b", "c"]
    out = RequestOutput("r", [1, 2], SeqView(ids, 2, 4), [4], False, None, None,
                        RequestMetrics(0.0, None, (), None), delta_text="b",
                        logprobs=SeqView(parts, 0, 1), text_source=TextSnapshot(parts, 2))
    ids.append(6)
    parts.append("d")
    back = pickle.loads(pickle.dumps(out))
    assert back.token_ids == [3, 4] and type(back.token_ids) is list
    assert back.logprobs == ["a"] and back.text == "ab" and back.delta_text == "b"
    assert type(back.logprobs) is list and type(back.text_source) is str
