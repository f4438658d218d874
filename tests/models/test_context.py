"""The host-side step planner: flattened-batch layout, positions, padding, invalid input."""

import pytest
import torch

from spaceserve.models import plan_step, text_positions


def test_mixed_batch_layout():
    bs = 4
    tables = [[7, 2], [5, 0, 3], [1, 6, 4], [9]]
    mpos = torch.stack([torch.arange(10), torch.arange(10) * 2, torch.arange(10) * 3])
    ctx = plan_step([7, 9, 0, 2], [1, 1, 5, 2], tables, block_size=bs,
                    mrope_positions=[None, None, mpos, None], rope_deltas=[0, -3, 0, 4],
                    need_logits=[True, True, False, True])
    assert ctx.num_seqs == ctx.num_real_seqs == 4 and ctx.num_tokens == 9
    assert ctx.num_decode_seqs == 2 and not ctx.is_decode_only
    assert ctx.cu_seqlens_q.tolist() == [0, 1, 2, 7, 9]
    assert ctx.cu_seqlens_q.dtype == ctx.seq_lens.dtype == ctx.block_tables.dtype == torch.int32
    assert ctx.seq_lens.tolist() == [8, 10, 5, 4]
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (5, 10)
    # slot = block_table[p // bs] * bs + p % bs for each new token's cache index p
    want = [2 * 4 + 3, 3 * 4 + 1] + [1 * 4 + p for p in range(4)] + [6 * 4 + 0] + [9 * 4 + 2,
                                                                                   9 * 4 + 3]
    assert ctx.slot_mapping.tolist() == want
    assert ctx.block_tables.tolist() == [[7, 2, 0], [5, 0, 3], [1, 6, 4], [9, 0, 0]]
    # rows: seq 0 text at 7; seq 1 at 9 - 3; seq 2 takes prompt columns 0..4; seq 3 at 2..3 + 4
    assert torch.equal(ctx.positions[:, 0], text_positions(7, 1)[:, 0])
    assert torch.equal(ctx.positions[:, 1], text_positions(9, 1, -3)[:, 0])
    assert torch.equal(ctx.positions[:, 2:7], mpos[:, :5])
    assert torch.equal(ctx.positions[:, 7:], text_positions(2, 2, 4))
    assert ctx.logits_indices.tolist() == [0, 1, 8]  # seq 2's chunk does not end its prompt
    assert ctx.host.logits_seqs == [0, 1, 3]


def test_prompt_positions_run_into_decode_delta():
    """A chunk that covers the prompt's end and goes past it continues at index + delta."""
    mpos = torch.tensor([[0, 1, 2, 2], [0, 1, 2, 3], [0, 1, 3, 2]])
    ctx = plan_step([2], [4], [[0, 1]], block_size=4, mrope_positions=[mpos], rope_deltas=[-1])
    assert ctx.positions.tolist() == [[2, 2, 3, 4], [2, 3, 3, 4], [3, 2, 3, 4]]


def test_padding_for_graphs():
    ctx = plan_step([3, 8], [1, 1], [[4], [2, 5, 1]], block_size=4, pad_seqs_to=5,
                    max_blocks_per_seq=6)
    assert ctx.num_seqs == 5 and ctx.num_real_seqs == 2 and ctx.is_decode_only
    assert ctx.block_tables.shape == (5, 6)
    assert ctx.seq_lens.tolist() == [4, 9, 0, 0, 0]
    assert ctx.slot_mapping.tolist() == [4 * 4 + 3, 1 * 4 + 0, -1, -1, -1]
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3, 4]
    empty = plan_step([], [], [], block_size=4, pad_seqs_to=3, max_blocks_per_seq=2)
    assert empty.num_real_seqs == 0 and empty.seq_lens.tolist() == [0, 0, 0]
    assert empty.slot_mapping.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("args, kwargs, match", [
    (([0], [5], [[1]]), {}, "block_tables"),  # 5 tokens need 2 blocks of 4
    (([0], [0], [[1]]), {}, "num_new_tokens"),
    (([-1], [1], [[1]]), {}, "num_cached_tokens"),
    (([0, 0], [1], [[1], [2]]), {}, "num_new_tokens"),
    (([], [], []), {}, "num_cached_tokens"),
    (([0], [1], [[-2]]), {}, "block_tables"),
    (([0, 0], [1, 1], [[1], [2]]), {"pad_seqs_to": 1}, "pad_seqs_to"),
    (([0], [2], [[1]]), {"pad_seqs_to": 2}, "pad_seqs_to"),
    (([0], [9], [[1, 2, 3]]), {"max_blocks_per_seq": 2}, "max_blocks_per_seq"),
    (([0], [1], [[1]]), {"need_logits": [True, False]}, "need_logits"),
    (([0], [1], [[1]]), {"mrope_positions": [torch.zeros(2, 4, dtype=torch.long)]},
     "mrope_positions"),
])
def test_invalid_plans_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_step(*args, block_size=4, **kwargs)
