"""Random lifecycles with both caches under pressure: prompts drawn from a few shared system
prompts and images, follow-up turns that resend a finished conversation, parallel sampling
(n up to 3: forked sequences sharing the prompt's blocks, copy on write of the last one), aborts
at any time, a KV cache small enough to preempt and evict constantly and an encoder cache of a
few images, steps pipelined (temporal) or not; half the runs with the fair share
(`EngineConfig.fair_share`: over-share sequences preempted for waiting requests, groups
detaching siblings over their share), half first-come first-served.

Properties: after every step each KV block's reference count equals the number of running
requests' block lists holding it, free blocks have none, and the prefix cache's table names only
committed blocks; every completed sequence's tokens equal those of the same request run alone
over an unpaged sequence (sequence i with seed + i); at the end no block, slot, embedding or
encoder-cache reference is held - no leak."""

import random

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.core.request import Status
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.worker.null import NullModelRunner
from tests.runtime.engine.test_parallel_sampling import record_copies

IMG = 3
LIFECYCLES_PER_RUN = 250
RUNS = 8  # 2000 lifecycles in all

pytestmark = pytest.mark.usefixtures("one_thread")


def check_blocks(engine: Engine) -> None:
    """Reference counts are exactly the running requests' holdings."""
    bm = engine.block_manager
    held = [0] * bm.num_blocks
    for req in engine.scheduler.running:
        for b in req.block_ids:
            held[b] += 1
    for req in engine.scheduler.waiting:
        assert not req.block_ids, "a waiting request holds blocks"
        if req.group is not None:
            assert all(not c.block_ids for c in req.group.unforked), "an unforked one holds"
    assert held == [bm.ref_count(b) for b in range(bm.num_blocks)]
    free = set(bm._free) | set(bm._lru)
    assert len(free) == bm.num_free and all(held[b] == 0 for b in free)
    assert all(held[b] > 0 for b in range(bm.num_blocks) if b not in free)
    assert all(bm._hash[b] == h for h, b in bm._table.items())
    assert all(bm._table.get(h) == b for b, h in enumerate(bm._hash) if h is not None)


class Pool:
    """Shared pieces prompts are made of, and finished conversations to continue."""

    def __init__(self, rng: random.Random, gen: torch.Generator) -> None:
        self.rng = rng
        self.systems = [[rng.randint(4, 96) for _ in range(rng.randint(3, 13))]
                        for _ in range(3)]
        self.images = []
        for _ in range(4):
            t, h, w = 1, 2 * rng.randint(1, 2), 2 * rng.randint(1, 2)
            self.images.append(([IMG] * (h * w // 4) + [1], torch.randn(h * w, 8, generator=gen),
                                (t, h, w)))
        self.done: list[dict] = []

    def prompt(self, max_prompt: int) -> dict:
        rng = self.rng
        if self.done and rng.random() < 0.3:  # the next turn of a finished conversation
            base = rng.choice(self.done)
            ids = base["prompt_token_ids"] + [rng.randint(4, 96) for _ in range(rng.randint(1, 4))]
            if len(ids) < max_prompt:
                return dict(base, prompt_token_ids=ids)
        while True:  # draw again until it fits (a small KV cache shortens the context)
            ids = list(rng.choice(self.systems))
            pvs, grids = [], []
            for _ in range(rng.choice([0, 0, 1, 1, 2])):
                toks, pv, grid = rng.choice(self.images)
                ids += toks + [rng.randint(4, 96) for _ in range(rng.randint(0, 2))]
                pvs.append(pv)
                grids.append(grid)
            ids += [rng.randint(4, 96) for _ in range(rng.randint(1, 6))]
            if len(ids) <= max_prompt:
                break
        if not pvs:
            return {"prompt_token_ids": ids}
        return {"prompt_token_ids": ids, "pixel_values": torch.cat(pvs),
                "image_grid_thw": torch.tensor(grids)}


@pytest.mark.parametrize("run", range(RUNS))
def test_random_lifecycles_with_caching(run: int) -> None:
    rng = random.Random(1000 + run)
    gen = torch.Generator().manual_seed(run)
    bs = rng.choice([1, 2, 4])
    config = dict(block_size=bs, max_num_seqs=rng.randint(2, 8),
                  max_num_batched_tokens=rng.randint(8, 40), max_model_len=64,
                  max_held_embeddings=rng.randint(1, 4), max_images_per_prompt=2,
                  encoder_cache_bytes=rng.choice([0, 200, 600, 1 << 20]),
                  mode=rng.choice(["temporal", "temporal", "spatial-static"]),
                  fair_share=run % 2 == 1)
    engine = Engine(NullModelRunner(), EngineConfig(num_kv_blocks=rng.randint(30, 60) // bs + 2,
                                                    **config))
    pool = Pool(rng, gen)
    copies = record_copies(engine)
    submitted: dict[str, tuple[dict, SamplingParams]] = {}
    finals: dict = {}
    aborted: set[str] = set()
    steps = 0
    while len(submitted) < LIFECYCLES_PER_RUN or engine.has_unfinished():
        if len(submitted) < LIFECYCLES_PER_RUN and rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                prompt = pool.prompt(engine.max_model_len - 17)
                params = SamplingParams(max_tokens=rng.randint(1, 12),
                                        temperature=rng.choice([0.0, 0.8]),
                                        seed=rng.randrange(1 << 30), ignore_eos=True,
                                        n=min(rng.choice([1, 1, 1, 1, 2, 3]),
                                              config["max_num_seqs"]))
                submitted[engine.add_request(prompt, params)] = (prompt, params)
        if submitted and rng.random() < 0.1:
            rid = rng.choice(list(submitted))
            if engine.abort(rid):
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                key = (out.request_id, out.index)
                assert key not in finals, "a sequence finished twice"
                finals[key] = out
                if out.finish_reason == "length":
                    prompt = submitted[out.request_id][0]
                    said = [5 if t == IMG else t for t in out.token_ids]  # text, not media
                    pool.done.append(dict(prompt, prompt_token_ids=out.prompt_token_ids + said))
        check_blocks(engine)
        assert all(r.status is Status.RUNNING for r in engine.scheduler.running)
        steps += 1
        assert steps < 60 * LIFECYCLES_PER_RUN, "the engine stopped making progress"

    assert set(finals) == {(r, i) for r, (_, p) in submitted.items() for i in range(p.n)}
    engine.check_idle()
    c = engine.counters()
    assert c["prefix_cache_hit_tokens"] > 0 and c["encoder_cache_hits"] > 0
    assert engine.block_manager.num_evicted > 0, "the prefix cache never evicted"
    assert copies or bs == 1 or config["fair_share"], "no forked sequence ever copied a block"
    if config["fair_share"]:
        assert engine.scheduler.fair.num_preempted > 0, "the fair share never preempted"
    for (rid, i), out in finals.items():
        prompt, params = submitted[rid]
        assert out.error is None, out.error
        ids, mm = process_prompt(prompt, engine.runner.info, context_len=10**6, capacity=10**6,
                                 max_images=9)
        ref, reason = engine.runner.reference_generate(ids, mm, params, params.seed + i,
                                                       engine.max_model_len)
        if out.finish_reason == "abort":
            assert rid in aborted and out.token_ids == ref[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (ref, reason), (rid, i)
