"""`plan_decode` (the incremental decode-step planner) against `ContextPlanner.plan` on random
step sequences: staged double buffers, repeated and changing batches, table rows that grow,
graph padding, and general steps in between; every field the model reads must be equal."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spaceserve.models.step.context import ContextPlanner
from spaceserve.models.step.decode_plan import plan_decode

S, W, BS = 12, 20, 4


def fields(ctx, b: int) -> dict[str, list]:
    w = -(-int(ctx.host.seq_lens[:b].max()) // BS)
    n = ctx.num_seqs
    return {"positions": ctx.positions[:, :n].tolist(), "slots": ctx.slot_mapping[:n].tolist(),
            "cu": ctx.cu_seqlens_q.tolist(), "lens": ctx.seq_lens.tolist(),
            "tables": ctx.block_tables[:b, :w].tolist(),
            "pad_tables": ctx.block_tables[b:, :w].tolist(),
            "logits": ctx.logits_indices.tolist(), "lseq": ctx.logits_seqs.tolist(),
            "ids": ctx.input_ids[:n].tolist(), "meta": (ctx.num_seqs, ctx.num_tokens,
                                                        ctx.num_real_seqs, ctx.max_seqlen_k)}


@pytest.mark.parametrize("seed", range(4))
def test_decode_plan_equals_the_general_plan(seed: int) -> None:
    rng = random.Random(seed)
    fast = ContextPlanner(S, 64, W, BS, staged=True, staging=2)
    ref = ContextPlanner(S, 64, W, BS, rows=fast)
    for r in range(S):
        pos = torch.randint(0, 50, (3, 3)) if r % 3 == 0 else None
        fast.set_row(r, [rng.randrange(100) for _ in range(W)], rope_delta=rng.randint(-3, 3),
                     mrope_positions=pos)
    key, rows, changed = 0, sorted(rng.sample(range(S), 5)), []
    cached = np.array([rng.randint(0, 40) for _ in rows], dtype=np.int64)
    for step in range(60):
        roll = rng.random()
        if roll < 0.15:  # the batch changes
            rows = rng.sample(range(S), rng.randint(1, 8))
            cached = np.array([rng.randint(0, 40) for _ in rows], dtype=np.int64)
            key += 1
        changed = []
        for _ in range(rng.choice([0, 0, 1, 2])):  # rows get another block
            r = rng.choice(rows)
            fast.table[r, rng.randrange(W)] = rng.randrange(100)
            changed.append(r)
        if rng.random() < 0.1:  # a general (prefill) step on the same buffers
            fast.plan([rows[0]], [0], [3], input_ids=[1, 2, 3])
        pad = rng.choice([None, None, 8, 12]) if len(rows) <= 8 else None
        width = W if pad else None
        ids = [rng.randrange(50) for _ in rows]
        arr = np.array(rows, dtype=np.int64)
        got = fields(plan_decode(fast, arr, cached, input_ids=ids, pad_seqs_to=pad, width=width,
                                 rows_key=key, changed=changed), len(rows))
        want = fields(ref.plan(rows, cached, [1] * len(rows), input_ids=ids, pad_seqs_to=pad,
                               width=width), len(rows))
        assert got == want, step
        cached = cached + 1
