"""Requests, sampling parameters and outputs of the SpaceServe engine.

A `Request` is the engine's mutable record of one prompt's life: its tokens (prompt, then the
generated ones), how many of them are in the KV cache, the KV blocks it holds, its image
embeddings, and its timings. `SamplingParams` and `RequestOutput` are the public face.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FINISH_REASONS = ("stop", "length", "abort", "error")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request; every field is validated (ValueError names it).

    temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature)
    restricted to the smallest set whose probability reaches `top_p`. The draw for the token at
    sequence index ``i`` depends only on (seed, i), so batching and preemption never change it;
    without a seed the engine picks one at arrival.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{name}={value} must be finite")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError("stop_token_ids must be a sequence of ints")
        object.__setattr__(
            self, "stop_token_ids", tuple(_check_int("stop_token_ids", t, 0) for t in ids)
        )


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class MultiModalData:
    """A prompt's images: patches, grids, the prompt index of every image token, and (once
    encoded) one embedding row per image token, kept until the request ends."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: np.ndarray  # sorted prompt indices of the image tokens; row i of embeds <-> [i]
    embeds: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic-clock timestamps (seconds): arrival, first token, every token, finish."""

    arrival_time: float
    first_token_time: float | None
    token_times: tuple[float, ...]
    finished_time: float | None
    num_preemptions: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """What a request has produced so far. `token_ids` are all generated tokens;
    `new_token_ids` those since the previous output of the same request (streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    error: str | None
    metrics: RequestMetrics
    extra: dict[str, Any] = field(default_factory=dict)


class Request:
    """The engine's record of one request (plain slots: it is touched every step)."""

    __slots__ = (
        "request_id", "seq_no", "params", "seed", "token_ids", "num_prompt_tokens", "mm",
        "status", "num_computed", "block_ids", "row", "synced_blocks", "finish_reason",
        "error", "arrival_time", "first_token_time", "token_times", "finished_time",
        "num_preemptions", "num_emitted", "sink", "stream", "model_state", "stop_ids",
        "limit_len",
    )

    def __init__(self, request_id: str, seq_no: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, mm: MultiModalData | None = None,
                 arrival_time: float = 0.0) -> None:
        self.request_id = request_id
        self.seq_no = seq_no
        self.params = params
        self.seed = seed
        self.token_ids = list(prompt_token_ids)
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

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_token_time, tuple(self.token_times),
                              self.finished_time, self.num_preemptions)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
                f" out={self.num_output_tokens}, computed={self.num_computed})")


# Input processing: prompts in, validated token ids and images out (ValueError on bad input).


def load_image(item: Any, index: int) -> Any:
    """Decode one image: a PIL image, encoded bytes, a ``data:`` URL, a ``file://`` URL or a
    path. Raises ValueError naming ``images[index]`` when it cannot be decoded."""
    import base64
    import io

    from PIL import Image

    try:
        if isinstance(item, Image.Image):
            img = item
        elif isinstance(item, (bytes, bytearray)):
            img = Image.open(io.BytesIO(item))
        elif isinstance(item, str) and item.startswith("data:"):
            img = Image.open(io.BytesIO(base64.b64decode(item.split(",", 1)[1], validate=True)))
        elif isinstance(item, str):
            img = Image.open(item.removeprefix("file://"))
        else:
            raise TypeError(f"unsupported image type {type(item).__name__}")
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # PIL raises many types; all mean "not an image"
        raise ValueError(f"images[{index}] cannot be decoded: {type(exc).__name__}: {exc}") from exc


def _grid(value: Any) -> torch.Tensor:
    # Host metadata: the planner and the vision tower read it on the host every step, so a
    # device tensor is brought over once here rather than synchronised on later.
    grid = torch.as_tensor(value).to(device="cpu", dtype=torch.int64)
    if grid.dim() == 1 and grid.numel() == 3:
        grid = grid.view(1, 3)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [num_images, 3], got {tuple(grid.shape)}")
    if grid.numel() and int(grid.min()) < 1:
        raise ValueError("image_grid_thw holds a non-positive size")
    return grid


def process_prompt(prompt: Any, info: Any, *, context_len: int, capacity: int, max_images: int,
                   processor: Any = None, tokenizer: Any = None
                   ) -> tuple[list[int], MultiModalData | None]:
    """Validate a prompt against the model (`info`: a runner's ModelInfo) and the engine limits.

    A prompt is ``{"prompt_token_ids", "pixel_values"?, "image_grid_thw"?}`` (image tokens
    already expanded) or ``{"prompt": str, "images": [...]}`` / a bare string when a processor
    exists (a tokenizer alone takes text without images). Returns (token ids, images or None);
    raises ValueError with the reason.
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"prompt must be a dict or a str, got {type(prompt).__name__}")
    if "prompt_token_ids" in prompt:
        ids, pv, grid = prompt["prompt_token_ids"], prompt.get("pixel_values"), \
            prompt.get("image_grid_thw")
    elif "prompt" in prompt:
        images = list(prompt.get("images") or [])
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt must be a str")
        if processor is None and tokenizer is not None and not images:
            return process_prompt({"prompt_token_ids": tokenizer.encode(prompt["prompt"])},
                                  info, context_len=context_len, capacity=capacity,
                                  max_images=max_images)
        if processor is None:
            what = "an image processor" if tokenizer is not None else "a tokenizer"
            raise ValueError(f"prompt: this needs {what}, and this checkpoint has none; pass "
                             "prompt_token_ids (and pixel_values / image_grid_thw)")
        if len(images) > max_images:
            raise ValueError(f"images: {len(images)} images, more than allowed "
                             f"(max_images_per_prompt={max_images})")
        decoded = [load_image(x, i) for i, x in enumerate(images)]
        enc = processor(text=[prompt["prompt"]], images=decoded or None, return_tensors="pt")
        ids, pv, grid = enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw")
    else:
        raise ValueError("prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError("prompt_token_ids must be a sequence of ints")
    ids = [_check_int("prompt_token_ids", t, 0) for t in ids]
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    if max(ids) >= info.vocab_size:
        raise ValueError(f"prompt_token_ids holds {max(ids)}, outside the vocabulary "
                         f"({info.vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"prompt_token_ids has {len(ids)} tokens; the context holds "
                         f"{context_len} (max_model_len), leaving no room to generate")
    if len(ids) >= capacity:
        raise ValueError(f"prompt of {len(ids)} tokens can never fit in the KV cache "
                         f"({capacity} tokens in all)")
    img_tok = info.image_token_id
    num_img_tokens = 0 if img_tok is None else sum(1 for t in ids if t == img_tok)
    if pv is None and grid is None:
        if num_img_tokens:
            raise ValueError(f"prompt_token_ids holds {num_img_tokens} image tokens but no "
                             "pixel_values / image_grid_thw were given")
        return ids, None
    if pv is None or grid is None:
        missing = "pixel_values" if pv is None else "image_grid_thw"
        raise ValueError(f"{missing} is missing (images need pixel_values and image_grid_thw)")
    if img_tok is None:
        raise ValueError("pixel_values: this model takes no images")
    grid = _grid(grid)
    if grid.shape[0] > max_images:
        raise ValueError(f"image_grid_thw: {grid.shape[0]} images, more than allowed "
                         f"(max_images_per_prompt={max_images})")
    merge = info.spatial_merge_size
    if bool(((grid[:, 1:] % merge) != 0).any()):
        raise ValueError(f"image_grid_thw: h and w must be multiples of the merge size {merge}")
    if not isinstance(pv, torch.Tensor) or pv.dim() != 2:
        raise ValueError("pixel_values must be a 2-D tensor [patches, patch_dim]")
    patches = int(grid.prod(dim=1).sum())
    if pv.shape[0] != patches:
        raise ValueError(f"pixel_values has {pv.shape[0]} patch rows; image_grid_thw needs "
                         f"{patches}")
    if info.patch_dim is not None and pv.shape[1] != info.patch_dim:
        raise ValueError(f"pixel_values rows have {pv.shape[1]} values; the model expects "
                         f"{info.patch_dim}")
    if num_img_tokens != patches // merge**2:
        raise ValueError(f"prompt_token_ids holds {num_img_tokens} image tokens; "
                         f"image_grid_thw gives {patches // merge**2}")
    positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == img_tok)
    return ids, MultiModalData(pv, grid, positions)
