"""Qwen3-VL at tensor_parallel_size 2: greedy tokens equal transformers' (text, images, a
timestamped video), with the data-parallel encoder shipping each item's rows - embeddings and
DeepStack features - from the rank that encoded it to every rank."""

from __future__ import annotations

import pytest

from spaceserve import Engine, SamplingParams
from tests.models import qwen3_ref as ref

GREEDY = SamplingParams(max_tokens=ref.STEPS, temperature=0.0, ignore_eos=True)
FAST = dict(device="cpu", attention_backend="torch", block_size=4, num_kv_blocks=64,
            encoder_window_s=1e-9, encoder_launch_budget_s=0.0)

pytestmark = pytest.mark.usefixtures("one_thread")  # the workers take the same thread count


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path, hf = ref.build(tmp_path_factory.mktemp("qwen3vl_tp"), tied=True)
    prompts = ref.prompts(hf.config)
    return path, prompts, [ref.hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("mode, extra", [
    ("temporal", {}),  # data-parallel encoder: each item's rows broadcast by its owner
    ("spatial", dict(max_num_batched_tokens=8)),  # chunked prefill through the media rows
    # every rank encodes every item in layer chunks (its own rows, taps included)
    ("temporal-chunked", dict(mm_encoder_tp_mode="replicate")),
])
def test_tp2_greedy_equals_transformers(case, mode, extra):
    path, prompts, expected = case
    eng = Engine.from_pretrained(str(path), tensor_parallel_size=2, mode=mode,
                                 **{**FAST, **extra})
    try:
        outs = eng.generate(prompts, GREEDY)
        assert [o.error for o in outs] == [None] * len(outs)
        assert [o.token_ids for o in outs] == expected
        lm = eng.runner.model.language
        assert lm.num_kv_heads == lm.total_kv_heads // 2 and lm.embed_width == 3 * lm.hidden
        if mode != "temporal-chunked":  # data-parallel: each item on one rank, both used
            assert eng.runner.assigned[0] > 0 and eng.runner.assigned[1] > 0
        assert eng.runner.num_shipped == 0  # every row reached the workers by broadcast
        eng.check_idle()
    finally:
        eng.close()
    assert eng.runner.group.alive() == [], "a worker outlived its engine"
