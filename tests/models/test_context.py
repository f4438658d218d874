"""The host-side step planner: flattened-batch layout, positions, padding, invalid input, the
preallocated planner against a per-token reference, shared buffers, attention plans reused."""

import numpy as np
import pytest
import torch

from spaceserve.models import plan_step, text_positions
from spaceserve.models.step.context import ContextPlanner


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
    assert ctx.host.logits_seqs.tolist() == [0, 1, 3]


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


# The preallocated planner: a per-token reference, buffer sharing, attention plans in place.

BS, ROWS, WIDTH = 4, 8, 10


def reference(cached, new, tables, *, mpos=None, deltas=None, need=None, pad=0, ids=None):
    """Step metadata computed token by token from the layout's definition."""
    b = len(cached)
    mpos, deltas = mpos or [None] * b, deltas or [0] * b
    need = [True] * b if need is None else need
    pos, slots, cu, lidx, lseq = [[], [], []], [], [0], [], []
    for i in range(b):
        for p in range(cached[i], cached[i] + new[i]):
            m = mpos[i]
            col = m[:, p].tolist() if m is not None and p < m.shape[1] else [p + deltas[i]] * 3
            for r in range(3):
                pos[r].append(col[r])
            slots.append(tables[i][p // BS] * BS + p % BS)
        cu.append(cu[-1] + new[i])
        if need[i]:
            lidx.append(cu[-1] - 1)
            lseq.append(i)
    for j in range(pad):
        for r in range(3):
            pos[r].append(0)
        slots.append(-1)
        cu.append(cu[-1] + 1)
        lidx.append(cu[-1] - 1)
        lseq.append(b + j)
    news = list(new) + [1] * pad
    lens = [c + n for c, n in zip(cached, new, strict=True)] + [0] * pad
    nd = next((i for i, n in enumerate(news) if n != 1), len(news))
    return dict(positions=pos, slot_mapping=slots, cu_seqlens_q=cu, seq_lens=lens,
                logits_indices=lidx, logits_seqs=lseq, num_decode_seqs=nd,
                max_seqlen_q=max(news), max_seqlen_k=max(lens),
                input_ids=None if ids is None else list(ids) + [0] * pad)


def check(ctx, want, tables):
    for name in ("positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "logits_indices",
                 "logits_seqs", "input_ids"):
        got = getattr(ctx, name)
        assert (None if got is None else got.tolist()) == want[name], name
    for name in ("num_decode_seqs", "max_seqlen_q", "max_seqlen_k"):
        assert getattr(ctx, name) == want[name], name
    h = ctx.host
    assert h.positions.tolist() == want["positions"]
    assert h.slot_mapping.tolist() == want["slot_mapping"]
    assert h.cu_seqlens_q.tolist() == want["cu_seqlens_q"]
    assert h.seq_lens.tolist() == want["seq_lens"] and h.logits_seqs.tolist() == want["logits_seqs"]
    assert torch.equal(torch.from_numpy(h.block_tables.copy()), ctx.block_tables)
    bt = ctx.block_tables.tolist()
    for i, t in enumerate(tables):
        need = -(-want["seq_lens"][i] // BS)
        assert bt[i][:need] == list(t[:need]), i
    assert min(min(r) for r in bt) >= 0  # unused columns still name valid blocks


def random_steps(seed, steps=10):
    """Steps over persistent rows: rows change owners (new tables, rope state) between steps."""
    rng = np.random.default_rng(seed)
    owner = {}
    for _ in range(steps):
        b = int(rng.integers(1, 7))
        rows = rng.choice(ROWS, b, replace=False).tolist()
        fresh = {}
        for r in rows:
            if r not in owner or rng.random() < 0.3:
                length = int(rng.integers(0, 30))
                m = torch.from_numpy(rng.integers(0, 50, (3, length)))
                m = m if rng.random() < 0.5 else None
                owner[r] = fresh[r] = (rng.permutation(100)[:WIDTH].tolist(), m,
                                       int(rng.integers(-5, 6)))
        decode_only = rng.random() < 0.4
        new = [1 if decode_only or rng.random() < 0.5 else int(rng.integers(2, 8)) for _ in rows]
        cached = [int(rng.integers(0, WIDTH * BS - n + 1)) for n in new]
        need = None if decode_only else (rng.random(b) < 0.7).tolist()
        pad = int(rng.integers(0, ROWS - b + 1)) if decode_only else 0
        ids = rng.integers(0, 1000, sum(new)).tolist()
        yield rows, fresh, cached, new, need, pad, ids, owner


@pytest.mark.parametrize("staged", [False, True])
def test_planner_matches_reference_and_plan_step(staged):
    planner = ContextPlanner(ROWS, 48, WIDTH, BS, staged=staged)
    for rows, fresh, cached, new, need, pad, ids, owner in random_steps(staged):
        for r, (table, m, d) in fresh.items():
            planner.set_row(r, table, rope_delta=d, mrope_positions=m)
        tables = [owner[r][0] for r in rows]
        mpos, deltas = [owner[r][1] for r in rows], [owner[r][2] for r in rows]
        want = reference(cached, new, tables, mpos=mpos, deltas=deltas, need=need, pad=pad,
                         ids=ids)
        graph = pad > 0  # a graph's layout: padded, full width, only needed columns refreshed
        ctx = planner.plan(rows, cached, new, need_logits=need, input_ids=ids,
                           pad_seqs_to=len(rows) + pad if graph else None,
                           width=WIDTH if graph else None)
        check(ctx, want, tables)
        once = plan_step(cached, new, tables, block_size=BS, mrope_positions=mpos,
                         rope_deltas=deltas, need_logits=need, input_ids=ids,
                         pad_seqs_to=len(rows) + pad if graph else None)
        check(once, want, tables)
        assert once.block_tables[:len(rows)].tolist() == tables  # all columns given


def test_same_shaped_steps_share_buffers():
    """What DecodeGraph relies on: a step planned with a captured context's shape lands in the
    captured tensors, whatever was planned in between."""
    planner = ContextPlanner(ROWS, 48, WIDTH, BS, staged=True)
    capture = planner.plan([], [], [], pad_seqs_to=4, width=WIDTH)
    assert capture.input_ids.tolist() == [0] * 4 and capture.seq_lens.tolist() == [0] * 4
    tables = [list(range(10 * r, 10 * r + WIDTH)) for r in range(3)]
    for r, t in enumerate(tables):
        planner.set_row(r, t, rope_delta=r)
    other = planner.plan([2, 0], [5, 3], [1, 9], input_ids=list(range(10)))
    assert not capture.shares_buffers(other)
    assert planner.is_current(other) and not planner.is_current(capture)
    for cached in ([3, 7, 12], [4, 8, 13]):
        ctx = planner.plan([0, 1, 2], cached, [1, 1, 1], input_ids=[7, 8, 9], pad_seqs_to=4,
                           width=WIDTH)
        assert capture.shares_buffers(ctx) and ctx.input_ids.data_ptr() == \
            capture.input_ids.data_ptr()
        want = reference(cached, [1] * 3, tables, deltas=[0, 1, 2], pad=1, ids=[7, 8, 9])
        check(ctx, want, tables)
        for name in ("positions", "slot_mapping", "seq_lens", "logits_indices", "input_ids"):
            assert getattr(capture, name).tolist() == want[name], name  # the captured tensors


def test_planners_sharing_rows_see_each_others_sequences():
    """Two stages' planners (own buffers, one row state): either plans any sequence."""
    a = ContextPlanner(ROWS, 48, WIDTH, BS, staged=True)
    b = ContextPlanner(ROWS, 48, WIDTH, BS, rows=a)
    tables = [list(range(10 * r, 10 * r + WIDTH)) for r in range(3)]
    mpos = torch.arange(18).view(3, 6)
    for r, t in enumerate(tables):
        (a if r % 2 else b).set_row(r, t, rope_delta=r, mrope_positions=mpos if r == 2 else None)
    want = reference([4, 9, 2], [3, 1, 5], tables, mpos=[None, None, mpos], deltas=[0, 1, 2])
    for planner in (a, b):
        check(planner.plan([0, 1, 2], [4, 9, 2], [3, 1, 5]), want, tables)
    x, y = a.plan([0], [1], [1]), b.plan([0], [1], [1])
    assert x.positions.data_ptr() != y.positions.data_ptr()
    with pytest.raises(ValueError, match="rows"):
        ContextPlanner(ROWS + 1, 48, WIDTH, BS, rows=a)


def test_triton_plans_refill_in_place_and_grow():
    from spaceserve.models import get_backend

    backend = get_backend("triton")
    backend.bind_lm(4, 2, 16)
    planner = ContextPlanner(ROWS, 64, 16, BS, backend=backend)
    tables = [list(range(16 * r, 16 * r + 16)) for r in range(ROWS)]
    for r, t in enumerate(tables):
        planner.set_row(r, t)
    steps = [([5, 9, 13], [1, 1, 1]), ([5, 9, 13, 20, 2], [1] * 5), ([6, 10, 14, 21], [1] * 4),
             ([6, 10, 0], [1, 1, 12]), ([7, 0, 3], [1, 20, 9]), ([8], [1])]
    objs = []
    for cached, new in steps:
        rows = list(range(len(cached)))
        ctx = planner.plan(rows, cached, new)
        fresh = plan_step(cached, new, [tables[r] for r in rows], block_size=BS, backend=backend)
        assert ctx.plan["num_decode"] == fresh.plan["num_decode"]
        for kind in ("decode", "prefill"):
            got, want = ctx.plan[kind], fresh.plan[kind]
            assert (got is None) == (want is None), kind
            if got is None:
                continue
            n = int(want.work.buffer[0])
            assert int(got.work.buffer[0]) == n
            assert torch.equal(got.work.buffer[1:1 + 3 * n], want.work.buffer[1:1 + 3 * n])
            assert bool((got.work.buffer[1 + 3 * n:] == -1).all())
        if ctx.plan["prefill"] is not None:
            assert torch.equal(ctx.plan["cu_rest"], fresh.plan["cu_rest"])
        objs.append((ctx.plan["decode_plan"], ctx.plan["prefill_plan"]))
    dec = [d for d, _ in objs]
    assert dec[1] is not dec[0] and dec[1].max_batch == 6  # grown to twice the old capacity
    assert dec[2] is dec[1] and dec[3] is dec[1] and dec[5] is dec[1]
    pre = [p for _, p in objs]
    assert pre[3] is not None and pre[4] is not pre[3] and pre[5] is pre[4]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rows=[9]), "rows"),
    (dict(rows=[0, 1], cached=[0]), "num_cached_tokens"),
    (dict(new=[70]), "max_num_tokens"),
    (dict(new=[0]), "num_new_tokens"),
    (dict(width=1, cached=[9]), "width"),
    (dict(input_ids=[1, 2]), "input_ids"),
    (dict(need_logits=[True, True]), "need_logits"),
    (dict(pad_seqs_to=9), "max_num_seqs"),
])
def test_planner_rejects_bad_steps(kwargs, match):
    planner = ContextPlanner(ROWS, 48, WIDTH, BS)
    planner.set_row(0, list(range(WIDTH)))
    args = dict(rows=[0], cached=[3], new=[1])
    args.update(kwargs)
    rows, cached, new = args.pop("rows"), args.pop("cached"), args.pop("new")
    with pytest.raises(ValueError, match=match):
        planner.plan(rows, cached, new, **args)


def test_planner_rejects_bad_rows_and_sizes():
    planner = ContextPlanner(ROWS, 48, WIDTH, BS)
    with pytest.raises(ValueError, match="row"):
        planner.set_row(ROWS, [1])
    with pytest.raises(ValueError, match="mrope_positions"):
        planner.set_row(0, mrope_positions=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        planner.set_row(0, list(range(WIDTH + 1)))
    with pytest.raises(ValueError, match="max_num_seqs"):
        ContextPlanner(0, 48, WIDTH, BS)


@pytest.mark.gpu
def test_pinned_staging_survives_back_to_back_plans():
    """Plans issued without a host sync between them: each step's device copy (cloned on the
    stream right after planning) holds that step's values, so no staging buffer was rewritten
    before its copy ran."""
    planner = ContextPlanner(ROWS, 48, WIDTH, BS, device="cuda")
    tables = [list(range(10 * r, 10 * r + WIDTH)) for r in range(ROWS)]
    for r, t in enumerate(tables):
        planner.set_row(r, t)
    snaps, wants = [], []
    for k in range(12):
        cached = [k + r for r in range(ROWS)]
        ctx = planner.plan(list(range(ROWS)), cached, [1] * ROWS, input_ids=[k] * ROWS)
        snaps.append({n: getattr(ctx, n).clone() for n in ("positions", "slot_mapping",
                                                          "seq_lens", "input_ids")})
        wants.append(reference(cached, [1] * ROWS, tables, ids=[k] * ROWS))
    torch.cuda.synchronize()
    for snap, want in zip(snaps, wants, strict=True):
        for name, t in snap.items():
            assert t.tolist() == want[name], name
