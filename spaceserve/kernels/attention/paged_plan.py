"""Work lists for paged attention: argument checks, work-list builders and the staged buffer.

Paged decode and prefill walk flat work lists with a persistent loop. A work list is one int32
buffer: element 0 holds the number of live items, then ``capacity`` items of three int32 each;
slots past the live count hold -1 (empty) and are skipped. Each list has two builders with the
same result:

- a host one in numpy (a planner's `plan`), whose live prefix travels to the device in one
  non-blocking copy from a pinned staging buffer into a preallocated device buffer, so a captured
  CUDA graph can be replayed with new contents; and
- a torch one that runs on the device (the functional calls given device tensors) over the whole
  capacity, with no host sync.

Items are ordered most work first (longest-processing-time order) so the tail of a persistent
launch is short. The order decides only which program runs an item, never its arithmetic, so
results stay bitwise identical for every budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ITEM_WIDTH = 3  # (sequence, chunk-or-q-block, kv head) per work item


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def as_host_int_tensor(values: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor of host-side values; refuses device tensors (that would sync)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be host-side values (a list or a CPU tensor)")
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {values.dtype}")
        t = values.to(torch.int64)
    else:
        t = torch.as_tensor(list(values), dtype=torch.int64)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a layer's K/V caches [num_blocks, block_size, Hkv, D]; returns those four sizes."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError("k_cache and v_cache are on different devices")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    nb, bs, hkv, d = k_cache.shape
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"k_cache block_size={bs} must be a power of two")
    return nb, bs, hkv, d


def check_heads(q: torch.Tensor, k_cache: torch.Tensor, q_dims: int) -> tuple[int, int]:
    """Check q against the caches: dtype, head_dim, Hq % Hkv; returns (Hq, group size)."""
    if q.dim() != q_dims:
        raise ValueError(f"q must have {q_dims} dims, got shape {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != k_cache dtype {k_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} is not supported (fp16, bf16, fp32)")
    if q.device != k_cache.device:
        raise ValueError("q and k_cache are on different devices")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if d != dk:
        raise ValueError(f"q head_dim={d} != k_cache head_dim={dk}")
    if d > 256:
        raise ValueError(f"head_dim={d} > 256 is not supported")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv} (Hq % Hkv)")
    return hq, hq // hkv


def check_index(t: torch.Tensor, name: str, shape: tuple[int | None, ...],
                device: torch.device, dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> None:
    """Dtype, rank, sizes (None = any) and device of an index tensor."""
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {want}, got {t.dtype}")
    if t.dim() != len(shape) or any(
            s is not None and s != n for s, n in zip(shape, t.shape, strict=True)):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_lengths_host(seq_lens: torch.Tensor, capacity_tokens: int,
                       name: str = "seq_lens") -> None:
    """Host-side value check: 0 <= seq_len <= the block table's token capacity."""
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ValueError(f"{name} holds a negative length")
    if seq_lens.numel() and int(seq_lens.max()) > capacity_tokens:
        raise ValueError(f"{name} max {int(seq_lens.max())} exceeds the block table capacity "
                         f"of {capacity_tokens} tokens")


def check_block_ids_host(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         num_blocks: int) -> None:
    """Host-side value check: every page a sequence uses names a block of the cache."""
    pages = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1])[None, :] < pages[:, None]
    ids = block_tables.to(torch.int64)[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables names a block outside 0..{num_blocks - 1}")


def check_plan_sizes(num_q_heads: int, **sizes: int) -> None:
    """Capacity check of a plan: every size (num_kv_heads among them) >= 1, Hq % Hkv == 0."""
    for name, v in sizes.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    if num_q_heads % sizes["num_kv_heads"]:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                         f"num_kv_heads={sizes['num_kv_heads']} (Hq % Hkv)")


def _fill(dst: torch.Tensor, items: torch.Tensor, count: torch.Tensor) -> None:
    """Write count and items into a work-list buffer, empty slots as -1."""
    cap = (dst.numel() - 1) // ITEM_WIDTH
    if items.shape[0] > cap:
        raise ValueError(f"work list of {items.shape[0]} items exceeds capacity {cap}")
    body = dst[1:].view(cap, ITEM_WIDTH)
    body[: items.shape[0]].copy_(items)
    body[items.shape[0]:].fill_(-1)
    dst[:1].copy_(count.reshape(1))


def build_decode_work(seq_lens: torch.Tensor, num_kv_heads: int, max_chunks: int, chunk: int,
                      dst: torch.Tensor) -> None:
    """Decode work items (seq, chunk, kv_head) for every non-empty chunk, longest first.

    A padding sequence (length 0) keeps its chunk 0, an item with no tokens that writes zeros.
    Runs on the device of `seq_lens` (host or GPU) with no host sync.
    """
    dev = seq_lens.device
    lens = seq_lens.to(torch.int64)
    c = torch.arange(max_chunks, device=dev, dtype=torch.int64)
    tokens = (lens[:, None] - c[None, :] * chunk).clamp(0, chunk)
    valid = (tokens > 0) | (c == 0)[None, :]
    key = torch.where(valid, tokens, torch.full_like(tokens, -1)).reshape(-1)
    srt = torch.sort(key, descending=True, stable=True)
    order = srt.indices
    seq = order // max_chunks
    chk = order % max_chunks
    live = srt.values >= 0
    heads = torch.arange(num_kv_heads, device=dev, dtype=torch.int64)
    n = order.numel()
    items = torch.stack([seq[:, None].expand(n, num_kv_heads), chk[:, None].expand(n, num_kv_heads),
                         heads[None, :].expand(n, num_kv_heads)], dim=-1)
    items = torch.where(live[:, None, None], items, torch.full_like(items, -1))
    count = valid.sum() * num_kv_heads
    _fill(dst, items.reshape(-1, ITEM_WIDTH).to(torch.int32), count.to(torch.int32))


def build_prefill_work(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                       block_q: int, qblock_capacity: int, dst: torch.Tensor) -> None:
    """Prefill work items (seq, q-block, kv_head), most KV tokens first.

    `qblock_capacity` bounds the q-blocks of all sequences (cdiv(T, block_q) + S suffices), so the
    list's size is fixed by shapes alone and builds on the device with no host sync.
    """
    dev = seq_lens.device
    cu = cu_seqlens_q.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    n = cu[1:] - cu[:-1]
    nqb = (n + block_q - 1) // block_q
    ends = torch.cumsum(nqb, 0)
    t = torch.arange(qblock_capacity, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(ends, t, right=True)
    valid = seq < n.numel()
    seq = seq.clamp(max=max(n.numel() - 1, 0))
    if n.numel() == 0:
        valid = torch.zeros_like(valid)
        lens = n = ends = nqb = torch.zeros(1, device=dev, dtype=torch.int64)
    qb = t - (ends - nqb)[seq]
    kv_end = lens[seq] - n[seq] + torch.minimum((qb + 1) * block_q, n[seq])
    key = torch.where(valid, kv_end, torch.full_like(kv_end, -1))
    srt = torch.sort(key, descending=True, stable=True)
    order = srt.indices
    live = srt.values >= 0
    heads = torch.arange(num_kv_heads, device=dev, dtype=torch.int64)
    m = order.numel()
    items = torch.stack([seq.index_select(0, order)[:, None].expand(m, num_kv_heads),
                         qb.index_select(0, order)[:, None].expand(m, num_kv_heads),
                         heads[None, :].expand(m, num_kv_heads)], dim=-1)
    items = torch.where(live[:, None, None], items, torch.full_like(items, -1))
    count = valid.sum() * num_kv_heads
    _fill(dst, items.reshape(-1, ITEM_WIDTH).to(torch.int32), count.to(torch.int32))


def decode_work_host(seq_lens: np.ndarray, num_kv_heads: int, max_chunks: int,
                     chunk: int) -> np.ndarray:
    """Host twin of `build_decode_work` (numpy, live items only): int32 [n, 3]."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    c = np.arange(max_chunks, dtype=np.int64)
    tokens = np.clip(lens[:, None] - c[None, :] * chunk, 0, chunk)
    valid = (tokens > 0) | (c == 0)[None, :]
    key = np.where(valid, tokens, -1).reshape(-1)
    order = np.argsort(-key, kind="stable")[: int(valid.sum())]
    return _expand_heads(order // max_chunks, order % max_chunks, num_kv_heads)


def prefill_work_host(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int,
                      block_q: int) -> np.ndarray:
    """Host twin of `build_prefill_work` (numpy, live items only): int32 [n, 3]."""
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    n = cu[1:] - cu[:-1]
    nqb = (n + block_q - 1) // block_q
    seq = np.repeat(np.arange(n.size, dtype=np.int64), nqb)
    qb = np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(nqb) - nqb, nqb)
    kv_end = lens[seq] - n[seq] + np.minimum((qb + 1) * block_q, n[seq])
    order = np.argsort(-kv_end, kind="stable")
    return _expand_heads(seq[order], qb[order], num_kv_heads)


def _expand_heads(seq: np.ndarray, second: np.ndarray, num_kv_heads: int) -> np.ndarray:
    items = np.empty((seq.size, num_kv_heads, ITEM_WIDTH), dtype=np.int32)
    items[..., 0] = seq[:, None]
    items[..., 1] = second[:, None]
    items[..., 2] = np.arange(num_kv_heads, dtype=np.int32)[None, :]
    return items.reshape(-1, ITEM_WIDTH)


class StagedWorkList:
    """A fixed-capacity device work list filled from the host through pinned staging.

    The device buffer is allocated once and never replaced, so kernels captured in a CUDA graph
    keep reading it. Two staging buffers alternate; before one is rewritten, the copy that last
    read it is awaited (an event recorded two plans ago, normally long complete).
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.capacity = capacity
        self.buffer = torch.full((1 + capacity * ITEM_WIDTH,), -1, dtype=torch.int32,
                                 device=self.device)
        self.buffer[0] = 0
        cuda = self.device.type == "cuda"
        self._staging = [torch.empty(self.buffer.shape, dtype=torch.int32, pin_memory=True)
                         for _ in range(2 if cuda else 0)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._live = 0

    def stage(self, items: np.ndarray) -> None:
        """Make `items` (int32 [n, 3]) the live work list: one copy of the changed prefix.

        Invariant: device slots past the live count hold -1, so only the larger of the old and
        the new live prefix is copied (non-blocking from pinned memory on CUDA).
        """
        n = items.shape[0]
        if n > self.capacity:
            raise ValueError(f"work list of {n} items exceeds capacity {self.capacity}")
        ev = self._events[self._turn]
        if ev is not None:
            ev.synchronize()  # the copy that last read this staging buffer
        cuda = self.device.type == "cuda"
        host = self._staging[self._turn] if cuda else self.buffer  # on CPU: write in place
        body = host.numpy()
        used = max(n, self._live)
        body[0] = n
        rows = body[1: 1 + used * ITEM_WIDTH].reshape(used, ITEM_WIDTH)
        rows[:n] = items
        rows[n:] = -1
        span = 1 + used * ITEM_WIDTH
        if cuda:
            self.buffer[:span].copy_(host[:span], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._turn] = ev
        self._live = n
        self._turn ^= 1
