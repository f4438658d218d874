"""The encoder output cache: media embeddings kept by content, so a repeated image skips the
encoder.

Entries are keyed by a media item's key (`MultiModalData.item_key`: its content hash - decoded
pixels plus processor settings - and a video's frame spacing) and hold its ``[tokens, hidden]``
embeddings on the runner's device (Qwen3-VL: ``[tokens, (1 + taps) * hidden]``, the embeddings
and every DeepStack feature under the one key, so a hit skips the whole encoder). A request
holds a reference on each entry it uses until it ends; an entry with references is pinned.
Unreferenced entries are evicted least recently used first whenever room is needed under
`capacity_bytes`; an entry that does not fit beside the pinned ones lives only as long as its
requests (it is then dropped, not cached). Capacity 0 turns caching off: every item is encoded
and its entry belongs to its request alone.

`MediaTracker` is what the encoder stages share: per request, which items are needed (those
with a token at or after the first token to compute; items whose tokens are all in the prefix
cache need none), which of them the cache already has, the sub-request an encoder job runs
for the rest, and the hand-off of a job's output into entries. With caching on, an item that
another request's job is computing right now is not encoded twice: the request waits for that
job and takes the entry from the cache (or encodes the item itself after all, should that job
fail or its request end first). Every entry has an integer
`key` unique for the engine's life. A runner that keeps embeddings elsewhere (a tensor-parallel
group's workers) learns of new entries through ``split_encoding(job, [(entry, lo, hi)])`` -
rows ``lo..hi-1`` of the job's output are that entry's - and of dropped ones through `on_drop`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.checks import require_int
from spaceserve.runtime.core.request import MultiModalData, Request

CPU_DEFAULT_BYTES = 512 << 20  # without a GPU: a fixed budget in host memory
GPU_FRACTION = 0.05  # on a GPU: this share of the free memory at start-up ...
GPU_MAX_BYTES = 8 << 30  # ... at most


def default_capacity(device: torch.device | str, free_bytes: int | None = None) -> int:
    """The default byte budget: `CPU_DEFAULT_BYTES` off the GPU; on a GPU `GPU_FRACTION` of
    the free device memory (now, or `free_bytes`), at most `GPU_MAX_BYTES`."""
    dev = torch.device(device)
    if dev.type != "cuda" and free_bytes is None:
        return CPU_DEFAULT_BYTES
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(dev)[0]
    return int(min(GPU_MAX_BYTES, free_bytes * GPU_FRACTION))


@dataclass(eq=False)
class CacheEntry:
    """One item's embeddings. `refs` counts the requests holding it; `cached` whether the cache
    keeps it once they are gone."""

    key: int
    content: str
    tensor: torch.Tensor | None  # None once dropped
    nbytes: int
    refs: int = 0
    cached: bool = False


class EncoderCache:
    """LRU store of media embeddings under a byte budget (module docstring)."""

    def __init__(self, capacity_bytes: int, *,
                 on_drop: Callable[[CacheEntry], Any] | None = None) -> None:
        require_int("encoder_cache_bytes", capacity_bytes, 0)
        self.capacity = capacity_bytes
        self.on_drop = on_drop
        self._index: dict[str, CacheEntry] = {}  # content -> live entry (caching on)
        self._lru: OrderedDict[int, CacheEntry] = OrderedDict()  # unreferenced cached entries
        self._keys = itertools.count()
        self.bytes_cached = 0
        self.num_live = 0  # entries alive (cached or referenced)
        self.queries = 0  # media items looked up (one per item of every request)
        self.hits = 0  # of which needed no encoder pass
        self.num_evicted = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def num_cached(self) -> int:
        return sum(1 for e in self._index.values() if e.cached)

    def lookup(self, content: str) -> CacheEntry | None:
        """The entry of `content` with a reference taken for the caller, or None."""
        entry = self._index.get(content)
        if entry is None:
            return None
        self._acquire(entry)
        return entry

    def insert(self, content: str, tensor: torch.Tensor) -> CacheEntry:
        """A referenced entry for freshly computed embeddings of `content`; when one exists
        already (another request computed it meanwhile) that one, and `tensor` is dropped."""
        entry = self._index.get(content) if self.enabled else None
        if entry is not None:
            self._acquire(entry)
            return entry
        nbytes = tensor.numel() * tensor.element_size()
        entry = CacheEntry(next(self._keys), content, tensor, nbytes, refs=1)
        self.num_live += 1
        if self.enabled and nbytes <= self.capacity:
            while self.bytes_cached + nbytes > self.capacity and self._lru:
                self._evict(next(iter(self._lru.values())))
            if self.bytes_cached + nbytes <= self.capacity:
                entry.cached = True
                self.bytes_cached += nbytes
        if self.enabled:
            self._index[content] = entry
        return entry

    def release(self, entry: CacheEntry) -> None:
        """Drop one reference; the last one leaves a cached entry evictable (most recently
        used) and drops an uncached one."""
        if entry.refs < 1:
            raise RuntimeError(f"encoder cache entry {entry.key} released but not held")
        entry.refs -= 1
        if entry.refs:
            return
        if entry.cached:
            self._lru[entry.key] = entry
        else:
            self._drop(entry)

    def clear(self) -> int:
        """Evict every unreferenced entry; returns how many."""
        n = len(self._lru)
        while self._lru:
            self._evict(next(iter(self._lru.values())))
        return n

    def _acquire(self, entry: CacheEntry) -> None:
        if entry.refs == 0:
            self._lru.pop(entry.key, None)
        entry.refs += 1

    def _evict(self, entry: CacheEntry) -> None:
        del self._lru[entry.key]
        self.bytes_cached -= entry.nbytes
        entry.cached = False
        self.num_evicted += 1
        self._drop(entry)

    def _drop(self, entry: CacheEntry) -> None:
        if self._index.get(entry.content) is entry:
            del self._index[entry.content]
        self.num_live -= 1
        if self.on_drop is not None:
            self.on_drop(entry)
        entry.tensor = None  # its memory goes now, whoever still holds the entry

    def check_idle(self) -> None:
        """Raise AssertionError unless no entry is referenced (and the books balance)."""
        held = [e.key for e in self._index.values() if e.refs]
        assert not held, f"encoder cache entries {held} still referenced"
        assert self.num_live == len(self._lru), f"{self.num_live - len(self._lru)} entries " \
            "alive outside the cache"
        assert self.bytes_cached == sum(e.nbytes for e in self._lru.values())
        assert self.bytes_cached <= self.capacity


class MediaTracker:
    """The encoder stages' view of requests' media items (module docstring)."""

    def __init__(self, cache: EncoderCache, runner: Any) -> None:
        self.cache = cache
        self.runner = runner
        self.num_jobs = 0  # encoder jobs started (one per request that needed the encoder)
        self._computing: dict[str, int] = {}  # item key -> jobs computing it now
        self._jobs: dict[int, MultiModalData] = {}  # id -> job not finished yet

    @staticmethod
    def _items(mm: MultiModalData) -> list[Any]:
        if mm.items is None:
            mm.items = [None] * mm.num_items
        return mm.items

    def open(self, req: Request, covered: int = 0) -> list[int]:
        """A new request: count its items as cache queries, attach the cached ones and return
        the items it needs encoded. Items whose tokens all lie below `covered` (held by the
        prefix cache) need nothing and count as hits."""
        mm = req.mm
        if mm is None:
            return []
        self.cache.queries += mm.num_items
        needed = mm.items_from(covered)
        self.cache.hits += mm.num_items - len(needed)
        missing = self.attach(mm, needed)
        self.cache.hits += len(needed) - len(missing)
        return missing

    def attach(self, mm: MultiModalData, needed: Sequence[int]) -> list[int]:
        """Attach cached entries to the `needed` items without embeddings; returns those
        neither cached nor being computed by a job (the ones to encode)."""
        items = self._items(mm)
        missing = []
        for i in needed:
            if items[i] is not None:
                continue
            key = mm.item_key(i)
            entry = self.cache.lookup(key)
            if entry is not None:
                items[i] = entry
            elif key not in self._computing:
                missing.append(i)
        return missing

    def missing(self, req: Request, start: int) -> list[int]:
        """Items a prefill from token `start` needs that have no embeddings and that no job
        is computing, after looking in the cache again (an item another job computed; a
        preempted request; a prefix match shorter than expected)."""
        mm = req.mm
        if mm is None:
            return []
        return self.attach(mm, mm.items_from(start))

    def job(self, req: Request, items: Sequence[int]) -> MultiModalData:
        """The media an encoder job over `items` of `req` runs (`done` when it ends)."""
        self.num_jobs += 1
        job = req.mm.subset(items)
        self._jobs[id(job)] = job
        if self.cache.enabled:
            for key in job.content_hashes:
                self._computing[key] = self._computing.get(key, 0) + 1
        return job

    def done(self, job: MultiModalData) -> None:
        """`job` ended (finished, failed or dropped with its request); idempotent."""
        if self._jobs.pop(id(job), None) is None or not self.cache.enabled:
            return
        for key in job.content_hashes:
            n = self._computing[key] - 1
            if n:
                self._computing[key] = n
            else:
                del self._computing[key]

    def store(self, req: Request, items: Sequence[int], job: MultiModalData,
              embeds: torch.Tensor) -> str | None:
        """Hand a finished job's embeddings to the request's items (and the cache); returns an
        error message for a malformed output, else None."""
        self.done(job)
        mm = req.mm
        if embeds is None or embeds.dim() != 2 or embeds.shape[0] != job.num_tokens:
            shape = None if embeds is None else tuple(embeds.shape)
            return f"encoder returned shape {shape} for {job.num_tokens} image tokens"
        bounds = job.item_bounds
        parts: list[tuple[CacheEntry, int, int]] = []
        slots = self._items(mm)
        for j, i in enumerate(items):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            rows = embeds[lo:hi]  # views: the items of one job share its storage
            entry = self.cache.insert(mm.item_key(i), rows)
            if entry.tensor is rows:
                parts.append((entry, lo, hi))
            if slots[i] is not None:  # needed no more (it became cached meanwhile)
                self.cache.release(slots[i])
            slots[i] = entry
        split = getattr(self.runner, "split_encoding", None)
        if split is not None:
            split(job, parts)
        return None

    def drop(self, req: Request) -> None:
        """Release every entry `req` holds (it ended)."""
        mm = req.mm
        if mm is None or mm.items is None:
            return
        for i, entry in enumerate(mm.items):
            if entry is not None:
                mm.items[i] = None
                self.cache.release(entry)

    def ready(self, req: Request, start: int) -> bool:
        """Whether every item a prefill from `start` needs has embeddings (no lookups)."""
        mm = req.mm
        if mm is None:
            return True
        items = mm.items
        return all(items is not None and items[i] is not None for i in mm.items_from(start))
