"""The co-located modes with the null model: outputs equal the one-request reference in every mode
and driver, TWSRFT order (a small image behind a huge one), decode progressing while encoder
jobs pend, event-gated hand-off, embeddings freed exactly at the end, aborts of in-flight
compute prefills, splits moved by SIS, and configuration errors."""

import logging
import weakref

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.core.request import Status
from spaceserve.runtime.engine.engine import MODES, EngineConfig
from spaceserve.runtime.inputs import process_prompt
from spaceserve.runtime.policy.sis import Split
from spaceserve.runtime.spatial import partition
from spaceserve.runtime.worker.null import NullModelRunner

IMG = 3  # the null model's image token id
CFG = dict(num_kv_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
CO_LOCATED = ("shared", "spatial-static", "spatial")


# a scheduling bug that stops the engine from making progress fails the test, never hangs it
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]


class FixedClock:
    """A clock that moves only when told (TWSRFT aging and SIS dwell never trigger by accident)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def engine(mode: str, runner: NullModelRunner | None = None, clock=None, **cfg) -> Engine:
    return Engine(runner or NullModelRunner(), EngineConfig(mode=mode, **(CFG | cfg)),
                  clock=clock)


def image_prompt(gen: torch.Generator, n_text: int, grid=(1, 4, 4)) -> dict:
    t, h, w = grid
    ids = torch.randint(4, 97, (n_text,), generator=gen).tolist() + [IMG] * (t * h * w // 4)
    return {"prompt_token_ids": ids + [1], "pixel_values": torch.randn(t * h * w, 8,
                                                                       generator=gen),
            "image_grid_thw": torch.tensor([grid])}


def text_prompt(gen: torch.Generator, n: int) -> dict:
    return {"prompt_token_ids": torch.randint(4, 97, (n,), generator=gen).tolist()}


def workload(seed: int = 0, n: int = 10):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(n):
        k = int(torch.randint(1, 30, (), generator=gen))
        grid = (1, 4, 4) if i % 2 else (1, 8, 4)
        prompts.append(image_prompt(gen, k, grid) if i % 3 != 1 else text_prompt(gen, k))
        params.append(SamplingParams(max_tokens=int(torch.randint(1, 10, (), generator=gen)),
                                     temperature=0.0 if i % 2 else 0.8, seed=100 + i,
                                     ignore_eos=i % 4 == 3))
    return prompts, params


def reference(eng: Engine, prompt: dict, params: SamplingParams) -> tuple[list[int], str]:
    ids, mm = process_prompt(prompt, eng.runner.info, context_len=10**6, capacity=10**6,
                             max_images=99)
    return eng.runner.reference_generate(ids, mm, params, params.seed or 0, eng.max_model_len)


def check_outputs(eng: Engine, prompts, params, outs) -> None:
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        assert out.error is None, out.error
        assert (out.token_ids, out.finish_reason) == reference(eng, prompt, sp)


@pytest.mark.parametrize("driver", ["cooperative", "thread"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_the_reference(mode, driver) -> None:
    eng = engine(mode, encoder_driver=driver, encoder_window_s=1e-4)
    try:
        prompts, params = workload()
        check_outputs(eng, prompts, params, eng.generate(prompts, params))
        eng.check_idle()
        if mode in CO_LOCATED:
            assert eng.encoder.num_grants > 0
    finally:
        eng.close()


def test_preemption_and_compute_prefill_keep_the_tokens() -> None:
    eng = engine("spatial-static", num_kv_blocks=18, max_num_batched_tokens=8,
                 prefill_on="compute")
    prompts, params = workload(seed=3, n=8)
    outs = eng.generate(prompts, params)
    check_outputs(eng, prompts, params, outs)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption happened"
    assert eng.spatial.num_compute_prefills > 0
    eng.check_idle()


def test_small_image_behind_a_huge_one_is_encoded_first() -> None:
    runner = NullModelRunner(encoder_layers=32, max_model_len=1024)
    eng = engine("spatial-static", runner, clock=FixedClock(), num_kv_blocks=160,
                 max_num_batched_tokens=512, encoder_window_s=1e-9,  # one layer per grant
                 encoder_launch_budget_s=0.0)  # one layer per step
    gen = torch.Generator().manual_seed(1)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    huge = eng.add_request(image_prompt(gen, 3, (1, 32, 32)), once)
    eng.step()  # the huge image starts alone
    small = eng.add_request(image_prompt(gen, 3, (1, 4, 4)), once)
    done = []
    while eng.has_unfinished():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == [small, huge]
    assert eng.encoder.num_grants == 64 and runner.num_encoder_layers_run == 64


def test_decode_steps_continue_while_encoder_jobs_pend() -> None:
    runner = NullModelRunner(encoder_layers=16, max_model_len=1024)
    eng = engine("spatial", runner, clock=FixedClock(), num_kv_blocks=160,
                 max_num_batched_tokens=512, encoder_launch_budget_s=0.0)  # a layer per step
    gen = torch.Generator().manual_seed(2)
    text = eng.add_request(text_prompt(gen, 5), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.add_request(image_prompt(gen, 3, (1, 32, 32)), SamplingParams(max_tokens=2))
    overlapped = 0
    while eng.has_unfinished():
        req = eng._active.get(text)
        before = len(req.token_ids) if req is not None else None
        pending = eng.encoder.num_pending
        eng.step()
        if req is not None and pending and len(req.token_ids) > before:
            overlapped += 1
    assert overlapped >= 15  # a decode token in every step of the 16-layer image
    eng.check_idle()


class ManualEvent:
    """A completion event under the test's control; it has no synchronize (nobody may wait)."""

    def __init__(self, done: list[bool]) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done[0]


def test_prefill_is_admitted_only_once_the_embeddings_event_completes() -> None:
    eng = engine("spatial-static", prefill_on="decode")  # compute prefills use the events too
    flag = [False]
    eng.encoder.event_factory = lambda: ManualEvent(flag)
    gen = torch.Generator().manual_seed(4)
    text = eng.add_request(text_prompt(gen, 4), SamplingParams(max_tokens=30, ignore_eos=True))
    img = eng.add_request(image_prompt(gen, 4), SamplingParams(max_tokens=3))
    for _ in range(6):
        eng.step()
    req_img, req_text = eng._active[img], eng._active[text]
    assert req_img.status is Status.WAITING and req_img.mm.embeds is None
    assert len(req_text.token_ids) > 4 + 4, "decode waited for the encoder"
    assert eng.encoder.num_grants == 1 and eng.encoder.incomplete() == 1
    flag[0] = True
    eng.step()
    assert req_img.mm.embeds is not None and req_img.status is Status.RUNNING
    eng.abort(text)
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_embeddings_are_freed_exactly_when_the_request_ends(cache_bytes: int) -> None:
    """Without an encoder cache the embeddings die with the request; with one they stay
    cached but unpinned (evictable)."""
    eng = engine("spatial-static", prefill_on="decode", encoder_cache_bytes=cache_bytes)
    gen = torch.Generator().manual_seed(5)
    finished = []
    rid = eng.add_request(image_prompt(gen, 3), SamplingParams(max_tokens=6, ignore_eos=True),
                          sink=lambda o: finished.append(o.finished))
    ref = entry = None
    while not any(finished):
        if ref is not None:
            assert ref() is not None and eng.encoder.num_held == 1 and entry.refs == 1
        eng.step()
        req = eng._active.get(rid)
        if ref is None and req is not None and req.mm.embeds is not None:
            entry = req.mm.items[0]
            ref = weakref.ref(entry.tensor)
    assert ref is not None and eng.encoder.num_held == 0 and entry.refs == 0
    assert (ref() is None) == (cache_bytes == 0) and entry.cached == bool(cache_bytes)
    eng.encoder_cache.clear()
    assert ref() is None
    # an abort frees them too
    rid = eng.add_request(image_prompt(gen, 3), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    entry = eng._active[rid].mm.items[0]
    ref = weakref.ref(entry.tensor)
    eng.abort(rid)
    eng.step()
    assert entry.refs == 0 and eng.encoder.num_held == 0
    eng.encoder_cache.clear()
    del entry
    assert ref() is None
    eng.check_idle()


def test_abort_of_an_in_flight_compute_prefill_waits_for_it() -> None:
    eng = engine("spatial-static", prefill_on="compute")
    gen = torch.Generator().manual_seed(6)
    outs = []
    rid = eng.add_request(text_prompt(gen, 9), SamplingParams(max_tokens=8),
                          sink=outs.append)
    eng.step()
    assert eng.spatial.num_inflight == 1 and eng.spatial.defer_abort(eng._active[rid])
    eng.abort(rid)
    eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    eng.check_idle()


def test_a_bad_image_fails_alone() -> None:
    eng = engine("spatial")
    gen = torch.Generator().manual_seed(7)
    bad = image_prompt(gen, 3)
    bad["pixel_values"][0, 0] = float("nan")
    good = image_prompt(gen, 5)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = eng.generate([bad, good], params)
    assert outs[0].finish_reason == "error" and "non-finite" in outs[0].error
    assert (outs[1].token_ids, outs[1].finish_reason) == reference(eng, good, params)
    eng.check_idle()


def test_sis_moving_splits_changes_no_token() -> None:
    eng = engine("spatial", encoder_splits=(16, 64, 120))
    total = eng.spatial.partitions.total
    plan = [(0, "compute"), (16, "compute"), (120, "decode"), (64, "compute"), (16, "decode")]
    calls = iter(range(10**6))

    def decide(state):
        e, where = plan[next(calls) % len(plan)]
        return Split(e, total - e, where, 0.0, 0.0, 1.0, True)

    eng.spatial.sis.decide = decide
    prompts, params = workload(seed=8, n=12)
    check_outputs(eng, prompts, params, eng.generate(prompts, params))
    seen = {e for _, e in eng.spatial.switches}
    assert seen == {0, 16, 64, 120} and len(eng.spatial.switches) > 8
    eng.check_idle()


def test_fallback_logged_once_and_engines_still_work(caplog) -> None:
    saved = set(partition._LOGGED)
    partition._LOGGED.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="spaceserve.runtime"):
            engines = [engine("spatial"), engine("spatial-static", encoder_sms=40)]
        lines = [r for r in caplog.records if "green contexts unavailable" in r.getMessage()]
        assert len(lines) == 1
    finally:
        partition._LOGGED.update(saved)
    assert engines[1].spatial.sm_split() == (40, engines[1].spatial.partitions.total - 40)
    gen = torch.Generator().manual_seed(9)
    prompts = [image_prompt(gen, 4), text_prompt(gen, 6)]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    for eng in engines:
        check_outputs(eng, prompts, [params] * 2, eng.generate(prompts, params))


@pytest.mark.parametrize("cfg, name", [
    (dict(mode="bogus"), "mode"), (dict(prefill_on="gpu"), "prefill_on"),
    (dict(encoder_driver="async"), "encoder_driver"), (dict(encoder_sms=0), "encoder_sms"),
    (dict(encoder_splits=()), "encoder_splits"), (dict(programs_per_sm=0), "programs_per_sm"),
    (dict(curves=3), "curves"), (dict(encoder_window_s=0.0), "encoder_window_s"),
    (dict(encoder_launch_budget_s=-1.0), "encoder_launch_budget_s"),
])
def test_bad_settings_raise_naming_them(cfg, name) -> None:
    with pytest.raises(ValueError, match=name) as err:
        EngineConfig(**cfg)
    if name == "mode":
        assert all(m in str(err.value) for m in MODES)


def test_bad_split_or_curves_file_raise(tmp_path) -> None:
    with pytest.raises(ValueError, match="encoder_sms"):
        engine("spatial-static", encoder_sms=10**4)
    with pytest.raises(ValueError, match="encoder_splits"):
        engine("spatial", encoder_splits=(8, 10**4))
    bad = tmp_path / "curves.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="curves"):
        engine("spatial", curves=str(bad))


def test_compute_prefills_in_flight_are_capped() -> None:
    eng = engine("spatial-static", prefill_on="compute")
    flag = [False]
    eng.encoder.event_factory = lambda: ManualEvent(flag)  # compute prefills never finish yet
    gen = torch.Generator().manual_seed(10)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [text_prompt(gen, 5 + i) for i in range(4)]
    rids = []
    for p in prompts:
        rids.append(eng.add_request(p, params))
        eng.step()
    assert eng.spatial.num_inflight == 2 == eng.spatial.num_compute_prefills
    assert len(eng._active[rids[3]].token_ids) > 5 + 3  # prefilled beside decode instead
    flag[0] = True
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, p in zip(rids, prompts, strict=True):
        assert (outs[rid].token_ids, outs[rid].finish_reason) == reference(eng, p, params)
    eng.check_idle()
