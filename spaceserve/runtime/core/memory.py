"""Memory plan: how many KV blocks the device can hold.

On a GPU the KV cache gets what is left of ``total * gpu_memory_utilization`` after everything
already resident (weights, the CUDA context, other tenants: read back from the driver) and after
the peak activation of the largest step or encoder pass and a reserve for decode graphs (the
bound on every decode graph's memory together, checked as each is captured). On CPU
the number of blocks is configured. The plan also fixes the longest sequence the engine accepts:
the model's context, capped by what the whole cache can hold, so a prompt that could never fit
is refused at arrival instead of stalling the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spaceserve.checks import require_int

if TYPE_CHECKING:  # torch is imported where a plan is made, so settings can name the default
    import torch

CPU_DEFAULT_BLOCKS = 1024
GRAPH_RESERVE_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """The KV cache size and how it was derived (bytes)."""

    num_blocks: int
    block_size: int
    block_bytes: int
    source: str  # "configured" or "profiled"
    total_bytes: int = 0
    used_bytes: int = 0
    activation_bytes: int = 0
    reserve_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype) -> int:
    """Bytes of one block of K and V over every layer."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def plan_kv_cache(
    *,
    block_size: int,
    block_bytes: int,
    device: torch.device | str,
    num_blocks: int | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_bytes: int = 0,
    reserve_bytes: int = GRAPH_RESERVE_BYTES,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
) -> MemoryPlan:
    """Size the KV cache. `num_blocks` set: used as is. Otherwise on CPU: `CPU_DEFAULT_BLOCKS`;
    on CUDA: from `free_bytes`/`total_bytes` (default: the driver's numbers now). Raises
    ValueError on bad arguments and when not even one block fits."""
    import torch

    require_int("block_size", block_size)
    require_int("block_bytes", block_bytes)
    if num_blocks is not None:
        require_int("num_blocks", num_blocks)
        return MemoryPlan(num_blocks, block_size, block_bytes, "configured")
    dev = torch.device(device)
    if dev.type != "cuda" and free_bytes is None:
        return MemoryPlan(CPU_DEFAULT_BLOCKS, block_size, block_bytes, "configured")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if activation_bytes < 0 or reserve_bytes < 0:
        raise ValueError("activation_bytes and reserve_bytes must be >= 0")
    if free_bytes is None or total_bytes is None:
        free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
    used = total_bytes - free_bytes
    budget = int(total_bytes * gpu_memory_utilization) - used - activation_bytes - reserve_bytes
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {total_bytes / 2**30:.1f} GiB x "
            f"gpu_memory_utilization={gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB "
            f"after {used / 2**30:.1f} GiB in use, {activation_bytes / 2**30:.2f} GiB of "
            f"activations and {reserve_bytes / 2**30:.2f} GiB reserved; one block is "
            f"{block_bytes} bytes"
        )
    return MemoryPlan(int(blocks), block_size, block_bytes, "profiled", total_bytes, used,
                      activation_bytes, reserve_bytes)


def max_sequence_len(model_max_len: int, plan: MemoryPlan, configured: int | None = None) -> int:
    """Longest sequence the engine accepts: the context, capped by the configured limit and by
    the whole KV cache."""
    limit = model_max_len if configured is None else min(configured, model_max_len)
    return min(limit, plan.capacity_tokens)
