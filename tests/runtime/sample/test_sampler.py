"""The sampler against torch references on fresh random logits: raw logprobs equal a float64
log_softmax, penalties and logit processing equal plain per-row torch code, draws do not depend
on batch neighbours or order, and the per-slot device state follows requests across batches."""

from __future__ import annotations

import math

import pytest
import torch

from spaceserve.runtime.core.request import Request
from spaceserve.runtime.core.sampling_params import SamplingParams
from spaceserve.runtime.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    logprob_rows,
    reference_next_token,
)
from spaceserve.runtime.sample.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")


def make_req(i: int, prompt: list[int], params: SamplingParams, row: int,
             output: list[int] = ()) -> Request:
    req = Request(f"r{i}", i, prompt, params, seed=1000 + i)
    req.token_ids += list(output)
    req.row, req.admit_serial = row, i + 1
    req.num_placeholders = 1  # the token this step draws
    return req


@pytest.mark.parametrize("b,v,k", [(1, 7, 0), (5, 33, 3), (9, 129, 20)])
def test_logprobs_equal_a_float64_log_softmax(b: int, v: int, k: int) -> None:
    gen = torch.Generator().manual_seed(b * v)
    logits = torch.randn(b, v, generator=gen) * 4
    ids = torch.randint(0, v, (b,), generator=gen)
    rows = logprob_rows(logits, ids, k)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(rows[:, 0].long(), ids)
    assert torch.allclose(rows[:, 1], ref.gather(1, ids[:, None])[:, 0], atol=1e-5)
    rank = (ref > ref.gather(1, ids[:, None])).sum(1) + 1
    assert torch.equal(rows[:, 2].long(), rank)
    if k:
        top = ref.topk(k, dim=-1)
        assert torch.allclose(rows[:, 3:3 + k], top.values, atol=1e-5)
        assert torch.equal(rows[:, 3 + k:].long(), top.indices)


def test_greedy_token_is_the_top_logprob_and_rows_come_back_in_one_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    v = 50
    sampler = Sampler("cpu", v, 8)
    reqs = [make_req(i, [1, 2, 3], SamplingParams(temperature=0.0, logprobs=4), row=i)
            for i in range(5)]
    logits = torch.randn(5, v, generator=gen)
    out = sampler.sample(logits, sampler.prepare(reqs))
    ids, rows = out.fetch()
    assert ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits.double(), -1)
    for i, row in enumerate(rows):
        assert row[2] == 1 and row[7] == ids[i]  # rank 1, and the first of the top ids
        assert row[1] == pytest.approx(float(ref[i].max()), abs=1e-6)


def reference_penalties(x, counts, seen, rep, freq, pres):
    out = x.clone()
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if seen[i, t]:
                out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
            out[i, t] = out[i, t] - freq[i] * counts[i, t] - pres[i] * (counts[i, t] > 0)
    return out


def test_penalties_equal_the_torch_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    b, v = 6, 23
    x = torch.randn(b, v, generator=gen) * 3
    counts = torch.randint(0, 3, (b, v), generator=gen).float()
    seen = (torch.rand(b, v, generator=gen) < 0.4) | (counts > 0)
    rep = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1])
    freq = torch.tensor([0.0, 0.5, -0.3, 1.2, 2.0, 0.0])
    pres = torch.tensor([0.0, -1.0, 0.4, 0.0, 1.5, -2.0])
    scale = torch.where(seen, rep[:, None], 1.0)
    want = reference_penalties(x, counts, seen, rep, freq, pres)
    assert torch.equal(apply_penalties(x, counts, scale, freq[:, None], pres[:, None]), want)
    for mode, keep in (("min", rep >= 1), ("max", rep <= 1)):  # one-sided batches
        got = apply_penalties(x[keep], counts[keep], scale[keep], freq[keep, None],
                              pres[keep, None], mode)
        assert torch.equal(got, want[keep])


def test_min_p_and_top_k_masks() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 40, generator=gen)
    min_p = torch.tensor([0.0, 0.1, 0.5, 0.9])
    got = apply_min_p(x, torch.where(min_p > 0, min_p.log(), -math.inf)[:, None])
    p = x.softmax(-1)
    keep = p >= min_p[:, None] * p.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(got), keep)
    ks = torch.tensor([1, 5, 40, 3])
    got = apply_top_k(x, (ks - 1)[:, None], 40, torch.tensor([False, False, True, False])[:, None])
    assert torch.isfinite(got).sum(-1).tolist() == [1, 5, 40, 3]


def draws(sampler: Sampler, reqs: list[Request], logits: torch.Tensor) -> list[int]:
    return sampler.sample(logits, sampler.prepare(reqs, admissions=-1)).fetch()[0]


PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.4, logit_bias={3: 2.5}),
    SamplingParams(temperature=0.8, top_p=0.7, presence_penalty=0.9, seed=11),
    SamplingParams(temperature=1.3, top_k=5, frequency_penalty=0.6),
    SamplingParams(temperature=0.6, min_p=0.2),
    SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[7, 8]),
    SamplingParams(temperature=0.0),
]


def test_sampler_equals_the_per_token_reference_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    v = 31
    prompts = [torch.randint(0, v, (n,), generator=gen).tolist() for n in (3, 5, 2, 6, 4, 1)]
    outputs = [torch.randint(0, v, (n,), generator=gen).tolist() for n in (0, 4, 2, 1, 0, 3)]
    logits = torch.randn(len(PARAMS), v, generator=gen) * 2

    def reqs(order):
        return [make_req(i, prompts[i], PARAMS[i], row=7 - j, output=outputs[i])
                for j, i in enumerate(order)]

    full = draws(Sampler("cpu", v, 8, eos_token_ids=(0,)), reqs(range(6)), logits)
    for i, p in enumerate(PARAMS):
        ref = reference_next_token(logits[i], p, 1000 + i, prompts[i], outputs[i], eos=(0,))
        assert full[i] == ref, i
    assert full[4] not in (7, 8, 0)  # barred: 0 of 4 min_tokens produced
    perm = [4, 2, 0, 5, 1, 3]
    shuffled = draws(Sampler("cpu", v, 8, eos_token_ids=(0,)), reqs(perm), logits[perm])
    assert shuffled == [full[i] for i in perm]
    for i in range(6):  # alone, in another slot
        one = draws(Sampler("cpu", v, 8, eos_token_ids=(0,)), reqs([i]), logits[i:i + 1])
        assert one == [full[i]]


def test_slot_state_follows_requests_and_batches_are_reused() -> None:
    gen = torch.Generator().manual_seed(8)
    v = 17
    sampler = Sampler("cpu", v, 4)
    p = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)
    a = make_req(0, [1, 2], p, row=2)
    b = make_req(1, [3], SamplingParams(temperature=0.0), row=0)
    batch = sampler.prepare([a, b], admissions=5)
    assert sampler.prepare([a, b], admissions=5) is batch  # unchanged: reused
    assert sampler.prepare([b, a], admissions=5) is not batch
    logits = torch.randn(2, v, generator=gen)
    tok = sampler.sample(logits, sampler.prepare([a, b], admissions=5)).fetch()[0][0]
    assert sampler.counts[2, tok] == 1 and int(sampler.counts[2].sum()) == 1
    assert sampler.last_tokens[2] == tok
    assert sampler.rep_scale[2, 1] == 1.0  # no repetition penalty: seen tokens keep scale 1
    # the request leaves and a new one takes its slot: state is rebuilt from its tokens
    c = make_req(2, [5, 5], p, row=2, output=[9, 9, 4])
    sampler.prepare([c], admissions=6)
    assert sampler.counts[2, 9] == 2 and sampler.counts[2, 4] == 1
    assert int(sampler.counts[2].sum()) == 3
    r = make_req(3, [5, 6], SamplingParams(temperature=0.0, repetition_penalty=1.5), row=1,
                 output=[7])
    sampler.prepare([r], admissions=7)
    assert sampler.rep_scale[1, 5] == 1.5 and sampler.rep_scale[1, 7] == 1.5
    assert sampler.rep_scale[1, 8] == 1.0
