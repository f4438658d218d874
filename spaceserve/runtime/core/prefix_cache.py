"""Prefix-cache block hashes: what names the K/V contents of a full block.

Block ``j`` of a sequence holds the K/V of tokens ``j * B .. (j + 1) * B - 1``. Those depend on
every token before them (attention), on their own ids, on the media whose embeddings some of
them take, and on their positions - which for Qwen2-VL's M-RoPE follow from the grids of the
media before them. So a block's hash chains: SHA-256 over the parent block's hash, the block's
token ids, and the key of every media item with a token in the block (its content hash: decoded
pixels and processor settings, which also fix its grid; a video's seconds per temporal patch
too). Equal hashes mean equal K/V, so a new request may reuse a committed block in place of
computing it. The hashes of a request are computed once per block and kept on it
(``Request.block_hashes``), since its token ids only grow.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from spaceserve.runtime.core.request import Request

if TYPE_CHECKING:
    from spaceserve.runtime.core.block_manager import BlockManager

ROOT = hashlib.sha256(b"spaceserve-prefix-cache-v1").digest()


def block_hashes(req: Request, block_size: int, num_tokens: int) -> list[bytes]:
    """``req``'s hashes for its full blocks within its first `num_tokens` tokens (extends and
    returns ``req.block_hashes``)."""
    hashes = req.block_hashes
    n_full = min(num_tokens, len(req.token_ids)) // block_size
    first = len(hashes)
    if n_full <= first:
        return hashes
    ids = np.asarray(req.token_ids[first * block_size:n_full * block_size], dtype=np.int64)
    mm = req.mm
    media_end = -1
    if mm is not None and mm.num_tokens:
        media_end = int(mm.positions[-1])
    parent = hashes[-1] if hashes else ROOT
    for j in range(first, n_full):
        lo = j * block_size
        h = hashlib.sha256(parent)
        h.update(ids[(j - first) * block_size:(j - first + 1) * block_size].tobytes())
        if lo <= media_end:
            for i in mm.items_between(lo, lo + block_size):
                h.update(b"\x00" + mm.item_key(i).encode())
        parent = h.digest()
        hashes.append(parent)
    return hashes


def max_match_blocks(req: Request, block_size: int) -> int:
    """The most blocks a request may take from the prefix cache: its known tokens less one,
    whole blocks only (the last token is always computed, so there are logits to sample)."""
    return (len(req.token_ids) - 1) // block_size


def take_prefix(bm: BlockManager, req: Request) -> None:
    """Give a waiting request (nothing computed) the longest chain of committed blocks its
    tokens name, as computed tokens (nothing with caching off)."""
    if not bm.enable_caching or req.num_computed:
        return
    bs = bm.block_size
    limit = max_match_blocks(req, bs)
    got = bm.match(block_hashes(req, bs, limit * bs), limit)
    if got:
        req.block_ids = got
        req.num_hashed = len(got)
        req.num_computed = len(got) * bs


def drop_prefix(bm: BlockManager, req: Request) -> None:
    """Undo `take_prefix` (the request is not admitted after all)."""
    if req.block_ids:
        bm.free(req.block_ids)
    req.num_computed = req.num_hashed = 0
    req.shared_tail = False  # an adopted prompt's (forks.adopt)


def commit_upto(bm: BlockManager, req: Request, tokens: int) -> None:
    """Offer `req`'s full blocks among its first `tokens` (known ones only) to the cache."""
    bs = bm.block_size
    full = min(min(tokens, len(req.token_ids)) // bs, len(req.block_ids))
    if full > req.num_hashed:
        bm.commit(req.block_ids, block_hashes(req, bs, full * bs), req.num_hashed, full)
        req.num_hashed = full
