"""The routing function, its keys and its tracker: plain objects, no Ray, no HTTP."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.routing.keys import (
    image_hashes,
    image_spans,
    prefix_block_hashes,
    route_request,
)
from spaceserve.runtime.routing.router import (
    ReplicaState,
    RouterConfig,
    RouteRequest,
    WorkModel,
    choose_replica,
    rank_replicas,
)
from spaceserve.runtime.routing.tracker import ReplicaTracker

IMG = 99  # the image token id of the synthetic prompts


@pytest.fixture(scope="module")
def model() -> WorkModel:
    return WorkModel(analytic_curves())  # Qwen2-VL-7B on an H200 preset


def prompt(text: list[int], images: list[tuple[int, int, int]], seed: int = 0) -> dict:
    """A prompt dict with expanded image tokens: each image (t, h, w) in patches, merge 2."""
    rng = np.random.default_rng(seed)
    ids, rows = [], 0
    for t, h, w in images:
        ids += [1, *([IMG] * (t * h * w // 4)), 2]
        rows += t * h * w
    ids += text
    out = {"prompt_token_ids": ids}
    if images:
        out["pixel_values"] = torch.from_numpy(rng.standard_normal((rows, 12)).astype("f4"))
        out["image_grid_thw"] = torch.tensor(images)
    return out


# Keys.

def test_image_hash_follows_the_pixels_and_the_grid() -> None:
    a = prompt([], [(1, 4, 4), (1, 2, 4)], seed=1)
    h = image_hashes(a["pixel_values"], a["image_grid_thw"])
    assert len(h) == 2 and h[0] != h[1]
    again = image_hashes(a["pixel_values"].clone(), a["image_grid_thw"])
    assert again == h  # same pixels, same hashes
    other = prompt([], [(1, 4, 4), (1, 2, 4)], seed=2)
    assert set(image_hashes(other["pixel_values"], other["image_grid_thw"])).isdisjoint(h)
    # the same rows read under another grid are another image
    assert image_hashes(a["pixel_values"][:16], torch.tensor([[1, 2, 8]]))[0] != h[0]
    with pytest.raises(ValueError, match="rows"):
        image_hashes(a["pixel_values"][:20], a["image_grid_thw"])


def test_prefix_blocks_chain_and_see_image_contents() -> None:
    text = list(range(100, 140))
    a = route_request("a", prompt(text, [(1, 8, 8)], seed=1), image_token_id=IMG,
                      block_tokens=8)
    same = route_request("b", prompt(text, [(1, 8, 8)], seed=1), image_token_id=IMG,
                         block_tokens=8)
    other_image = route_request("c", prompt(text, [(1, 8, 8)], seed=2), image_token_id=IMG,
                                block_tokens=8)
    longer = route_request("d", prompt(text + list(range(300, 320)), [(1, 8, 8)], seed=1),
                           image_token_id=IMG, block_tokens=8)
    assert a.prompt_tokens == 16 + 2 + 40 and a.image_tokens == (16,)
    assert len(a.prefix_hashes) == a.prompt_tokens // 8
    assert same.prefix_hashes == a.prefix_hashes and same.image_hashes == a.image_hashes
    # the token ids are equal, the picture is not: no block in common
    assert set(other_image.prefix_hashes).isdisjoint(a.prefix_hashes)
    assert longer.prefix_hashes[:len(a.prefix_hashes)] == a.prefix_hashes
    # a change in the middle breaks the chain from that block on
    edited = list(text)
    edited[30] = 7
    e = route_request("e", prompt(edited, [(1, 8, 8)], seed=1), image_token_id=IMG,
                      block_tokens=8)
    k = (18 + 30) // 8
    assert e.prefix_hashes[:k] == a.prefix_hashes[:k]
    assert set(e.prefix_hashes[k:]).isdisjoint(a.prefix_hashes)


def test_image_spans_check_the_token_count() -> None:
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    assert image_spans(ids, IMG, [2, 3]) == [(1, 3), (4, 7)]
    with pytest.raises(ValueError, match="image tokens"):
        image_spans(ids, IMG, [2, 2])
    assert prefix_block_hashes([1, 2, 3], 4) == ()  # no full block


# The routing function.

def req(rid: str, tokens: int = 0, *, text: int = 64, h: str = "", prefixes=(),
        out: int = 128) -> RouteRequest:
    images = (tokens,) if tokens else ()
    return RouteRequest(rid, text + tokens, images, (h,) if images else (), tuple(prefixes),
                        output_tokens=out)


def test_media_aware_weighs_work_not_counts(model) -> None:
    """One queued 4K image outweighs three queued 448x448 ones: least_loaded counts requests
    and picks the replica with the 4K image; media_aware picks the other."""
    big = ReplicaState("big", queued_encoder_s=model.encoder_s(10549),
                       queued_prefill_s=model.prefill_s(10549), waiting=1)
    small = ReplicaState("small", queued_encoder_s=3 * model.encoder_s(256),
                         queued_prefill_s=3 * model.prefill_s(256), waiting=3)
    new = req("x", 2691)
    assert choose_replica("least_loaded", new, [big, small]) == 0
    assert choose_replica("media_aware", new, [big, small], model) == 1


def test_a_burst_of_1080p_images_spreads_out(model) -> None:
    tracker = ReplicaTracker(model)
    keys = [f"r{i}" for i in range(4)]
    for k in keys:
        tracker.add(k)
    got = [tracker.choose(req(f"q{i}", 2691, h=f"img{i}")) for i in range(12)]
    assert sorted(got.count(k) for k in keys) == [3, 3, 3, 3]


def test_affinity_wins_while_load_allows(model) -> None:
    a = ReplicaState("a", images={"cat"})
    b = ReplicaState("b")
    assert choose_replica("media_aware", req("x", 2691, h="cat"), [b, a], model) == 1
    # the replica that has the picture is far behind: the other one is faster
    busy = ReplicaState("a", queued_encoder_s=5 * model.encoder_s(2691), waiting=5,
                        images={"cat"})
    assert choose_replica("media_aware", req("x", 2691, h="cat"), [b, busy], model) == 0
    # a common key earns nothing: a tie, which goes to the first listed
    common = RouteRequest("x", 2755, (2691,), ("cat",), common=frozenset({"cat"}))
    assert choose_replica("media_aware", common, [a, b], model) == 0
    assert choose_replica("media_aware", common, [b, a], model) == 0
    # prefix affinity counts the leading blocks held
    p = ReplicaState("p", prefixes={1, 2, 3})
    assert choose_replica("media_aware", req("y", text=4096, prefixes=[1, 2, 3, 4]),
                          [b, p], model) == 1


def serve_sequentially(tracker: ReplicaTracker, requests: list[RouteRequest]) -> list[str]:
    """Route one request at a time, each finished before the next (an idle cluster)."""
    out = []
    for r in requests:
        out.append(tracker.choose(r))
        tracker.on_finished(r.request_id)
    return out


def test_the_shared_template_prefix_does_not_pull_all_traffic(model) -> None:
    """Every request starts with the same template blocks; their affinity would send every
    request of an idle cluster to the first replica, unless common keys earn none."""
    template = [11, 12]
    reqs = [req(f"q{i}", text=256, prefixes=[*template, 1000 + i]) for i in range(40)]
    spread = ReplicaTracker(model)
    sticky = ReplicaTracker(model, RouterConfig(common_min=10**6))  # nothing is ever common
    for t in (spread, sticky):
        t.add("a")
        t.add("b")
    got = serve_sequentially(spread, reqs)
    assert min(got.count("a"), got.count("b")) >= 15
    assert set(serve_sequentially(sticky, reqs)[1:]) == {"a"}


def test_a_conversation_follows_its_replica(model) -> None:
    tracker = ReplicaTracker(model)
    for k in "abc":
        tracker.add(k)
    # other traffic keeps every replica equally busy
    for i in range(9):
        tracker.choose(req(f"bg{i}", 256, h=f"bg{i}"))
    first = tracker.choose(req("turn1", 1196, h="photo", prefixes=[7, 8]))
    tracker.on_finished("turn1")
    second = tracker.choose(req("turn2", 1196, h="photo", prefixes=[7, 8, 9, 10]))
    assert second == first


def test_rank_orders_and_excludes(model) -> None:
    states = [ReplicaState("a", waiting=2), ReplicaState("b"), ReplicaState("c", waiting=1)]
    assert rank_replicas("least_loaded", None, states) == [1, 2, 0]
    assert rank_replicas("round_robin", None, states, turn=4) == [1, 2, 0]
    assert rank_replicas("media_aware", None, states, model) == [1, 2, 0]  # no request: load
    assert rank_replicas("media_aware", req("x"), [], model) == []
    with pytest.raises(ValueError, match="policy"):
        rank_replicas("random", None, states)
    tracker = ReplicaTracker(model)
    for k in "abc":
        tracker.add(k)
    assert tracker.rank(req("x"), ["a", "b", "c"], exclude=["a"])[-1] == "a"
    assert tracker.rank(req("x"), ["a"], exclude=["a"]) == ["a"]  # nothing else: still tried


# The tracker's accounts.

def test_tracker_lifecycle_and_non_streaming_promotion(model) -> None:
    now = [0.0]
    tracker = ReplicaTracker(model, clock=lambda: now[0])
    tracker.sync({"a": {"rank": 0}, "b": {"rank": 1}})
    r = req("s", 1196, h="h1")
    tracker.on_routed("a", r)
    s = tracker.states(["a"])[0]
    assert s.waiting == 1 and s.queued_encoder_s == pytest.approx(model.encoder_s(1196))
    tracker.on_first_token("s")
    s = tracker.states(["a"])[0]
    assert (s.waiting, s.decoding, s.queued_encoder_s) == (1 - 1, 1, 0.0)
    tracker.on_finished("s")
    assert tracker.states(["a"])[0].in_flight == 0
    # a non-streaming request counts as decoding from its predicted first token on
    tracker.on_routed("b", req("n", 1196, h="h2"), stream=False)
    assert tracker.states(["b"])[0].waiting == 1
    now[0] = 10.0
    assert tracker.states(["b"])[0].decoding == 1
    # the request turned out to be on another replica
    tracker.on_routed("a", req("m", 256, h="h3"))
    tracker.confirm("m", "b")
    sa, sb = tracker.states(["a", "b"])
    assert sa.waiting == 0 and sb.waiting == 1 and tracker.assigned("m") == "b"
    # a replica that leaves takes its accounts with it, but its requests stay traceable
    tracker.sync({"a": {"rank": 0}})
    assert tracker.keys() == ["a"] and tracker.assigned("m") == "b"
    assert tracker.info_of("b") == {"rank": 1}
    tracker.on_finished("m")
    assert tracker.assigned("m") is None


@pytest.mark.parametrize("seed", range(40))
def test_tracker_accounts_return_to_zero(model, seed) -> None:
    """Any order of events, then every request ends: every live replica is empty again."""
    rng = random.Random(seed)
    tracker = ReplicaTracker(model, clock=itertools.count().__next__)
    keys = ["a", "b", "c"]
    tracker.sync({k: {} for k in keys})
    for _ in range(rng.randrange(80)):
        op = rng.choice(["route", "route", "first", "finish", "confirm", "drop"])
        i, k, rid = rng.randrange(8), rng.choice(keys), f"r{rng.randrange(8)}"
        if op == "route":
            tracker.on_routed(k, req(rid, 256 * (i % 3), h=f"h{i}"), stream=rng.random() < 0.5)
        elif op == "first":
            tracker.on_first_token(rid)
        elif op == "finish":
            tracker.on_finished(rid)
        elif op == "confirm":
            tracker.confirm(rid, k)
        else:
            tracker.remove(k)
            tracker.add(k)
        for s in tracker.states():
            assert s.waiting >= 0 and s.decoding >= 0 and s.decode_context >= 0
    for i in range(8):
        tracker.on_finished(f"r{i}")
    for s in tracker.states():
        assert (s.waiting, s.decoding, s.decode_context) == (0, 0, 0)
        assert s.queued_encoder_s == 0.0 and s.queued_prefill_s == 0.0


def test_the_router_keys_an_image_as_the_encoder_cache_does() -> None:
    """A replica's encoder cache files an image under the input module's content hash (or, for
    a prompt without one, a hash of its patches); the router's image key is the same string."""
    import torch

    from spaceserve.runtime.inputs import process_prompt
    from spaceserve.runtime.worker.null import NullModelRunner

    info = NullModelRunner().info
    g = torch.Generator().manual_seed(1)
    prompt = {"prompt_token_ids": [5] + [3] * 4 + [6] + [3] * 2 + [7],
              "pixel_values": torch.randn(24, 8, generator=g),
              "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}
    for given in (None, {"image": ["a" * 32, "b" * 32]}):
        p = prompt if given is None else prompt | {"mm_hashes": given}
        route = route_request("r", p, image_token_id=3)
        _, mm = process_prompt(p, info, context_len=100, capacity=1000, max_images=4)
        assert route.image_hashes == (mm.item_key(0), mm.item_key(1))
        if given is not None:
            assert route.image_hashes == tuple(given["image"])
