"""Random request lifecycles against the null model: arrivals between steps, aborts at any
time, bad requests, encoder failures and a KV cache small enough to preempt constantly.

Properties: every request ends exactly once (stop, length, abort or error); errors are exactly
the bad requests; every completed request's tokens equal those of the same request run alone
over an unpaged sequence (so preemption, batch mix and arrival order change nothing); an aborted
request's tokens are a prefix of them; afterwards no request, KV block, sequence slot or image
embedding is held, and no image was encoded twice.
"""

import random

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.sample.ops import reference_logprobs
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3
LIFECYCLES_PER_RUN = 400
RUNS = 8  # 3200 lifecycles in all


pytestmark = pytest.mark.usefixtures("one_thread")


def random_config(rng: random.Random) -> dict:
    return dict(
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(2, 12),
        max_num_batched_tokens=rng.randint(16, 48),
        max_model_len=rng.choice([None, 40, 64]),
        max_held_embeddings=rng.randint(1, 4),
        max_encoder_tokens_per_step=rng.randint(1, 16),
        max_images_per_prompt=2,
        async_scheduling=rng.random() < 0.7,
    )


def random_prompt(rng: random.Random, gen: torch.Generator, max_prompt: int
                  ) -> tuple[dict, str | None]:
    """A prompt and the error it must end with (None for a good one)."""
    n = rng.randint(1, max(1, min(max_prompt, 16)))
    ids = [rng.randint(4, 96) for _ in range(n)]
    kind = rng.random()
    if kind < 0.55:
        return {"prompt_token_ids": ids}, None
    if kind < 0.85:
        grids = [(1, 2 * rng.randint(1, 2), 2 * rng.randint(1, 2))
                 for _ in range(rng.randint(1, 2))]
        tok = sum(t * h * w // 4 for t, h, w in grids)
        if n + tok + len(grids) >= max_prompt:
            return {"prompt_token_ids": ids}, None
        for t, h, w in grids:
            ids += [IMG] * (t * h * w // 4) + [1]
        pv = torch.randn(sum(t * h * w for t, h, w in grids), 8, generator=gen)
        prompt = {"prompt_token_ids": ids, "pixel_values": pv, "image_grid_thw": grids}
        if rng.random() < 0.1:
            pv[0, 0] = float("inf")
            return prompt, "image encoding failed"
        return prompt, None
    bad, ids = rng.randrange(5), ids[:4]
    if bad == 0:
        return {"prompt_token_ids": []}, "is empty"
    if bad == 1:
        return {"prompt_token_ids": [5] * (max_prompt + rng.randint(1, 20))}, "tokens"
    if bad == 2:
        return {"prompt_token_ids": ids + [IMG] * 2, "pixel_values": torch.zeros(7, 8),
                "image_grid_thw": [[1, 2, 4]]}, "patch rows"
    if bad == 3:
        return {"prompt_token_ids": ids + [IMG] * 3, "pixel_values": torch.zeros(12, 8),
                "image_grid_thw": [[1, 2, 2]] * 3}, "more than allowed"
    return {"prompt_token_ids": ids + [IMG]}, "no pixel_values"


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 16)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 0.0, 0.7, 1.3]),
        top_p=rng.choice([1.0, 1.0, 0.6]),
        top_k=rng.choice([0, 0, 0, 3, 40]),
        min_p=rng.choice([0.0, 0.0, 0.0, 0.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.0, 0.8, -1.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.0, 0.5, -0.7]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.4, 0.7]),
        logit_bias={t: rng.uniform(-3, 3) for t in rng.sample(range(97), rng.choice([0, 0, 3]))},
        min_tokens=rng.choice([0, 0, 0, min(3, max_tokens)]),
        logprobs=rng.choice([None, None, None, 0, 4]),
        seed=rng.randrange(1 << 40),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.sample(range(4, 97), rng.choice([0, 0, 1, 3])),
    )


def check_logprobs(runner: NullModelRunner, ids: list[int], mm, out) -> None:
    """Every token's logprob entry equals a float64 log-softmax of the same raw logits."""
    assert len(out.logprobs) == len(out.token_ids)
    embeds = runner.encode([mm])[0] if mm is not None else None
    seq = list(ids)
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        logits = runner.reference_logits(runner.token_values(seq, mm, embeds))
        lp, rank, top = reference_logprobs(logits, tok, 4)
        assert entry.token_id == tok and entry.rank == rank
        assert abs(entry.logprob - lp) < 1e-5
        k = len(entry.top)
        assert [t for t, _ in entry.top] == [t for t, _ in top[:k]] or \
            max(abs(a - b) for (_, a), (_, b) in zip(entry.top, top, strict=False)) < 1e-6
        seq.append(tok)


@pytest.mark.parametrize("run", range(RUNS))
def test_random_lifecycles(run: int) -> None:
    rng = random.Random(run)
    gen = torch.Generator().manual_seed(run)
    runner = NullModelRunner(graph_batch_sizes=rng.choice([(), (1, 2, 4, 8)]))
    config = random_config(rng)
    num_blocks = rng.randint(24, 48) // config["block_size"] + 1
    engine = Engine(runner, EngineConfig(num_kv_blocks=num_blocks, **config))
    max_prompt = engine.max_model_len - 1  # longest prompt that leaves room for a token
    submitted: dict[str, tuple[dict, SamplingParams, str | None]] = {}
    finals: dict = {}
    aborted: set[str] = set()
    steps = 0
    while len(submitted) < LIFECYCLES_PER_RUN or engine.has_unfinished():
        if len(submitted) < LIFECYCLES_PER_RUN and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                prompt, expect = random_prompt(rng, gen, max_prompt)
                params = random_params(rng)
                rid = engine.add_request(prompt, params)
                submitted[rid] = (prompt, params, expect)
        if submitted and rng.random() < 0.15:
            rid = rng.choice(list(submitted))
            if engine.abort(rid):
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        steps += 1
        assert steps < 50 * LIFECYCLES_PER_RUN, "the engine stopped making progress"

    assert set(finals) == set(submitted)
    engine.check_idle()
    images = sum(1 for p, _, e in submitted.values() if "pixel_values" in p and e is None)
    assert runner.num_encoded <= images + sum(1 for *_, e in submitted.values()
                                              if e == "image encoding failed")
    preempted = checked = 0
    for rid, (prompt, params, expect) in submitted.items():
        out = finals[rid]
        preempted += out.metrics.num_preemptions
        if out.finish_reason == "error":
            assert expect is not None and expect in out.error, (expect, out.error)
            continue
        if expect is not None:  # only an abort can beat the encoder to a broken image
            assert out.finish_reason == "abort" and out.token_ids == [], (rid, expect)
            continue
        ids, mm = process_prompt(prompt, runner.info, context_len=10**6, capacity=10**6,
                                 max_images=9)
        ref, reason = runner.reference_generate(ids, mm, params, params.seed,
                                                engine.max_model_len)
        if out.finish_reason == "abort":
            assert rid in aborted and out.token_ids == ref[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (ref, reason), rid
        if params.logprobs is not None:
            checked += 1
            check_logprobs(runner, ids, mm, out)
        else:
            assert out.logprobs is None
    assert preempted > 0, "the cache never ran out: the run tests too little"
    assert checked > 0, "no request asked for logprobs"
