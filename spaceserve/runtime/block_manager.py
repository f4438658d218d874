"""Paged KV-cache block manager: fixed-size blocks handed out one at a time, freed on finish,
abort or preemption.

A request holds a list of block ids covering its cached tokens (block ``i`` holds token indices
``i * block_size .. (i + 1) * block_size - 1``). The manager only does the bookkeeping; the
caches themselves belong to the model runner. Double frees and foreign ids raise, so a leak or
a shared block shows up as an error, not as a corrupted sequence.
"""

from __future__ import annotations


class BlockManager:
    """Free list over ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 1")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an int >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first (warm in L2 on a GPU).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks; raises RuntimeError when fewer are free (check `num_free` first)."""
        if n > len(self._free):
            raise RuntimeError(f"{n} KV blocks requested, {len(self._free)} free")
        if n <= 0:
            return []
        got = self._free[-n:]
        del self._free[-n:]
        used = self._in_use
        for b in got:
            used[b] = 1
        return got

    def ensure(self, block_ids: list[int], num_tokens: int) -> bool:
        """Grow `block_ids` in place to cover `num_tokens` tokens. Returns False, allocating
        nothing, when not enough blocks are free."""
        need = -(-num_tokens // self.block_size) - len(block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_ids.extend(self.allocate(need))
        return True

    def free(self, block_ids: list[int]) -> None:
        """Return `block_ids` to the free list and empty the list."""
        used = self._in_use
        for b in block_ids:
            if not 0 <= b < self.num_blocks or not used[b]:
                raise RuntimeError(f"KV block {b} freed but not allocated")
            used[b] = 0
        self._free.extend(reversed(block_ids))
        block_ids.clear()

    def check_all_free(self) -> None:
        """Raise AssertionError unless every block is back on the free list exactly once."""
        assert len(self._free) == self.num_blocks, f"{self.num_used} KV blocks still held"
        assert len(set(self._free)) == self.num_blocks, "free list holds duplicates"
        assert not any(self._in_use), "a block is marked in use"
