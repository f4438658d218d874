"""Engine.pause / Engine.resume: a paused request holds no KV blocks and is not scheduled;
resumed, it finishes with exactly the tokens of an uninterrupted run (draws depend only on
seed and position, so recomputation reproduces them)."""

import pytest

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.core.request import Status
from spaceserve.runtime.engine.engine import EngineConfig
from spaceserve.runtime.worker.null import NullModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
PROMPTS = {"a": list(range(4, 17)), "b": list(range(20, 29))}


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, n=n)


def run(pause_at: int | None, *, async_scheduling: bool = True, n: int = 1,
        mode: str = "temporal") -> tuple[dict[str, list[list[int]]], Engine, dict[str, int]]:
    eng = Engine(NullModelRunner(), EngineConfig(**CFG, async_scheduling=async_scheduling,
                                                 mode=mode))
    outs: dict[str, list] = {k: [] for k in PROMPTS}
    for k, ids in PROMPTS.items():
        eng.add_request({"prompt_token_ids": ids}, params(n), request_id=k,
                        sink=lambda o, k=k: outs[k].append(o) if o.finished else None)
    seen: dict[str, int] = {}
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == pause_at:
            assert eng.pause("a")
        if pause_at is not None and steps == pause_at + 6:
            seqs = [r for r in eng.scheduler.waiting if r.request_id == "a"]
            seen["a_blocks"] = sum(len(r.block_ids) for r in seqs)
            seen["a_running"] = sum(r.request_id == "a" for r in eng.scheduler.running)
            seen["a_waiting"] = len(seqs)
            seen["b_done"] = len(outs["b"])
            seen["active"] = eng.num_active
            seen["has_unfinished"] = eng.has_unfinished()
            assert eng.resume("a")
        assert steps < 500
    return ({k: [list(o.token_ids) for o in sorted(v, key=lambda o: o.index)]
             for k, v in outs.items()}, eng, seen)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_paused_request_frees_blocks_and_resumes_identically(async_scheduling: bool, n: int):
    plain, _, _ = run(None, async_scheduling=async_scheduling, n=n)
    paused, eng, seen = run(4, async_scheduling=async_scheduling, n=n)
    assert paused == plain and all(len(t) == 24 for v in plain.values() for t in v)
    assert seen["a_blocks"] == 0 and seen["a_running"] == 0 and seen["a_waiting"] == n
    assert seen["active"] == 2
    eng.check_idle()


@pytest.mark.parametrize("mode", ["spatial-static", "spatial"])
def test_pause_in_the_colocated_modes(mode: str):
    plain, _, _ = run(None, mode=mode)
    paused, eng, seen = run(4, mode=mode)
    assert paused == plain and seen["a_blocks"] == 0 and seen["a_running"] == 0
    eng.check_idle()


def test_paused_request_alone_gives_no_work_and_abort_ends_it():
    eng = Engine(NullModelRunner(), EngineConfig(**CFG))
    got = []
    eng.add_request({"prompt_token_ids": PROMPTS["a"]}, params(), request_id="a",
                    sink=got.append)
    for _ in range(3):
        eng.step()
    assert eng.pause("a") and not eng.pause("zzz") and not eng.resume("zzz")
    eng.step()
    eng.step()  # the step in flight is read back
    assert not eng.has_unfinished() and eng.num_active == 1 and eng.num_paused == 1
    req = eng.scheduler.waiting[0]
    assert req.status is Status.WAITING and not req.block_ids
    assert eng.abort("a")
    while eng.has_unfinished():
        eng.step()
    assert got[-1].finished and got[-1].finish_reason == "abort" and eng.num_paused == 0
    eng.check_idle()
