"""Parallel sampling (``n`` > 1) is refused for now: the engine raises a ValueError naming `n`
before anything is queued, the API answers 400 (tests/server/test_caching.py), and an engine
that refused one keeps serving the next request with nothing held."""

import pytest

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.engine import EngineConfig
from spaceserve.runtime.runner import NullModelRunner

CFG = dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["temporal", "spatial"])
def test_n_above_one_is_refused_and_nothing_is_held(mode: str) -> None:
    engine = Engine(NullModelRunner(), EngineConfig(mode=mode, **CFG))
    try:
        for n in (2, 3):
            with pytest.raises(ValueError, match=rf"n={n}: parallel sampling \(n > 1\) is not "
                                                 "supported"):
                engine.add_request({"prompt_token_ids": [5, 6, 7]},
                                   SamplingParams(n=n, max_tokens=4, seed=1))
        assert not engine.has_unfinished()
        outs = engine.generate([{"prompt_token_ids": [5, 6, 7]}],
                               SamplingParams(n=1, max_tokens=3, ignore_eos=True, seed=1))
        assert len(outs) == 1 and outs[0].index == 0 and len(outs[0].token_ids) == 3
        engine.check_idle()
    finally:
        engine.close()


def test_n_is_validated() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^n"):
            SamplingParams(n=bad)
    assert SamplingParams().n == 1
