"""Decode-graph buckets: table widths from the context ladder, the bucket a step takes, and the
graph set's bookkeeping (largest first, one pool, a memory bound checked at capture). CUDA graphs
do not exist on CPU: a stand-in factory records what would be captured."""

import pytest

from spaceserve.models import DecodeGraphSet, GraphMemoryError
from spaceserve.models.step.graph_buckets import decode_need, pick_bucket, table_widths


def test_width_ladder_and_named_context_lens():
    assert table_widths(2048, 16) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert table_widths(10, 16) == (10,)  # a context shorter than the ladder's first rung
    assert table_widths(2048, 16, (1000, 4096, 4000)) == (63, 250, 256)
    assert table_widths(64, 16, (1 << 20,)) == (64,)  # capped at the widest table
    for bad in ((), (0,), (16, "32"), (True,)):
        with pytest.raises(ValueError, match="graph_context_lens"):
            table_widths(64, 16, bad)


def test_pick_bucket_takes_the_smallest_that_holds_the_step():
    sizes, widths = (1, 4, 8), (16, 32, 64)
    assert decode_need([21, 301], 16) == 19
    assert pick_bucket(sizes, widths, 2, 19) == (4, 32)
    assert pick_bucket(sizes, widths, 8, 16) == (8, 16)
    assert pick_bucket(sizes, widths, 9, 1) is None
    assert pick_bucket(sizes, widths, 1, 65) is None


class FakeModel:
    device = type("D", (), {"type": "cpu"})()


def factory(log, sizes=None):
    class FakeGraph:
        def __init__(self, model, kv, batch_size, width, *, num_sms, planner, pool, out):
            self.batch_size, self.max_blocks_per_seq, self.num_sms = batch_size, width, num_sms
            self.memory_bytes = (sizes or {}).get((batch_size, width), 0)
            log.append((batch_size, width, num_sms))
    return FakeGraph


def test_graph_set_captures_every_bucket_per_budget_largest_first():
    log = []
    gs = DecodeGraphSet(FakeModel(), None, (4, 1, 8), (32, 16), factory=factory(log))
    assert gs.capture(66) == (1, 4, 8)
    assert log == [(8, 32, 66), (8, 16, 66), (4, 32, 66), (4, 16, 66), (1, 32, 66),
                   (1, 16, 66)]
    gs.capture(66)  # nothing new
    gs.capture(None)
    assert len(gs) == 12 and len(log) == 12
    g = gs.pick(3, 17, 66)
    assert (g.batch_size, g.max_blocks_per_seq, g.num_sms) == (4, 32, 66)
    # each captured bucket's table is as wide as its width, never the widest the engine takes
    assert {(b, w) for b, w, _ in gs} == {(b, w) for b in (1, 4, 8) for w in (16, 32)}
    assert all(gs.graphs[k].max_blocks_per_seq == k[1] for k in gs)
    assert gs.pick(3, 33, 66) is None and gs.pick(3, 1, 40) is None


def test_graph_memory_bound_is_checked_at_capture():
    log = []
    sizes = {(8, 16): 300, (4, 16): 50, (1, 16): 10}
    gs = DecodeGraphSet(FakeModel(), None, (1, 4, 8), (16,), max_bytes=650,
                        factory=factory(log, sizes))
    gs.capture(None)
    assert gs.bytes == 360
    with pytest.raises(GraphMemoryError, match="graph_reserve_bytes=650"):
        gs.capture(66)  # the second budget's largest graph passes the bound
    assert len(gs) == 0 and gs.bytes == 0 and gs.pick(1, 1, None) is None
    assert log[-1] == (8, 16, 66)
