"""Language model over the paged cache: logits and greedy tokens against transformers, chunked
prefill, flattened batches mixing prefill chunks and decode tokens, backends, SM budgets."""

import copy

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_close, assert_within_budget
from spaceserve.models import BackendUnavailable, available_backends, get_backend, known_backends

from .conftest import IMAGE, PagedRun, greedy, hf_inputs

RTOL = 1e-4  # fp32 logits against an fp64 transformers reference
TEXT_B = torch.tensor([1, 17, 33, 8, 91, 4, 56, 70, 12])
TEXT_C = torch.tensor([1, 5, 64, 27, 88, 3])
EXTRA = [17, 29]  # tokens appended during decode


@pytest.fixture(scope="module")
def hf64(checkpoints):
    """fp64 copies of the transformers models."""
    return {name: copy.deepcopy(hf).double() for name, (_, hf) in checkpoints.items()}


def hf_logits(hf, ids, pixel_values=None, grid=None):
    """fp64 logits of every position of one sequence."""
    with torch.no_grad():
        if pixel_values is None:
            return hf(input_ids=ids[None], attention_mask=torch.ones_like(ids[None])).logits[0]
        return hf(**hf_inputs(ids, pixel_values.double(), grid)).logits[0]


@pytest.mark.parametrize("name, backend", [("small", "torch"), ("wide", "torch"),
                                           ("small", "triton"), ("wide", "triton")])
def test_prefill_logits_match_transformers(load, encoded, hf64, images, name, backend):
    model = load(name, backend)
    pixel_values, grid, ids = images
    ref = hf_logits(hf64[name], ids, pixel_values, grid)
    embeds = encoded(name, backend)
    positions, delta = model.mrope_positions(ids, grid)
    logits = PagedRun(model).step(ids, positions=positions, delta=delta, image_embeds=embeds)
    assert logits.shape == (1, model.config.text_config.vocab_size)
    assert_close(logits[0], ref[-1], rtol=RTOL)


@pytest.mark.parametrize("name, backend", [("small", "torch"), ("wide", "torch"),
                                           ("small", "triton")])
def test_greedy_matches_generate(checkpoints, load, encoded, images, name, backend):
    hf = checkpoints[name][1]
    pixel_values, grid, ids = images
    hf.generation_config.eos_token_id = None  # always 8 tokens, as the paged loop makes
    with torch.no_grad():
        ref = hf.generate(**hf_inputs(ids, pixel_values, grid), max_new_tokens=8,
                          do_sample=False)[0, len(ids):].tolist()
    assert len(ref) == 8
    assert greedy(load(name, backend), ids, pixel_values, grid, 8,
                  embeds=encoded(name, backend)) == ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_matches_one_shot(load, encoded, hf64, images, backend):
    model = load("small", backend)
    pixel_values, grid, ids = images
    embeds = encoded("small", backend)
    positions, delta = model.mrope_positions(ids, grid)
    one = PagedRun(model).step(ids, positions=positions, delta=delta, image_embeds=embeds)
    run, used, chunk = PagedRun(model, seed=3), 0, 11
    for s in range(0, len(ids), chunk):
        piece = ids[s:s + chunk]
        n_img = int((piece == IMAGE).sum())
        last = s + chunk >= len(ids)
        out = run.step(piece, positions=positions, delta=delta, need_logits=last,
                       image_embeds=embeds[used:used + n_img] if n_img else None)
        assert out.shape[0] == int(last)
        used += n_img
    assert_close(out, one.double(), rtol=1e-5)
    assert_close(out[0], hf_logits(hf64["small"], ids, pixel_values, grid)[-1], rtol=RTOL)


def run_mixed(model, pixel_values, grid, ids, num_sms=None, embeds=None):
    """Three sequences over three steps of one shared cache: prefill + partial chunk, then
    decode + chunk end + full prefill, then decode only. Returns {(seq, step): logits}.
    `embeds`: the images' embeddings if already encoded."""
    if embeds is None:
        embeds = model.encode_images(pixel_values, grid, num_sms=num_sms)
    pos_a, delta_a = model.mrope_positions(ids, grid)
    bs = 4
    cache = model.allocate_kv_cache(64, bs)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [perm[0:20], perm[20:30], perm[30:40]]
    toks = [ids.tolist() + EXTRA, TEXT_B.tolist() + EXTRA[:1], TEXT_C.tolist() + EXTRA[:1]]
    mpos = [pos_a, None, None]
    deltas = [delta_a, 0, 0]
    steps = [  # (seq, cached, new, want logits)
        [(0, 0, len(ids), True), (1, 0, 5, False)],
        [(0, len(ids), 1, True), (1, 5, 4, True), (2, 0, len(TEXT_C), True)],
        [(1, 9, 1, True), (0, len(ids) + 1, 1, True), (2, len(TEXT_C), 1, True)],
    ]
    out = {}
    for k, step in enumerate(steps):
        seqs = [s for s, *_ in step]
        ctx = model.plan_step([c for _, c, _, _ in step], [n for _, _, n, _ in step],
                              [tables[s] for s in seqs], block_size=bs,
                              mrope_positions=[mpos[s] for s in seqs],
                              rope_deltas=[deltas[s] for s in seqs],
                              need_logits=[w for *_, w in step])
        flat = torch.tensor([t for s, c, n, _ in step for t in toks[s][c:c + n]])
        logits = model.forward(flat, ctx, cache, image_embeds=embeds if k == 0 else None,
                               num_sms=num_sms)
        assert logits.shape[0] == len(ctx.host.logits_seqs)
        for row, i in enumerate(ctx.host.logits_seqs):
            out[seqs[i], k] = logits[row]
    return out, toks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batches_match_transformers(load, encoded, hf64, images, backend):
    model = load("small", backend)
    pixel_values, grid, ids = images
    out, toks = run_mixed(model, pixel_values, grid, ids, embeds=encoded("small", backend))
    hf = hf64["small"]
    ref = [hf_logits(hf, torch.tensor(toks[0]), pixel_values, grid),
           hf_logits(hf, torch.tensor(toks[1])), hf_logits(hf, torch.tensor(toks[2]))]
    ends = {(0, 0): len(ids) - 1, (0, 1): len(ids), (0, 2): len(ids) + 1,
            (1, 1): 8, (1, 2): 9, (2, 1): len(TEXT_C) - 1, (2, 2): len(TEXT_C)}
    assert set(out) == set(ends)
    for (seq, step), logits in out.items():
        assert_close(logits, ref[seq][ends[seq, step]], rtol=RTOL)


@pytest.mark.parametrize("backend", known_backends())
def test_backends_agree(load, encoded, images, backend):
    if backend not in available_backends():
        with pytest.raises(BackendUnavailable) as err:
            get_backend(backend)
        pytest.skip(str(err.value))
    pixel_values, grid, ids = images
    ref, _ = run_mixed(load("small", "torch"), pixel_values, grid, ids,
                       embeds=encoded("small", "torch"))
    out, _ = run_mixed(load("small", backend), pixel_values, grid, ids,
                       embeds=encoded("small", backend))
    for key, logits in ref.items():
        assert_close(out[key], logits.double(), rtol=1e-5)


def test_lm_step_stays_under_decoder_budget(load):
    model = load("small", "triton")
    run = PagedRun(model)
    with record_launches() as rec:
        run.step(TEXT_B, num_sms=5)
    ctx = model.plan_step([run.cached], [1], [run.table], block_size=run.block_size)
    token = torch.tensor([EXTRA[0]])
    with record_launches() as rec_decode:
        small = model.forward(token, ctx, run.cache, num_sms=5)
    for records in (rec, rec_decode):
        assert_within_budget(records, 5)
        assert all(r.num_sms == 5 for r in records)
    names = {r.name for r in rec + rec_decode}
    assert {"paged_prefill", "paged_decode", "store_kv", "rms_norm", "linear", "rotary",
            "gated_mlp.gate_up", "gated_mlp.down"} <= names
    # the same step again (same K/V rewritten) under the whole device: bitwise equal
    assert torch.equal(small, model.forward(token, ctx, run.cache))


def test_bad_lm_inputs_raise(load, images):
    model = load("small", "torch")
    _, grid, ids = images
    run = PagedRun(model)
    positions, delta = model.mrope_positions(ids, grid)
    hidden = model.config.text_config.hidden_size
    with pytest.raises(ValueError, match="image_embeds"):
        run.step(ids, positions=positions, delta=delta, image_embeds=torch.zeros(3, hidden))
    with pytest.raises(ValueError, match="image_embeds"):
        run.step(ids, positions=positions, delta=delta, image_embeds=torch.zeros(18, 7))
    ctx = model.plan_step([0], [4], [run.table], block_size=run.block_size)
    with pytest.raises(ValueError, match="input_ids"):
        model.forward(ids[:3], ctx, run.cache)
    with pytest.raises(ValueError, match="kv_cache"):
        model.forward(ids[:4], ctx, model.allocate_kv_cache(8, 8))
    with pytest.raises(ValueError, match="block_size"):
        model.allocate_kv_cache(8, 6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_replanned_decode_equals_eager(load, backend):
    """What a CUDA-graph replay does, on CPU: one padded all-padding context reused for new
    steps via copy_from + replan (plan buffers kept) gives the eager step's logits; padding
    tokens store nothing (the torch store puts them in the scratch block)."""
    model = load("small", backend)
    runs = [PagedRun(model, seed=s) for s in range(3)]
    cache = runs[0].cache
    for r in runs[1:]:
        r.cache = cache
    runs[1].table, runs[2].table = runs[1].table[::-1], runs[2].table[1:] + runs[2].table[:1]
    runs[0].step(TEXT_B, need_logits=False)
    runs[1].step(TEXT_C, need_logits=False)
    runs[2].step(TEXT_B[:4], need_logits=False)
    width = len(runs[0].table)
    static = model.plan_step([], [], [], block_size=4, pad_seqs_to=4, max_blocks_per_seq=width)
    plan = static.plan
    ids = torch.tensor([EXTRA[0], EXTRA[1], 7, 0])
    before = [c[:-1].clone() for c in cache.k + cache.v]  # all but the scratch block
    assert model.forward(ids, static, cache).shape == (4, 128)
    assert all(torch.equal(b, c[:-1]) for b, c in zip(before, cache.k + cache.v, strict=True))
    for step, seqs in enumerate([[0, 1, 2], [2, 0]]):
        tables = [runs[i].table for i in seqs]
        cached = [runs[i].cached for i in seqs]
        eager = model.forward(ids[:len(seqs)], model.plan_step(
            cached, [1] * len(seqs), tables, block_size=4), cache)
        static.copy_from(model.plan_step(cached, [1] * len(seqs), tables, block_size=4,
                                         pad_seqs_to=4, max_blocks_per_seq=width))
        static.plan = model.backend.replan(static.plan, static)
        assert static.plan is plan  # buffers a graph captured stay the same objects
        padded = model.forward(torch.cat([ids[:len(seqs)], ids[len(seqs):]]), static, cache)
        if backend == "triton":  # per-row arithmetic does not depend on the padded rows
            assert torch.equal(padded[:len(seqs)], eager), step
        else:  # stock CPU GEMMs block differently for 3 and 4 rows
            assert_close(padded[:len(seqs)], eager.double(), rtol=1e-6)
        for i in seqs:
            runs[i].cached += 1
