"""Shared builders for the paged-attention tests: random caches and scattered block tables."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_tables(lens: list[int], block_size: int, max_blocks: int, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    """int32 [S, max_blocks] tables over disjoint, randomly scattered blocks; unused = -1.

    The unused entries hold -1 so a kernel that reads past a sequence's pages cannot pass.
    """
    need = sum(cdiv(n, block_size) for n in lens)
    assert need <= num_blocks and max(cdiv(n, block_size) for n in lens) <= max_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        p = cdiv(n, block_size)
        tables[i, :p] = perm[at: at + p].to(torch.int32)
        at += p
    return tables


def random_cache(num_blocks: int, block_size: int, hkv: int, dim: int, dtype: torch.dtype,
                 gen: torch.Generator, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, hkv, dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


def as64(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.double().cpu() for t in ts]
