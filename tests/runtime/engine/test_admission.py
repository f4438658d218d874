"""The engine's SLO-aware admission on the null model: a request that cannot meet its TTFT
bound is refused before anything is queued; one that became hopeless while waiting is ended
with no token drawn, its final output carrying the server's 503 and Retry-After; nothing
leaks. Costs are pinned (0.6 s of encoder work per image) so the verdicts do not depend on
the machine."""

import time

import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.policy.admission import Refused
from spaceserve.runtime.worker.null import NullModelRunner

CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
           slo="ttft:1000,tpot:50")
IMG = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(admission: str = "slo") -> Engine:
    eng = Engine(NullModelRunner(), EngineConfig(admission=admission, **CFG))
    adm = eng.admission
    if adm.active:
        adm.enc_s = lambda patches, layers: 0.6 if patches else 0.0
        adm.pre_s = lambda tokens: 0.0
        adm.policy.calibrate = False
    return eng


def image_prompt(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 97, (5,), generator=gen).tolist() + [IMG] * 4 + [1]
    return {"prompt_token_ids": ids, "pixel_values": torch.randn(16, 8, generator=gen),
            "image_grid_thw": torch.tensor([[1, 4, 4]])}


def run_all(eng: Engine) -> None:
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
    eng.check_idle()


def test_a_request_that_cannot_meet_its_bound_is_refused_at_once() -> None:
    eng = make_engine()
    first = eng.add_request(image_prompt(0), SamplingParams(max_tokens=3))
    t0 = time.perf_counter()
    with pytest.raises(Refused) as info:  # 0.6 s ahead + its own 0.6 s > 1 s
        eng.add_request(image_prompt(1), SamplingParams(max_tokens=3), request_id="late")
    assert time.perf_counter() - t0 < 0.1
    exc = info.value
    assert exc.predicted_s == pytest.approx(1.2) and exc.bound_s == pytest.approx(1.0)
    assert exc.retry_after_s == pytest.approx(0.2) and "retry after 1 s" in str(exc)
    assert "late" not in eng._active and eng.admission.counts["admission_refused"] == 1
    text = eng.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    outs = {o.request_id: o for _ in range(50) for o in eng.step() if o.finished}
    assert outs[first].finish_reason == "length" and outs[text].finish_reason == "length"
    run_all(eng)
    assert not eng.admission.waiting


def test_queue_admits_everything() -> None:
    eng = make_engine("queue")
    for i in range(4):
        eng.add_request(image_prompt(i), SamplingParams(max_tokens=2))
    run_all(eng)
    assert eng.admission.counts == {"admission_refused": 0, "admission_ended": 0}


def test_a_hopeless_waiting_request_is_ended_with_a_503_and_nothing_leaks() -> None:
    eng = make_engine()
    seen = []
    rid = eng.add_request(image_prompt(0), SamplingParams(max_tokens=4), sink=seen.append)
    eng._drain(time.monotonic())  # what a step does before it checks admission
    # an injected clock: 0.5 s later, 0.5 s waited + 0.6 s of encoder work left > 1 s
    eng.admission.check(time.monotonic() + 0.5)
    assert eng.admission.counts["admission_ended"] == 1
    run_all(eng)
    final = [o for o in seen if o.finished]
    assert len(final) == 1 and final[0].request_id == rid
    out = final[0]
    assert out.finish_reason == "error" and not out.token_ids
    assert out.extra == {"status": 503, "retry_after": 1}
    assert "can no longer meet its TTFT bound" in out.error
    assert not eng.admission.ended and not eng.admission.waiting


def test_a_request_on_time_is_not_ended() -> None:
    eng = make_engine()
    rid = eng.add_request(image_prompt(0), SamplingParams(max_tokens=4))
    eng._drain(time.monotonic())
    eng.admission.check(time.monotonic() + 0.3)  # 0.3 + 0.6 <= 1 s
    outs = [o for _ in range(50) for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "length"
    run_all(eng)
