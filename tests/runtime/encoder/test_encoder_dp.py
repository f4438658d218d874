"""The data-parallel encoder's scheduling, in-process on the null model: the rank assignment
(longest first onto the least loaded rank), one TWSRFT queue per rank, and the encoder stages
(temporal, temporal-chunked, spatial) driving a runner whose images of ranks > 0 complete
elsewhere and out of order - outputs equal the one-request reference, images are spread over
the ranks, an image that fails on its owner fails alone, and images the encoder cache holds
reach no rank. The real worker processes are
`test_tensor_parallel.py`'s."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.encoder.data_parallel import (
    EncodingFailed,
    RankedTwsrft,
    RoundTwsrft,
    assign_ranks,
)
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3  # the null model's image token id
CFG = dict(num_kv_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)

pytestmark = pytest.mark.usefixtures("one_thread")


def image_prompt(gen: torch.Generator, n_text: int, grid=(1, 4, 4)) -> dict:
    t, h, w = grid
    ids = torch.randint(4, 97, (n_text,), generator=gen).tolist() + [IMG] * (t * h * w // 4)
    return {"prompt_token_ids": ids + [1],
            "pixel_values": torch.randn(t * h * w, 8, generator=gen),
            "image_grid_thw": torch.tensor([grid])}


def text_prompt(gen: torch.Generator, n: int) -> dict:
    return {"prompt_token_ids": torch.randint(4, 97, (n,), generator=gen).tolist()}


def check_outputs(eng: Engine, prompts, params, outs) -> None:
    """Every output equals the null model's one-request reference."""
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        assert out.error is None, out.error
        ids, mm = process_prompt(prompt, eng.runner.info, context_len=10**6, capacity=10**6,
                                 max_images=99)
        ref = eng.runner.reference_generate(ids, mm, sp, sp.seed or 0, eng.max_model_len)
        assert (out.token_ids, out.finish_reason) == ref


# -- assignment ------------------------------------------------------------------------------

def test_assign_ranks_longest_first_onto_the_least_loaded() -> None:
    assert assign_ranks([1.0, 5.0, 2.0, 2.0], 2) == [1, 0, 1, 1]
    assert assign_ranks([3.0, 3.0, 3.0], 3) == [0, 1, 2]
    assert assign_ranks([1.0, 1.0], 2, loads=[5.0, 0.0]) == [1, 1]
    assert assign_ranks([], 4) == []
    with pytest.raises(ValueError, match="ranks=0"):
        assign_ranks([1.0], 0)
    with pytest.raises(ValueError, match="loads has 1 entries for 2 ranks"):
        assign_ranks([1.0], 2, loads=[0.0])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), max_size=6), st.integers(1, 4))
def test_assign_ranks_is_within_four_thirds_of_the_best_makespan(costs, ranks) -> None:
    got = assign_ranks(costs, ranks)
    load = [0.0] * ranks
    for c, r in zip(costs, got, strict=True):
        load[r] += c
    best = min(max(sum(c for c, r in zip(costs, split, strict=True) if r == k)
                   for k in range(ranks))
               for split in itertools.product(range(ranks), repeat=len(costs))) \
        if costs else 0.0
    assert max(load) <= best * 4 / 3 + 1e-9


def test_ranked_twsrft_balances_and_orders_each_rank() -> None:
    sched = RankedTwsrft(2, 4, lambda patches, layers: patches * layers, window_s=float("inf"),
                         token_budget=1, clock=lambda: 0.0)
    assert [sched.submit(rid, p) for rid, p in (("a", 10), ("b", 1), ("c", 1), ("d", 1))] == \
        [0, 1, 1, 1]  # "a" alone outweighs the three small ones
    assert sched.load(0) == 40 and sched.load(1) == 12
    assert sched.submit("e", 5, rank=0) == 0 and sched.rank_of("e") == 0
    g = sched.next_grant(0)
    assert g.request_ids == ("e",)  # shortest remaining first within rank 0
    assert sched.report(g.job_id, g.layers, 0) == ("e",) and sched.rank_of("e") is None
    assert len(sched) == 4 and len(sched.jobs()) == 4
    with pytest.raises(ValueError, match="rank=2 is outside 0..1"):
        sched.submit("f", 1, rank=2)


def test_round_twsrft_grants_every_rank_at_once_priced_by_the_slowest() -> None:
    cost = lambda patches, layers: patches * layers  # noqa: E731
    sched = RoundTwsrft(2, 4, cost, window_s=float("inf"), token_budget=1, clock=lambda: 0.0)
    for rid, p in (("big", 10), ("a", 2), ("b", 3)):
        sched.submit(rid, p)
    g = sched.next_grant()  # rank 0: big; rank 1: a (shortest first), together
    assert (set(g.request_ids), g.patches, g.layers) == ({"big", "a"}, 10, 4) and sched.busy
    with pytest.raises(RuntimeError, match="a round is outstanding"):
        sched.next_grant()
    assert set(sched.report(g.job_id, 4)) == {"big", "a"}
    g = sched.next_grant()
    assert (g.request_ids, g.patches) == (("b",), 3)
    assert sched.report(g.job_id, 4) == ("b",) and len(sched) == 0
    # a round cut short (a temporal-chunked window): each member runs what fits in its time
    for rid, p in (("x", 8), ("y", 2)):
        sched.submit(rid, p)
    g = sched.next_grant()
    assert g.patches == 8 and sched.report(g.job_id, 1) == ("y",)  # 8 s: y's 4 layers fit
    assert {j.request_ids: j.depth for j in sched.jobs()} == {("x",): 1}


# -- stages over a data-parallel null runner ------------------------------------------------------

class _Later:
    """The event of work sent to another rank: complete after `polls` queries."""

    def __init__(self, polls: int) -> None:
        self.left = polls

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.left = -1


class DataParallelNull(NullModelRunner):
    """The null model behind a data-parallel encoder of `ranks` ranks: a job of rank > 0 runs
    here too, but its embeddings only come back through `share_encoding` (after its event,
    which completes after a few polls - the later the higher the rank, so flights complete out
    of order). An image whose first pixel value is 1234 fails on any owner but rank 0 (an
    out-of-memory there, as it were)."""

    def __init__(self, ranks: int, **kw) -> None:
        super().__init__(**kw)
        self.encoder_ranks = ranks
        self.encoded = [0] * ranks
        self.shared: list[int] = []
        self.jobs: list[int] = []  # the patches of every job given to a rank

    @staticmethod
    def poisoned(mm) -> bool:
        return bool(mm.pixel_values[0, 0] == 1234.0)

    def start_encode(self, mm, pixel_values=None, *, rank=0):
        job = super().start_encode(mm, pixel_values)
        job.owner, job.result = rank, None
        self.encoded[rank] += 1
        self.jobs.append(int(mm.pixel_values.shape[0]))
        return job

    def finish_encode(self, job, *, num_sms=None):
        emb = super().finish_encode(job, num_sms=num_sms)
        if job.owner == 0:
            return emb
        job.result = emb
        return None

    def encoder_event(self, job):
        return _Later(3 * job.owner)

    def share_encoding(self, job, embeds, *, num_sms=None):
        self.shared.append(job.owner)
        if job.owner and self.poisoned(job.mm):
            raise EncodingFailed(f"image encoding failed on tensor-parallel rank {job.owner}: "
                                 "RuntimeError: out of memory")
        return embeds if job.owner == 0 else job.result

    def encode(self, mms, ranks=None):
        if ranks is None:  # the reference
            return super().encode(mms)
        assert len(ranks) == len(mms)
        out = []
        for mm, r in zip(mms, ranks, strict=True):
            self.encoded[r] += 1
            self.jobs.append(int(mm.pixel_values.shape[0]))
            out.append(EncodingFailed(f"rank {r}: out of memory") if r and self.poisoned(mm)
                       else super().encode([mm])[0])
        return out


def _workload(n: int = 9):
    gen = torch.Generator().manual_seed(3)
    prompts = [image_prompt(gen, 5 + i, (1, 8, 4) if i % 2 else (1, 4, 4)) if i % 3 != 2
               else text_prompt(gen, 7) for i in range(n)]
    params = [SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("mode, driver", [("temporal", "cooperative"),
                                          ("temporal-chunked", "cooperative"),
                                          ("spatial-static", "cooperative"),
                                          ("spatial", "thread")])
def test_images_spread_over_ranks_give_the_reference_tokens(mode, driver) -> None:
    runner = DataParallelNull(3)
    eng = Engine(runner, EngineConfig(mode=mode, encoder_driver=driver, **CFG))
    try:
        prompts, params = _workload()
        outs = eng.generate(prompts, params)
        check_outputs(eng, prompts, params, outs)
        assert sum(1 for n in runner.encoded if n) == 3, runner.encoded
        if mode != "temporal":  # layer by layer: shared from every rank
            assert sorted(set(runner.shared)) == [0, 1, 2]
        eng.check_idle()
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["temporal", "temporal-chunked", "spatial-static"])
def test_an_image_failing_on_its_owner_fails_alone(mode) -> None:
    runner = DataParallelNull(2)
    eng = Engine(runner, EngineConfig(mode=mode, **CFG))
    try:
        prompts, params = _workload(6)
        for p in prompts:
            if "pixel_values" in p:
                p["pixel_values"][0, 0] = 1234.0  # fails wherever rank 1 encodes it
        outs = eng.generate(prompts, params)
        failed = [o for o in outs if o.error is not None]
        assert failed and all("out of memory" in o.error for o in failed)
        assert len(failed) < sum(1 for p in prompts if "pixel_values" in p), \
            "rank 0's images should succeed"
        ok = [(p, sp, o) for p, sp, o in zip(prompts, params, outs, strict=True)
              if o.error is None]
        check_outputs(eng, *map(list, zip(*ok, strict=True)))
        eng.check_idle()
    finally:
        eng.close()


def _media(gen: torch.Generator, head: list[int], grids: list[tuple], pvs=None) -> dict:
    """A prompt of `head` then one image per grid (patches `pvs`, or fresh ones)."""
    pvs = pvs or [torch.randn(t * h * w, 8, generator=gen) for t, h, w in grids]
    ids = list(head)
    for t, h, w in grids:
        ids += [IMG] * (t * h * w // 4) + [1]
    return {"prompt_token_ids": ids, "pixel_values": torch.cat(pvs),
            "image_grid_thw": torch.tensor(grids)}


@pytest.mark.parametrize("mode", ["temporal", "temporal-chunked", "spatial-static"])
def test_cached_images_reach_no_rank_and_jobs_cover_only_the_rest(mode) -> None:
    """With the encoder cache, a rank is assigned only the images no cache holds: a request
    whose images are all cached is encoded nowhere, one with a cached and a new image gives a
    rank a job of the new image alone, and every output still equals the reference (the
    shared embeddings split into per-image entries)."""
    runner = DataParallelNull(2)
    eng = Engine(runner, EngineConfig(mode=mode, enable_prefix_caching=False, **CFG))
    try:
        gen = torch.Generator().manual_seed(21)
        grids = [(1, 4, 4), (1, 8, 4), (1, 4, 4), (1, 4, 8)]
        pvs = [torch.randn(t * h * w, 8, generator=gen) for t, h, w in grids]
        greedy = [SamplingParams(max_tokens=4, temperature=0.0)]
        first = [_media(gen, [5 + i], grids[i:i + 1], pvs[i:i + 1]) for i in range(3)]
        check_outputs(eng, first, greedy * 3, eng.generate(first, greedy * 3))
        assert sorted(runner.jobs) == [16, 16, 32] and all(runner.encoded), runner.encoded
        # two of them again, in one request, after other text: no rank encodes anything
        again = [_media(gen, [9, 10, 11], [grids[1], grids[0]], [pvs[1], pvs[0]])]
        check_outputs(eng, again, greedy, eng.generate(again, greedy))
        assert len(runner.jobs) == 3
        # a cached image beside a new one: the job (and the rank's share) is the new one alone
        # (on rank 1 in the stages that pick the rank given the fewest images when idle)
        mixed = [_media(gen, [12], [grids[0], grids[3]], [pvs[0], pvs[3]])]
        check_outputs(eng, mixed, greedy, eng.generate(mixed, greedy))
        assert runner.jobs[3:] == [32]
        c = eng.counters()
        assert c["encoder_jobs"] == 4
        assert (c["encoder_cache_queries"], c["encoder_cache_hits"]) == (7, 3)
        eng.check_idle()
    finally:
        eng.close()
