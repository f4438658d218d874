"""Requests, sampling parameters and outputs of the SpaceServe engine.

A `Request` is the engine's mutable record of one prompt's life: its tokens (prompt, then the
generated ones), how many of them are in the KV cache, the KV blocks it holds, its image
embeddings, and its timings. `SamplingParams` (sampling_params.py) and `RequestOutput` are the
public face. Outputs are built in O(1) per token: a streaming output's cumulative fields
(`token_ids`, `logprobs`, `text`, the token times) are views of the request's growing lists,
read (or joined) only when someone asks.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spaceserve.checks import check_int
from spaceserve.runtime.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

__all__ = ["FINISH_REASONS", "MAX_LOGPROBS", "MAX_STOP_STRINGS", "MultiModalData", "Request",
           "RequestMetrics", "RequestOutput", "SamplingParams", "SeqView", "Status",
           "TokenLogprob", "check_int"]

FINISH_REASONS = ("stop", "length", "abort", "error")


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class ItemEmbeds:
    """One media item's embeddings ``[tokens, hidden]`` held outside the encoder cache."""

    tensor: torch.Tensor


@dataclass
class MultiModalData:
    """A prompt's media: patches, grids, the prompt index of every media token, and (once
    encoded or found in the encoder cache) one embedding entry per item.

    Images and videos are items in prompt order: `pixel_values` holds their patches and
    `image_grid_thw` one (t, h, w) row each, so the encoder runs a request's media as one job
    (a video is an item of t temporal patches; transformers passes its patches apart, as
    ``pixel_values_videos``). `video_items` are the rows that are videos and
    `second_per_grid_ts` their seconds per temporal patch (Qwen2.5-VL's M-RoPE).
    `content_hashes` has one hash per item (decoded pixels and processor settings); the input
    module gives them, else they are computed from the patches when first asked for.

    `items` holds, per item, the encoder-cache entry (anything with a ``tensor`` of
    ``[item tokens, hidden]`` rows) whose embeddings the item's tokens take, or None while the
    item has none (not encoded yet, or not needed: its tokens are in the prefix cache).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: np.ndarray  # sorted prompt indices of the media tokens; item rows in order
    video_items: tuple[int, ...] = ()
    second_per_grid_ts: tuple[float, ...] = ()
    hashes: tuple[str, ...] | None = None
    items: list[Any] | None = None
    _bounds: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_items(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_images(self) -> int:
        return self.num_items - len(self.video_items)

    @property
    def num_videos(self) -> int:
        return len(self.video_items)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def item_bounds(self) -> np.ndarray:
        """``[num_items + 1]`` cumulative token counts: item i owns embedding rows (and media
        tokens) ``bounds[i] .. bounds[i + 1] - 1``."""
        if self._bounds is None:
            patches = self.image_grid_thw.prod(dim=1).to(torch.int64)
            total = int(patches.sum())
            group = total // self.num_tokens if self.num_tokens else 1
            self._bounds = np.concatenate([[0], np.cumsum(patches.numpy() // max(group, 1))])
        return self._bounds

    def item_span(self, i: int) -> tuple[int, int]:
        """Prompt indices (first, last) of item `i`'s tokens."""
        b = self.item_bounds
        return int(self.positions[b[i]]), int(self.positions[b[i + 1] - 1])

    def items_from(self, start: int) -> list[int]:
        """Items with a token at prompt index `start` or later (those a prefill from `start`
        needs)."""
        row = int(np.searchsorted(self.positions, start))
        if row >= self.num_tokens:
            return []
        first = int(np.searchsorted(self.item_bounds, row, side="right")) - 1
        return list(range(first, self.num_items))

    def items_between(self, lo: int, hi: int) -> range:
        """Items with a token at a prompt index in ``lo .. hi - 1``."""
        a, b = np.searchsorted(self.positions, [lo, hi])
        if b <= a:
            return range(0)
        bounds = self.item_bounds
        return range(int(np.searchsorted(bounds, a, side="right")) - 1,
                     int(np.searchsorted(bounds, b - 1, side="right")))

    def pieces(self, lo: int, hi: int) -> list[tuple[Any, int, int]]:
        """Embedding rows ``lo .. hi - 1`` (over all items) as (entry, first row, end row) per
        item they touch, rows relative to the item; raises RuntimeError for a row whose item
        has no embeddings."""
        out: list[tuple[Any, int, int]] = []
        bounds = self.item_bounds
        i = int(np.searchsorted(bounds, lo, side="right")) - 1
        while lo < hi:
            end = min(hi, int(bounds[i + 1]))
            entry = self.items[i] if self.items is not None else None
            if entry is None:
                raise RuntimeError(f"media item {i} has no embeddings but its tokens are "
                                   "being computed")
            out.append((entry, lo - int(bounds[i]), end - int(bounds[i])))
            lo, i = end, i + 1
        return out

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Embedding rows ``lo .. hi - 1`` in one tensor (a view when one item holds them)."""
        parts = [e.tensor[a:b] for e, a, b in self.pieces(lo, hi)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def embeds(self) -> torch.Tensor | None:
        """All embedding rows in one tensor when every item has them (None otherwise)."""
        if self.items is None or not self.items or any(e is None for e in self.items):
            return None
        return self.rows(0, self.num_tokens) if self.num_tokens else None

    def set_embeds(self, embeds: torch.Tensor) -> None:
        """Give every item its rows of `embeds` (``[num_tokens, hidden]``), outside any cache."""
        if embeds.shape[0] != self.num_tokens:
            raise ValueError(f"embeds has {embeds.shape[0]} rows for {self.num_tokens} tokens")
        b = self.item_bounds
        self.items = [ItemEmbeds(embeds[int(b[i]):int(b[i + 1])]) for i in range(self.num_items)]

    def subset(self, items: Sequence[int]) -> MultiModalData:
        """A media object of only `items` (patches and grids; no prompt positions; their item
        keys as its content hashes): what an encoder job over them takes."""
        items = list(items)
        if items == list(range(self.num_items)):
            pv, grid = self.pixel_values, self.image_grid_thw
        else:
            starts = np.concatenate([[0], np.cumsum(self.image_grid_thw.prod(dim=1).numpy())])
            pv = torch.cat([self.pixel_values[int(starts[i]):int(starts[i + 1])] for i in items])
            grid = self.image_grid_thw[items]
        videos = set(self.video_items)
        bounds = self.item_bounds
        n = sum(int(bounds[i + 1] - bounds[i]) for i in items)
        return MultiModalData(pv, grid, np.arange(n, dtype=np.int64),
                              video_items=tuple(j for j, i in enumerate(items) if i in videos),
                              hashes=tuple(self.item_key(i) for i in items))

    def grid_of(self, kind: str) -> torch.Tensor | None:
        """The grid rows of the images or of the videos (``kind`` "image" / "video"), in prompt
        order, or None when there are none."""
        videos = set(self.video_items)
        rows = [i for i in range(self.num_items) if (i in videos) == (kind == "video")]
        return self.image_grid_thw[rows] if rows else None

    def item_key(self, i: int) -> str:
        """What identifies item `i`'s encoder output and the K/V of its tokens: its content
        hash, and for a video its seconds per temporal patch (M-RoPE spacing)."""
        key = self.content_hashes[i]
        if i in self.video_items and self.second_per_grid_ts:
            key += f"@{self.second_per_grid_ts[self.video_items.index(i)]!r}"
        return key

    @property
    def content_hashes(self) -> tuple[str, ...]:
        """One content hash per item, in prompt order: the input module's, else a hash of its
        patches and grid - the one the replica router keys an image by (`mm_hash.py`)."""
        if self.hashes is None:
            from spaceserve.runtime.core.mm_hash import image_hashes

            self.hashes = image_hashes(self.pixel_values, self.image_grid_thw)
        return self.hashes


class SeqView(Sequence):
    """A read-only view of ``data[start:stop]`` for a list that only changes past `stop`: an
    O(1) snapshot of a growing list (compares equal to any sequence with the same items)."""

    __slots__ = ("_data", "_start", "_stop")

    def __init__(self, data: list[Any], start: int, stop: int) -> None:
        self._data, self._start, self._stop = data, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._data[self._start:self._stop][i]
        n = self._stop - self._start
        if not -n <= i < n:
            raise IndexError("SeqView index out of range")
        return self._data[self._start + (i % n)]

    def __iter__(self) -> Iterator[Any]:
        data = self._data
        return (data[i] for i in range(self._start, self._stop))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled (an output sent to another process) as its items only, not the whole list
        return list, (list(self),)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability under the raw logits (before any processing), its
    rank in the vocabulary (1 = most likely) and the `top` most likely tokens as (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic-clock timestamps (seconds): arrival, first token, every token, finish; and
    how many prompt tokens the prefix cache held when the request was first admitted."""

    arrival_time: float
    first_token_time: float | None
    token_times: tuple[float, ...]
    finished_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


class TextSnapshot:
    """The first `n` pieces of a request's growing list of text pieces, joined on demand."""

    __slots__ = ("_parts", "_n")

    def __init__(self, parts: list[str], n: int) -> None:
        self._parts, self._n = parts, n

    def __str__(self) -> str:
        return "".join(self._parts[:self._n])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return str, (str(self),)  # pickled as the text, not the growing list of pieces


@dataclass(frozen=True, eq=False)
class RequestOutput:
    """What a request has produced so far.

    `token_ids` are all generated tokens and `new_token_ids` those since the previous output of
    the same request (streaming); `text` is the detokenised output so far (joined when read;
    stop strings cut it) and `delta_text` the part of it new in this output. Text that may
    still change (an incomplete UTF-8 character, a possible start of a stop string) is held
    back until it cannot. `logprobs` / `new_logprobs` hold a `TokenLogprob` per token when the
    request asked for them. `stop_reason` is the stop string or stop token id that ended it
    (None for the model's end-of-sequence token or another reason). `index` is the choice
    (0 .. n - 1 for a request with ``n`` > 1: each choice ends with its own final output).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: Sequence[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None
    metrics: RequestMetrics
    delta_text: str = ""
    logprobs: Sequence[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    text_source: str | TextSnapshot | None = field(default=None, repr=False)
    index: int = 0  # which of the request's choices

    @property
    def text(self) -> str | None:
        """The output text so far (None without a tokenizer)."""
        t = self.text_source
        return t if t is None or isinstance(t, str) else str(t)


class Request:
    """The engine's record of one request (plain slots: it is touched every step)."""

    __slots__ = (
        "request_id", "seq_no", "params", "seed", "token_ids", "num_prompt_tokens", "mm",
        "status", "num_computed", "block_ids", "row", "synced_blocks", "finish_reason",
        "error", "arrival_time", "first_token_time", "token_times", "finished_time",
        "num_preemptions", "num_emitted", "sink", "stream", "model_state", "stop_ids",
        "limit_len", "prompt_ids", "num_placeholders", "admit_serial", "logprobs", "detok",
        "stop_reason", "min_len", "block_hashes", "num_hashed", "prefix_hint",
        "num_cached_tokens", "index", "group", "shared_tail", "fair_key")

    def __init__(self, request_id: str, seq_no: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, mm: MultiModalData | None = None,
                 arrival_time: float = 0.0) -> None:
        self.request_id = request_id
        self.seq_no = seq_no
        self.params = params
        self.seed = seed
        self.prompt_ids = list(prompt_token_ids)  # shared by every output: never mutated
        self.token_ids = list(prompt_token_ids)  # prompt, generated tokens, then placeholders
        self.num_prompt_tokens = len(prompt_token_ids)
        self.mm = mm
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_ids: list[int] = []
        self.row = -1  # slot in the planner's persistent block table while running
        self.synced_blocks = 0  # how many of block_ids the planner's table holds
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_emitted = 0
        self.sink: Any = None  # callable receiving RequestOutputs (stream / generate)
        self.stream = False  # emit an output after every new token, not only at the end
        self.model_state: Any = None  # per-request data a model runner precomputes
        self.stop_ids: frozenset[int] = frozenset()  # tokens that end it (set on queueing)
        self.limit_len = 0  # sequence length at which it ends with "length"
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of its full blocks so far
        self.num_hashed = 0  # leading blocks of block_ids offered to the prefix cache
        self.prefix_hint = 0  # prompt tokens the prefix cache held when it arrived
        self.num_cached_tokens = -1  # prompt tokens it held at the first admission (-1: none)
        self.index = 0  # its choice among the request's n (parallel sampling)
        self.group: Any = None  # the `forks.SequenceGroup` of its n sequences (n > 1)
        self.shared_tail = False  # its last block is shared with a fork: copy before writing
        self.fair_key: str | None = None  # the user it shares the batch with (fair_share.py)
        # Tokens drawn by steps not yet read back (they follow token_ids; the scheduler counts
        # them as known, the planner takes them from the device).
        self.num_placeholders = 0
        self.admit_serial = 0  # bumped by the scheduler whenever it takes a sequence slot
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.detok: Any = None  # the output processor's incremental detokeniser state
        self.stop_reason: int | str | None = None
        self.min_len = 0  # sequence length before which stop tokens do not end it (min_tokens)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def metrics(self, final: bool = True) -> RequestMetrics:
        """Timings; a non-final one views the token times instead of copying them."""
        times = self.token_times
        return RequestMetrics(self.arrival_time, self.first_token_time,
                              tuple(times) if final else SeqView(times, 0, len(times)),
                              self.finished_time, self.num_preemptions,
                              max(0, self.num_cached_tokens))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
                f" out={self.num_output_tokens}, computed={self.num_computed})")
