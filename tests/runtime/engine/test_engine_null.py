"""The engine end to end with the null model: outputs, isolation of bad requests, abort,
streaming, timings, sampling and validation."""

import asyncio
import io

import pytest
import torch

from spaceserve import Engine, RequestOutput, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.sample.ops import fold_seed, sample
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3  # the null model's image token id
CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(runner: NullModelRunner | None = None, **cfg) -> Engine:
    return Engine(runner or NullModelRunner(), EngineConfig(**(CFG | cfg)))


def text_prompt(gen: torch.Generator, n: int) -> dict:
    return {"prompt_token_ids": (torch.randint(4, 97, (n,), generator=gen)).tolist()}


def image_prompt(gen: torch.Generator, n_text: int, grids=((1, 4, 4),)) -> dict:
    ids = torch.randint(4, 97, (n_text,), generator=gen).tolist()
    patches = 0
    for t, h, w in grids:
        ids += [IMG] * (t * h * w // 4) + [1]
        patches += t * h * w
    return {"prompt_token_ids": ids, "pixel_values": torch.randn(patches, 8, generator=gen),
            "image_grid_thw": torch.tensor(grids)}


def reference(engine: Engine, prompt: dict, params: SamplingParams) -> tuple[list[int], str]:
    runner = engine.runner
    ids, mm = process_prompt(prompt, runner.info, context_len=10**6, capacity=10**6,
                             max_images=99)
    return runner.reference_generate(ids, mm, params, params.seed or 0, engine.max_model_len)


def mixed_workload(seed: int = 0, n: int = 12):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(n):
        k = int(torch.randint(1, 30, (), generator=gen))
        prompts.append(image_prompt(gen, k) if i % 3 == 0 else text_prompt(gen, k))
        kind = i % 4
        params.append(SamplingParams(
            max_tokens=int(torch.randint(1, 12, (), generator=gen)),
            temperature=0.0 if kind == 0 else 0.9, top_p=0.8 if kind == 2 else 1.0,
            seed=100 + i, ignore_eos=kind == 3, stop_token_ids=[5] if kind == 1 else []))
    return prompts, params


def tokens(outs: list[RequestOutput]) -> list[tuple[list[int], str]]:
    return [(o.token_ids, o.finish_reason) for o in outs]


def test_generate_matches_reference_in_prompt_order() -> None:
    engine = make_engine()
    prompts, params = mixed_workload()
    outs = engine.generate(prompts, params)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs),
                                                   key=lambda r: int(r.split("-")[1]))
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        assert out.finished and out.error is None
        assert (out.token_ids, out.finish_reason) == reference(engine, prompt, sp)
        assert out.prompt_token_ids == prompt["prompt_token_ids"]
    engine.check_idle()


def test_outputs_do_not_depend_on_order_batching_or_preemption() -> None:
    prompts, params = mixed_workload(seed=1, n=16)
    base = tokens(make_engine(num_kv_blocks=512, max_num_seqs=16).generate(prompts, params))
    tiny = make_engine(num_kv_blocks=14, max_num_batched_tokens=16)
    outs = tiny.generate(prompts, params)
    assert tokens(outs) == base
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the tiny cache never preempted"
    tiny.check_idle()
    serial = make_engine(max_num_seqs=1, max_num_batched_tokens=5)
    assert tokens(serial.generate(prompts, params)) == base
    rev = make_engine().generate(prompts[::-1], params[::-1])
    assert tokens(rev)[::-1] == base
    padded = make_engine(NullModelRunner(graph_batch_sizes=(1, 2, 4, 8)))
    assert padded.graph_batch_sizes == (1, 2, 4, 8)
    assert tokens(padded.generate(prompts, params)) == base


def test_embeddings_survive_preemption_and_are_released() -> None:
    gen = torch.Generator().manual_seed(2)
    runner = NullModelRunner()
    engine = make_engine(runner, num_kv_blocks=14, max_num_batched_tokens=16)
    prompts = [image_prompt(gen, 3) for _ in range(6)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, sp)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert runner.num_encoded == len(prompts)  # a recompute reuses the embeddings
    for prompt, out in zip(prompts, outs, strict=True):
        assert (out.token_ids, out.finish_reason) == reference(engine, prompt, sp)
    engine.check_idle()


class CharProcessor:
    """A stand-in processor: characters become tokens; each image becomes a 1x2x2 grid."""

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    tokenizer = Tokenizer()
    image_processor = object()

    def __call__(self, text, images=None, return_tensors="pt"):
        ids = [4 + ord(c) % 90 for c in text[0]]
        out = {}
        if images:
            ids += [IMG] * len(images)
            out["pixel_values"] = torch.cat(
                [torch.full((4, 8), float(sum(im.getpixel((0, 0))))) for im in images])
            out["image_grid_thw"] = torch.tensor([[1, 2, 2]] * len(images))
        out["input_ids"] = torch.tensor([ids])
        return out


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_requests_fail_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    engine = make_engine(num_kv_blocks=16, max_model_len=50)
    good = [text_prompt(gen, 5), image_prompt(gen, 4)]
    mismatch = image_prompt(gen, 2)
    mismatch["pixel_values"] = mismatch["pixel_values"][:-1]
    broken = image_prompt(gen, 2)
    broken["pixel_values"][0, 0] = float("nan")
    bad = {
        "is empty": {"prompt_token_ids": []},
        "patch rows": mismatch,
        "leaving no room": text_prompt(gen, 50),
        "more than allowed": image_prompt(gen, 1, grids=((1, 2, 2),) * 9),
        "outside the vocabulary": {"prompt_token_ids": [5, 97]},
        "no pixel_values": {"prompt_token_ids": [5, IMG, IMG]},
        "image_grid_thw is missing": {"prompt_token_ids": [5], "pixel_values": torch.zeros(4, 8)},
        "this needs a tokenizer": {"prompt": "hello"},
        "image encoding failed": broken,
    }
    prompts = [good[0], *bad.values(), good[1]]
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    outs = engine.generate(prompts, sp)
    for out, needle in zip(outs[1:-1], bad, strict=True):
        assert out.finish_reason == "error" and needle in out.error, (needle, out.error)
        assert out.token_ids == []
    for i in (0, -1):
        assert outs[i].finish_reason in ("stop", "length") and outs[i].error is None
        assert (outs[i].token_ids, outs[i].finish_reason) == reference(engine, prompts[i], sp)
    engine.check_idle()


def test_prompt_that_can_never_fit_in_the_cache_is_refused() -> None:
    engine = make_engine(num_kv_blocks=4, block_size=4)  # 16 tokens in all
    outs = engine.generate([{"prompt_token_ids": [5] * 16}, {"prompt_token_ids": [5] * 15}],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "can never fit" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 1  # capped at 16


def test_text_prompts_and_images_through_a_processor() -> None:
    engine = Engine(NullModelRunner(), EngineConfig(**CFG), processor=CharProcessor())
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = engine.generate([{"prompt": "hi", "images": [png_bytes()]},
                            {"prompt": "hi", "images": [b"not an image"]}, "plain text"], sp)
    assert outs[0].finish_reason == "length" and outs[0].prompt_token_ids[-1] == IMG
    assert outs[0].text == CharProcessor.tokenizer.decode(outs[0].token_ids)
    assert outs[1].finish_reason == "error" and "images[0] cannot be decoded" in outs[1].error
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 3
    engine.check_idle()


def test_text_prompts_through_a_tokenizer_alone() -> None:
    class Tokenizer:
        def encode(self, text):
            return [4 + ord(c) % 90 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    engine = Engine(NullModelRunner(), EngineConfig(**CFG), tokenizer=Tokenizer())
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outs = engine.generate(["ab", {"prompt": "ab", "images": [png_bytes()]}], sp)
    assert outs[0].prompt_token_ids == [4 + ord("a") % 90, 4 + ord("b") % 90]
    assert outs[0].text == ",".join(map(str, outs[0].token_ids))
    assert outs[1].finish_reason == "error" and "an image processor" in outs[1].error


def test_abort_waiting_and_running() -> None:
    gen = torch.Generator().manual_seed(4)
    engine = make_engine(max_num_seqs=2)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [text_prompt(gen, 6) for _ in range(4)]
    rids = [engine.add_request(p, sp) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.abort(rids[0]) and engine.abort(rids[3])
    assert not engine.abort("no-such-request")
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[rids[0]].finish_reason == "abort" and finals[rids[3]].finish_reason == "abort"
    assert 0 < len(finals[rids[0]].token_ids) < 20 and finals[rids[3]].token_ids == []
    ref = reference(engine, prompts[0], sp)[0]
    assert finals[rids[0]].token_ids == ref[: len(finals[rids[0]].token_ids)]
    assert [finals[r].finish_reason for r in rids[1:3]] == ["length", "length"]
    assert not engine.abort(rids[1])
    engine.check_idle()


def test_duplicate_request_id_raises() -> None:
    engine = make_engine()
    engine.add_request({"prompt_token_ids": [5]}, request_id="x")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request({"prompt_token_ids": [5]}, request_id="x")
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request({"prompt_token_ids": [5]}, {"max_tokens": 3})
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2"):
        engine.generate([{"prompt_token_ids": [5]}] * 2, [SamplingParams()])


def test_stream_yields_incremental_outputs_and_aborts_on_exit() -> None:
    gen = torch.Generator().manual_seed(5)
    engine = make_engine()
    sp = SamplingParams(max_tokens=6, temperature=0.7, seed=9, ignore_eos=True)
    prompts = [text_prompt(gen, 5), image_prompt(gen, 3)]

    async def collect(prompt):
        return [out async for out in engine.stream(prompt, sp)]

    async def leave_early(prompt):
        async for out in engine.stream(prompt, sp, request_id="early"):
            return out

    async def main():
        return await asyncio.gather(collect(prompts[0]), collect(prompts[1]),
                                    leave_early(prompts[0]))

    streams = asyncio.run(main())
    for prompt, outs in zip(prompts, streams[:2], strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert (outs[-1].token_ids, outs[-1].finish_reason) == reference(engine, prompt, sp)
    assert not streams[2].finished
    while engine.has_unfinished():
        engine.step()  # the abort of "early" lands at the next step
    engine.check_idle()


def test_timings_are_ordered() -> None:
    engine = make_engine()
    out = engine.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=5,
                                                                        ignore_eos=True))[0]
    m = out.metrics
    assert len(m.token_times) == len(out.token_ids) == 5
    assert m.arrival_time <= m.first_token_time == m.token_times[0] <= m.finished_time
    assert list(m.token_times) == sorted(m.token_times)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=-1), "seed"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(mode="sideways"), "mode"), (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(gpu_memory_utilization=0), "gpu_memory"),
    (dict(num_kv_blocks=0), "num_kv_blocks"), (dict(graph_batch_sizes=(0,)), "graph_batch"),
    (dict(graph_context_lens=(0,)), "graph_context_lens"),
    (dict(graph_context_lens=()), "graph_context_lens"),
    (dict(graph_reserve_bytes=-1), "graph_reserve_bytes"),
])
def test_engine_config_validation(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)


def test_from_pretrained_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        Engine.from_pretrained("/nonexistent", attention_backend="magic")
    with pytest.raises(ValueError, match="mode"):
        Engine.from_pretrained("/nonexistent", mode="sideways")


def test_sampler_is_batch_independent_and_exact_when_greedy() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 50, generator=gen) * 3
    temp = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.8])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 1e-6])
    seeds = torch.tensor([fold_seed(s) for s in (1, 2, 3, 4, 5, 6)])
    pos = torch.tensor([7, 8, 9, 10, 11, 12])
    full = sample(logits, temp, top_p, seeds, pos)
    assert full[0] == logits[0].argmax() and full[5] == logits[5].argmax()
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    shuffled = sample(logits[perm], temp[perm], top_p[perm], seeds[perm], pos[perm])
    assert torch.equal(shuffled, full[perm])
    for i in range(6):
        one = sample(logits[i:i + 1], temp[i:i + 1], top_p[i:i + 1], seeds[i:i + 1],
                     pos[i:i + 1], use_top_p=bool(top_p[i] < 1))
        assert torch.equal(one, full[i:i + 1])


def test_sampler_follows_the_softmax_and_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4)
    n = logits.shape[0]
    ones = torch.ones(n)
    seeds = torch.full((n,), fold_seed(42))
    drawn = sample(logits, ones, ones, seeds, torch.arange(n), use_top_p=False)
    freq = torch.bincount(drawn, minlength=4).double() / n
    assert (freq - logits[0].softmax(0).double()).abs().max() < 0.03
    # top_p 0.7: {0: 0.64, 1: 0.24} reach 0.7 first; only those two may be drawn.
    kept = sample(logits, ones, torch.full((n,), 0.7), seeds, torch.arange(n))
    assert set(kept.tolist()) == {0, 1}


def test_pipelined_steps_run_one_ahead_and_give_the_same_tokens() -> None:
    prompts, params = mixed_workload(seed=3, n=10)
    plain = make_engine(async_scheduling=False)
    base = tokens(plain.generate(prompts, params))
    eng = make_engine()
    assert eng.config.async_scheduling
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    rid = eng.add_request({"prompt_token_ids": [5, 6, 7]}, sp)
    assert eng.step() == [] and eng._inflight is not None  # launched, not read back yet
    seen = []
    while eng.has_unfinished():
        seen += [o for o in eng.step() if o.request_id == rid]
    assert eng._inflight is None and seen[-1].finished and len(seen[-1].token_ids) == 5
    assert eng.num_steps == 5  # a request whose last draw is in flight is not run again
    assert tokens(eng.generate(prompts, params)) == base
    eng.check_idle()
