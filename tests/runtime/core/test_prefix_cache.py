"""Prefix caching and the encoder cache with the null model, whose logits hash every cached
K/V value through the block table: a reused block holding anything but what the request would
have computed itself changes its tokens. Every output is checked against the request run alone
over an unpaged sequence.

Covered: a shared system prompt across requests, eviction under KV pressure, abort mid-prefill,
preemption, media wholly or partly inside the cached prefix, encoder-cache hits, both switches
off, every engine mode, and the block manager's reference counts and hash table."""

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.core.block_manager import BlockManager
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3
CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(mode: str = "temporal", **cfg) -> Engine:
    return Engine(NullModelRunner(), EngineConfig(mode=mode, **(CFG | cfg)))


def reference(engine: Engine, prompt: dict, params: SamplingParams) -> tuple[list[int], str]:
    ids, mm = process_prompt(prompt, engine.runner.info, context_len=10**6, capacity=10**6,
                             max_images=99)
    return engine.runner.reference_generate(ids, mm, params, params.seed or 0,
                                            engine.max_model_len)


def check(engine: Engine, prompts: list[dict], params: SamplingParams = GREEDY) -> list:
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.error is None
        assert (out.token_ids, out.finish_reason) == reference(engine, prompt, params)
    return outs


def image(gen: torch.Generator, grid=(1, 4, 4)) -> tuple[list[int], torch.Tensor, tuple]:
    t, h, w = grid
    return [IMG] * (t * h * w // 4) + [1], torch.randn(t * h * w, 8, generator=gen), grid


def media_prompt(ids: list, images: list) -> dict:
    """`ids` with ``None`` marking where each of `images` goes."""
    out, pvs, grids, k = [], [], [], 0
    for tok in ids:
        if tok is None:
            toks, pv, grid = images[k]
            out += toks
            pvs.append(pv)
            grids.append(grid)
            k += 1
        else:
            out.append(tok)
    return {"prompt_token_ids": out, "pixel_values": torch.cat(pvs),
            "image_grid_thw": torch.tensor(grids)}


def delta(engine: Engine, before: dict) -> dict:
    return {k: v - before[k] for k, v in engine.counters().items()}


def test_shared_system_prompt_is_computed_once() -> None:
    eng = make_engine()
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(4, 97, (22,), generator=gen).tolist()
    first = {"prompt_token_ids": system + [50, 51]}
    check(eng, [first])
    before = eng.counters()
    users = [{"prompt_token_ids": system + torch.randint(4, 97, (k,), generator=gen).tolist()}
             for k in (3, 9, 1)]
    outs = check(eng, users)
    assert [o.metrics.num_cached_tokens for o in outs] == [20, 20, 20]
    d = delta(eng, before)
    # 22 shared tokens = 5 full blocks of 4 for each of the three
    assert d["prefix_cache_hit_tokens"] == 3 * 20
    assert d["prefix_cache_queried_tokens"] == sum(len(u["prompt_token_ids"]) for u in users)
    assert d["prefill_tokens"] == sum(len(u["prompt_token_ids"]) - 20 for u in users)
    eng.check_idle()


def test_identical_prompt_recomputes_only_its_last_block() -> None:
    eng = make_engine()
    gen = torch.Generator().manual_seed(1)
    for n in (16, 17):  # a whole number of blocks, and one more token
        prompt = {"prompt_token_ids": torch.randint(4, 97, (n,), generator=gen).tolist()}
        check(eng, [prompt])
        before = eng.counters()
        check(eng, [prompt])
        hit = (n - 1) // 4 * 4
        assert delta(eng, before)["prefix_cache_hit_tokens"] == hit
        assert delta(eng, before)["prefill_tokens"] == n - hit >= 1
    eng.check_idle()


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    eng = make_engine()
    gen = torch.Generator().manual_seed(2)
    prompt = {"prompt_token_ids": torch.randint(4, 97, (10,), generator=gen).tolist()}
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    (out,) = check(eng, [prompt], params)
    turn2 = {"prompt_token_ids": prompt["prompt_token_ids"] + out.token_ids + [60, 61, 62]}
    before = eng.counters()
    check(eng, [turn2], params)
    # 10 prompt + 9 generated tokens, of which the last was never computed: 18 -> 4 blocks
    assert delta(eng, before)["prefix_cache_hit_tokens"] == 16


def test_eviction_under_kv_pressure_keeps_outputs_right() -> None:
    eng = make_engine(num_kv_blocks=12, max_num_seqs=2)
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(4, 97, (12,), generator=gen).tolist()
    shared = {"prompt_token_ids": base + [40]}
    check(eng, [shared])
    others = [{"prompt_token_ids": torch.randint(4, 97, (14,), generator=gen).tolist()}
              for _ in range(6)]
    check(eng, others)
    bm = eng.block_manager
    assert bm.num_evicted > 0 and bm.num_cached <= bm.num_blocks
    before = eng.counters()
    check(eng, [{"prompt_token_ids": base + [41]}])  # its prefix was evicted: recomputed
    assert delta(eng, before)["prefix_cache_hit_tokens"] < 12
    eng.check_idle()


def test_abort_mid_prefill_leaves_its_computed_blocks_reusable() -> None:
    eng = make_engine(max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(4)
    prompt = {"prompt_token_ids": torch.randint(4, 97, (30,), generator=gen).tolist()}
    rid = eng.add_request(prompt, GREEDY)
    eng.step()
    eng.step()  # two chunks of 8: 16 tokens computed, 4 blocks committed
    req = eng._active[rid]
    assert req.num_computed == 16 and not req.token_ids[30:]
    eng.abort(rid)
    eng.step()
    assert eng.block_manager.num_cached == 4
    before = eng.counters()
    check(eng, [prompt])
    assert delta(eng, before)["prefix_cache_hit_tokens"] == 16
    eng.check_idle()


def test_preempted_requests_find_their_blocks_again() -> None:
    eng = make_engine(num_kv_blocks=11, max_num_batched_tokens=16)
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(4, 97, (9,), generator=gen).tolist()}
               for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = check(eng, prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
    # re-admitted requests found blocks they had computed before being preempted
    assert eng.counters()["prefix_cache_hit_tokens"] > 0
    eng.check_idle()


@pytest.mark.parametrize("mode", ["temporal", "spatial-static", "spatial"])
def test_media_inside_the_cached_prefix_needs_no_encoder(mode: str) -> None:
    eng = make_engine(mode)
    gen = torch.Generator().manual_seed(6)
    a, b = image(gen), image(gen, (1, 2, 4))
    head = torch.randint(4, 97, (3,), generator=gen).tolist()
    turn1 = media_prompt(head + [None, 70, None, 71], [a, b])  # 3 + 5 + 1 + 3 + 1 = 13 tokens
    check(eng, [turn1])
    assert eng.counters()["encoder_jobs"] == 1
    # the same conversation, longer: both images lie inside the cached blocks
    before = eng.counters()
    turn2 = media_prompt(head + [None, 70, None, 71, 72, 73, 74, 75, 76], [a, b])
    check(eng, [turn2])
    d = delta(eng, before)
    assert d["encoder_jobs"] == 0 and d["encoder_cache_queries"] == d["encoder_cache_hits"] == 2
    assert d["prefix_cache_hit_tokens"] == 12 and d["prefill_tokens"] == 6
    # with the encoder cache off the prefix cache alone still skips the encoder
    eng2 = make_engine(mode, encoder_cache_bytes=0)
    check(eng2, [turn1])
    before = eng2.counters()
    check(eng2, [turn2])
    assert delta(eng2, before)["encoder_jobs"] == 0
    eng.check_idle()
    eng2.check_idle()


def test_an_image_partly_inside_the_prefix_is_encoded_alone() -> None:
    eng = make_engine(encoder_cache_bytes=0)
    gen = torch.Generator().manual_seed(7)
    a, b = image(gen), image(gen, (1, 4, 8))
    turn1 = media_prompt([9, 10, None, 70, None], [a, b])  # 2 + 5 + 1 + 9 = 17 tokens
    check(eng, [turn1])
    other = image(gen, (1, 4, 8))  # the same first image, another second one
    before = eng.counters()
    check(eng, [media_prompt([9, 10, None, 70, None, 80], [a, other])])
    d = delta(eng, before)
    # blocks 0-1 (tokens 0..7: the first image whole) are shared; the second image is new
    assert d["prefix_cache_hit_tokens"] == 8 and d["encoder_jobs"] == 1
    assert (d["encoder_cache_queries"], d["encoder_cache_hits"]) == (2, 1)
    eng.check_idle()


def test_encoder_cache_hit_with_other_text() -> None:
    eng = make_engine(enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(8)
    a = image(gen)
    check(eng, [media_prompt([11, None, 12], [a])])
    before = eng.counters()
    check(eng, [media_prompt([13, 14, None, 15], [a]), media_prompt([16, None], [a])])
    d = delta(eng, before)
    assert d["encoder_jobs"] == 0 and d["encoder_cache_hits"] == 2
    assert d["prefix_cache_hit_tokens"] == 0
    eng.check_idle()


def test_switched_off_caches_change_nothing_but_the_work() -> None:
    gen = torch.Generator().manual_seed(9)
    a = image(gen)
    p = media_prompt([20, 21, 22, None, 23, 24, 25, 26], [a])
    eng = make_engine(encoder_cache_bytes=0, enable_prefix_caching=False)
    check(eng, [p, p])
    check(eng, [p])
    c = eng.counters()
    assert c["encoder_jobs"] == 3 and c["encoder_cache_hits"] == 0
    assert c["prefix_cache_hit_tokens"] == 0 and c["prefill_tokens"] == 3 * 12
    assert eng.block_manager.num_cached == 0 and eng.encoder_cache.num_live == 0
    eng.check_idle()


def test_encoder_cache_evicts_least_recently_used_under_its_budget() -> None:
    # null embeddings: 4 tokens x 4 float32 = 64 bytes per 4x4 image
    eng = make_engine(encoder_cache_bytes=128, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(10)
    imgs = [image(gen) for _ in range(3)]
    for a in imgs:
        check(eng, [media_prompt([30, None], [a])])
    cache = eng.encoder_cache
    assert cache.bytes_cached == 128 and cache.num_evicted == 1
    before = eng.counters()
    check(eng, [media_prompt([31, None], [imgs[2]])])  # most recent: cached
    check(eng, [media_prompt([31, None], [imgs[0]])])  # evicted first: encoded again
    d = delta(eng, before)
    assert d["encoder_cache_hits"] == 1 and d["encoder_jobs"] == 1
    eng.check_idle()


def test_block_manager_reference_counts_and_cache() -> None:
    bm = BlockManager(6, 2, enable_caching=True)
    a = bm.allocate(3)
    hashes = [b"h0", b"h1", b"h2"]
    bm.commit(a, hashes, 0, 2)  # two full blocks
    assert bm.num_cached == 2 and bm.peek(hashes, 3) == 2
    shared = bm.match(hashes, 3)
    assert shared == a[:2] and [bm.ref_count(b) for b in a] == [2, 2, 1]
    bm.free(a)
    assert bm.num_free == 4  # a's third block went back; the shared two are still held
    bm.free(shared)
    assert bm.num_free == 6 and bm.num_cached == 2  # free, but still cached
    got = bm.allocate(4)  # plain free blocks first: nothing evicted
    assert bm.num_cached == 2 and bm.num_evicted == 0
    got += bm.allocate(1)  # now the last freed cached block goes (evicted first: the deeper one)
    assert bm.num_evicted == 1 and bm.peek(hashes, 3) == 1
    bm.free(got)
    bm.check_all_free()
    # fork and copy on write
    x = bm.allocate(2)
    y = bm.fork(x)
    assert bm.make_writable(x, 1) is not None and bm.ref_count(y[1]) == 1
    assert bm.make_writable(y, 1) is None  # y's block is its own now
    bm.free(x)
    bm.free(y)
    bm.check_all_free()
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        bm.free([0])


@pytest.mark.parametrize("mode", ["temporal", "spatial-static"])
def test_media_the_prefix_cache_lost_before_admission_is_encoded_then(mode: str) -> None:
    """An image inside the prefix cache at arrival is not encoded; when its blocks are gone by
    admission (evicted), the request waits for an encoder job instead of running without it."""
    import time

    eng = make_engine(mode, encoder_cache_bytes=0)
    gen = torch.Generator().manual_seed(11)
    a = image(gen)
    turn1 = media_prompt([40, 41, 42, None, 43, 44], [a])
    check(eng, [turn1])
    turn2 = media_prompt([40, 41, 42, None, 43, 44, 45, 46, 47], [a])
    outs = []
    eng.add_request(turn2, GREEDY, sink=outs.append)
    eng._drain(time.monotonic())  # arrival: the image's tokens are all cached
    req = next(iter(eng._active.values()))
    assert req.prefix_hint == 8 and eng.counters()["encoder_jobs"] == 1
    assert eng.block_manager.reset_cache() > 0  # ... and are gone before admission
    while eng.has_unfinished():
        eng.step()
    assert (outs[-1].token_ids, outs[-1].finish_reason) == reference(eng, turn2, GREEDY)
    assert eng.counters()["encoder_jobs"] == 2
    eng.check_idle()


@pytest.mark.parametrize("mode", ["temporal", "spatial-static", "spatial"])
def test_an_image_in_flight_is_encoded_once(mode: str) -> None:
    eng = make_engine(mode, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(12)
    a, b = image(gen), image(gen, (1, 2, 4))
    prompts = [media_prompt([50, None], [a]), media_prompt([51, 52, None, 53], [a]),
               media_prompt([54, None, 55, None], [b, a])]
    check(eng, prompts)
    c = eng.counters()
    assert c["encoder_jobs"] == 2  # a once, then b alone for the third request
    assert (c["encoder_cache_queries"], c["encoder_cache_hits"]) == (4, 2)
    eng.check_idle()


def test_a_request_waiting_on_another_jobs_image_encodes_it_when_that_job_is_dropped() -> None:
    eng = make_engine("spatial-static", enable_prefix_caching=False, prefill_on="decode")
    done = [False]

    class Event:
        def query(self) -> bool:
            return done[0]

    eng.encoder.event_factory = Event
    gen = torch.Generator().manual_seed(13)
    a = image(gen)
    first, second = media_prompt([60, None], [a]), media_prompt([61, None, 62], [a])
    outs = []
    r1 = eng.add_request(first, GREEDY, sink=outs.append)
    eng.add_request(second, GREEDY, sink=outs.append)
    eng.step()
    assert eng.counters()["encoder_jobs"] == 1  # the second waits for the first's job
    eng.abort(r1)
    done[0] = True
    while eng.has_unfinished():
        eng.step()
    assert eng.counters()["encoder_jobs"] == 2  # the job was dropped: encoded for the second
    final = {o.request_id: o for o in outs if o.finished}
    assert final[r1].finish_reason == "abort"
    (out,) = [o for r, o in final.items() if r != r1]
    assert (out.token_ids, out.finish_reason) == reference(eng, second, GREEDY)
    eng.check_idle()
