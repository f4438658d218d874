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

from .sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, check_int

__all__ = ["FINISH_REASONS", "MAX_LOGPROBS", "MAX_STOP_STRINGS", "MultiModalData", "Request",
           "RequestMetrics", "RequestOutput", "SamplingParams", "SeqView", "Status",
           "TokenLogprob", "check_int"]

FINISH_REASONS = ("stop", "length", "abort", "error")


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class MultiModalData:
    """A prompt's media: patches, grids, the prompt index of every media token, and (once
    encoded) one embedding row per media token, kept until the request ends.

    Images and videos are items in prompt order: `pixel_values` holds their patches and
    `image_grid_thw` one (t, h, w) row each, so the encoder runs a request's media as one job
    (a video is an item of t temporal patches; transformers passes its patches apart, as
    ``pixel_values_videos``). `video_items` are the rows that are videos and
    `second_per_grid_ts` their seconds per temporal patch (Qwen2.5-VL's M-RoPE).
    `content_hashes` has one hash per item (decoded pixels and processor settings); the input
    module gives them, else they are computed from the patches when first asked for.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: np.ndarray  # sorted prompt indices of the media tokens; row i of embeds <-> [i]
    embeds: torch.Tensor | None = None
    video_items: tuple[int, ...] = ()
    second_per_grid_ts: tuple[float, ...] = ()
    hashes: tuple[str, ...] | None = None

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

    def grid_of(self, kind: str) -> torch.Tensor | None:
        """The grid rows of the images or of the videos (``kind`` "image" / "video"), in prompt
        order, or None when there are none."""
        videos = set(self.video_items)
        rows = [i for i in range(self.num_items) if (i in videos) == (kind == "video")]
        return self.image_grid_thw[rows] if rows else None

    @property
    def content_hashes(self) -> tuple[str, ...]:
        """One content hash per item, in prompt order."""
        if self.hashes is None:
            import hashlib

            out, start = [], 0
            for row in self.image_grid_thw.tolist():
                n = row[0] * row[1] * row[2]
                h = hashlib.blake2b(digest_size=16, person=b"ss-patches")
                h.update(repr((row, str(self.pixel_values.dtype))).encode())
                h.update(self.pixel_values[start:start + n].detach().cpu().contiguous()
                         .view(torch.uint8).numpy().tobytes())
                out.append(h.hexdigest())
                start += n
            self.hashes = tuple(out)
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
    """Monotonic-clock timestamps (seconds): arrival, first token, every token, finish."""

    arrival_time: float
    first_token_time: float | None
    token_times: tuple[float, ...]
    finished_time: float | None
    num_preemptions: int = 0


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
    (None for the model's end-of-sequence token or another reason).
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
        "stop_reason", "min_len",
    )

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
                              self.finished_time, self.num_preemptions)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
                f" out={self.num_output_tokens}, computed={self.num_computed})")
