"""Which decode graphs exist and which one a step takes: (batch size, block-table width) buckets.

A decode graph reads block tables of a fixed width. Capturing every graph as wide as
``max_model_len`` makes every replay pay for the longest context the engine accepts: the torch
backend gathers (and upcasts) every column of every row, and the planner uploads the whole
table. So graphs are captured per batch size *and* per table width, and a decode step replays
the smallest graph whose batch size holds its sequences and whose width covers its longest
sequence. The widths are a doubling ladder from `MIN_GRAPH_CONTEXT` tokens up to the widest
table (default), or the context lengths the caller names; a step longer than the widest runs
eagerly (as vLLM's ``max_seq_len_to_capture``). Pure host bookkeeping: no torch, no device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from spaceserve.checks import require_ints

MIN_GRAPH_CONTEXT = 256  # tokens covered by the narrowest default table width

__all__ = ["MIN_GRAPH_CONTEXT", "check_context_lens", "decode_need", "pick_bucket",
           "table_widths"]


def check_context_lens(context_lens: Iterable[int] | None, name: str = "graph_context_lens"
                       ) -> tuple[int, ...] | None:
    """`context_lens` as a sorted tuple of distinct ints >= 1 (None stays None); ValueError
    naming `name` otherwise."""
    if context_lens is None:
        return None
    lens = require_ints(name, tuple(context_lens))
    return tuple(sorted(set(lens)))


def table_widths(max_blocks_per_seq: int, block_size: int,
                 context_lens: Sequence[int] | None = None) -> tuple[int, ...]:
    """Block-table widths (in blocks) decode graphs are captured for, ascending.

    None: ``ceil(MIN_GRAPH_CONTEXT / block_size)`` blocks, doubling, up to and including
    `max_blocks_per_seq` (every decode step has a width). Given `context_lens` (tokens): each
    rounded up to whole blocks and capped at `max_blocks_per_seq`.
    """
    if max_blocks_per_seq < 1 or block_size < 1:
        raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} and block_size={block_size} "
                         "must be >= 1")
    if context_lens is not None:
        lens = check_context_lens(context_lens)
        assert lens is not None
        return tuple(sorted({min(max_blocks_per_seq, -(-n // block_size)) for n in lens}))
    out: list[int] = []
    w = max(1, -(-MIN_GRAPH_CONTEXT // block_size))
    while w < max_blocks_per_seq:
        out.append(w)
        w *= 2
    out.append(max_blocks_per_seq)
    return tuple(out)


def decode_need(seq_lens: Iterable[int], block_size: int) -> int:
    """Blocks the longest of a decode step's sequences needs (cached + its new token)."""
    return -(-max(seq_lens, default=0) // block_size)


def pick_bucket(batch_sizes: Sequence[int], widths: Sequence[int], num_seqs: int,
                need_width: int) -> tuple[int, int] | None:
    """(batch size, width) of the smallest captured graph holding `num_seqs` sequences whose
    tables cover `need_width` blocks, or None when none does (the step runs eagerly). Both
    sequences must be ascending; every pair of them is a bucket."""
    b = next((x for x in batch_sizes if x >= num_seqs), None)
    w = next((x for x in widths if x >= need_width), None)
    if b is None or w is None:
        return None
    return b, w
