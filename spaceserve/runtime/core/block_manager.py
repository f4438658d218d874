"""Paged KV-cache block manager: reference-counted blocks, and the prefix cache over them.

A request holds a list of block ids covering its cached tokens (block ``i`` holds token indices
``i * block_size .. (i + 1) * block_size - 1``). The manager only does the bookkeeping; the
caches themselves belong to the model runner.

Every block has a reference count: the requests whose block lists hold it. A block is free when
its count is 0. With prefix caching on, a full block whose K/V are computed can be *committed*
under a hash of its contents (`prefix_cache.block_hashes`: the parent block's hash, its token
ids and the media in it). A committed block that becomes free keeps its contents and its hash:
it sits in an LRU list and is handed out again only when no never-committed free block is left
(its hash is dropped then: eviction). `match` gives a new request the longest chain of
committed blocks its own hashes name, taking a reference on each, so requests share them.
Shared blocks are never written: a request writes only past its matched prefix, and a block
shared by forked sequences (`fork`) is copied before one of them writes into it
(`make_writable`, copy on write).

Double frees and foreign ids raise, so a leak or a shared block shows up as an error, not as a
corrupted sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from spaceserve.checks import require_int


class BlockManager:
    """Reference-counted blocks over ``num_blocks`` blocks of ``block_size`` tokens, with an
    optional prefix cache (`enable_caching`)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False) -> None:
        require_int("num_blocks", num_blocks)
        require_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = bool(enable_caching)
        # Free blocks holding nothing reusable: a stack, the most recently freed reused first
        # (warm in L2 on a GPU).
        self._free = list(range(num_blocks - 1, -1, -1))
        # Free committed blocks, least recently freed first: evicted in this order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._table: dict[bytes, int] = {}  # committed hash -> block
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (free, or committed and unreferenced)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Committed blocks (in use or free)."""
        return len(self._table)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (never-committed ones first, then the least recently freed committed
        ones, whose hashes are dropped); raises RuntimeError when fewer are free."""
        if n > self.num_free:
            raise RuntimeError(f"{n} KV blocks requested, {self.num_free} free")
        if n <= 0:
            return []
        k = min(n, len(self._free))
        got = self._free[len(self._free) - k:]
        del self._free[len(self._free) - k:]
        for _ in range(n - k):
            b, _ = self._lru.popitem(last=False)
            self._uncommit(b)
            self.num_evicted += 1
            got.append(b)
        ref = self._ref
        for b in got:
            ref[b] = 1
        return got

    def ensure(self, block_ids: list[int], num_tokens: int) -> bool:
        """Grow `block_ids` in place to cover `num_tokens` tokens. Returns False, allocating
        nothing, when not enough blocks are free."""
        need = -(-num_tokens // self.block_size) - len(block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        block_ids.extend(self.allocate(need))
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each of `block_ids` and empty the list. A block whose count
        reaches 0 is free again; a committed one keeps its contents (last blocks of the list
        evicted first)."""
        ref = self._ref
        for b in block_ids:
            if not 0 <= b < self.num_blocks or ref[b] < 1:
                raise RuntimeError(f"KV block {b} freed but not allocated")
            ref[b] -= 1
        for b in reversed(block_ids):
            if ref[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        block_ids.clear()

    # -- sharing ------------------------------------------------------------------------------
    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """A second holder of `block_ids` (a forked sequence): one more reference each."""
        ref = self._ref
        for b in block_ids:
            if ref[b] < 1:
                raise RuntimeError(f"KV block {b} forked but not allocated")
            ref[b] += 1
        return list(block_ids)

    def make_writable(self, block_ids: list[int], index: int) -> tuple[int, int] | None | bool:
        """Copy on write: when block ``block_ids[index]`` is shared, give this holder a fresh
        block in its place and return (source, destination) for the caller to copy; None when
        the block is its own; False, changing nothing, when no block is free."""
        b = block_ids[index]
        if self._ref[b] <= 1:
            return None
        if not self.num_free:
            return False
        (new,) = self.allocate(1)
        self._ref[b] -= 1
        block_ids[index] = new
        return b, new

    # -- the prefix cache ----------------------------------------------------------------------
    def peek(self, hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many leading blocks of `hashes` (at most `max_blocks`) are committed; takes
        nothing."""
        if not self.enable_caching:
            return 0
        n = 0
        table = self._table
        for h in hashes[:max_blocks]:
            if h not in table:
                break
            n += 1
        return n

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The committed blocks of the longest prefix of `hashes` (at most `max_blocks`), each
        with a reference taken for the caller."""
        if not self.enable_caching:
            return []
        out: list[int] = []
        table, ref, lru = self._table, self._ref, self._lru
        for h in hashes[:max_blocks]:
            b = table.get(h)
            if b is None:
                break
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1
            out.append(b)
        return out

    def commit(self, block_ids: Sequence[int], hashes: Sequence[bytes], start: int,
               end: int) -> None:
        """Offer blocks ``block_ids[start:end]`` (full, their K/V computed) to the prefix cache
        under ``hashes[start:end]``. A block already committed keeps its hash; a hash another
        block holds stays with that block (this one is then freed uncommitted)."""
        if not self.enable_caching:
            return
        table, bhash = self._table, self._hash
        for i in range(start, end):
            b = block_ids[i]
            if bhash[b] is not None:
                continue
            h = hashes[i]
            if h in table:
                continue
            table[h] = b
            bhash[b] = h

    def _uncommit(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            self._hash[b] = None
            if self._table.get(h) == b:
                del self._table[h]

    def reset_cache(self) -> int:
        """Forget every free committed block (they become plain free blocks); returns how
        many. Blocks in use keep their hashes."""
        n = 0
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            self._uncommit(b)
            self._free.append(b)
            n += 1
        return n

    def check_all_free(self) -> None:
        """Raise AssertionError unless every block is free exactly once and the prefix cache's
        table names only free committed blocks."""
        assert self.num_free == self.num_blocks, f"{self.num_used} KV blocks still held"
        assert not any(self._ref), "a block has references"
        seen = set(self._free) | set(self._lru)
        assert len(seen) == self.num_blocks, "free lists hold duplicates"
        assert all(self._hash[b] is None for b in self._free), "a plain free block has a hash"
        assert all(self._table.get(self._hash[b]) == b for b in self._lru), \
            "a cached block is missing from the table"
        assert len(self._table) == len(self._lru), "the table names blocks not in the cache"
