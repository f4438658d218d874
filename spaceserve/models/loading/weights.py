"""Where a model's tensors come from, and the getter that hands each rank its shards.

A *source* maps internal names (``visual.*``, ``language.*``, ``lm_head.*``; see
`canonical_name`) to tensors and reads a slice of one on request: an in-memory state dict
(`MemorySource`), a checkpoint's safetensors files (`SafetensorsSource`: ``safe_open`` and
``get_slice``, so a rank materialises only the rows / columns it holds and never a whole file),
or random weights (`RandomSource`: each tensor drawn from its own seeded generator, so any rank
can draw any tensor alone and every rank sees the same values).

`shard_getter` turns a source into the ``weight(name, rows=None)`` getter the models call:
this rank's slice (`parallel.text_shard`), or the full rows ``[a, b)`` with ``rows=(a, b)``,
cast to the model's dtype and device. It counts the bytes it materialised from the source
(`LoadStats`), which is how the sharded loading is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.models.parallel import TensorParallel, text_shard

Tensor = torch.Tensor

# Checkpoint key prefixes (old hub layout and transformers 5.x layout) -> internal prefixes.
_PREFIXES = (
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.language_model.", "language."),
    ("language_model.model.", "language."),
    ("model.", "language."),
    ("lm_head.", "lm_head."),
)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}
_EMBED = "language.embed_tokens.weight"


def canonical_name(key: str) -> str | None:
    """Internal name of a checkpoint key (``visual.*``, ``language.*``, ``lm_head.*``)."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return None


@dataclass
class LoadStats:
    """What building a model read from its weight source: tensors and bytes (as stored)."""

    tensors: int = 0
    bytes: int = 0


class MemorySource:
    """Tensors already in memory (a state dict, either checkpoint layout)."""

    def __init__(self, state_dict: Mapping[str, Tensor]) -> None:
        self.tensors: dict[str, Tensor] = {}
        for key, t in state_dict.items():
            name = canonical_name(key)
            if name is not None:
                self.tensors[name] = t

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self) -> torch.dtype | None:
        first = next(iter(self.tensors.values()), None)
        return None if first is None else first.dtype

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        t = self.tensors[name]
        return t if index is None else t[index]


class SafetensorsSource:
    """The safetensors files of a checkpoint directory, opened lazily (headers only) and read
    tensor by tensor, slice by slice. Use as a context manager (closes the files)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{path}: no .safetensors weights found")
        self._stack = contextlib.ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(os.path.join(path, file), "pt",
                                                         device="cpu"))
            for key in handle.keys():
                name = canonical_name(key)
                if name is not None:
                    self._where[name] = (handle, key)

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        handle, key = self._where[name]
        return tuple(handle.get_slice(key).get_shape())

    def dtype(self) -> torch.dtype | None:
        for handle, key in self._where.values():
            return _SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())
        return None

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        handle, key = self._where[name]
        if index is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]


def random_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float,
                  device: torch.device) -> Tensor:
    """The fp32 random weight `name` of seed `seed`: matrices and biases ~ N(0, std), norm
    weights ~ 1 + N(0, std); drawn from a generator seeded by (seed, name) alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
    if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
        w = w + 1.0
    return w


class RandomSource:
    """Random weights of given shapes (hub-layout names), each drawn on `device` when read."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], *, seed: int, std: float,
                 device: torch.device) -> None:
        self._shapes = {canonical_name(k): (k, s) for k, s in shapes.items()
                        if canonical_name(k) is not None}
        self.seed, self.std, self.device = seed, std, device

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name][1])

    def dtype(self) -> torch.dtype | None:
        return torch.float32

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        key, shape = self._shapes[name]
        t = random_tensor(key, shape, seed=self.seed, std=self.std, device=self.device)
        return t if index is None else t[index].clone()


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)
                or getattr(config.text_config, "tie_word_embeddings", False))


def shard_getter(source: Any, config: Any, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, stats: LoadStats
                 ) -> Callable[..., Tensor]:
    """The ``weight(name, rows=None)`` getter over `source` for rank `tp` (module docstring).
    A missing ``lm_head.weight`` reads the embedding when the config ties them (ValueError
    otherwise); the embedding shard read for both is read once."""
    names = set(source.names())
    memo: dict[tuple[str, Any], Tensor] = {}

    def weight(name: str, rows: tuple[int, int] | None = None) -> Tensor:
        key = name
        if name == "lm_head.weight" and name not in names and _EMBED in names:
            if not _tied(config):
                raise ValueError("the checkpoint has no lm_head.weight and the config does not "
                                 "tie word embeddings")
            key = _EMBED
        if key not in names:
            raise ValueError(f"the checkpoint has no tensor for {name!r}")
        shape = source.shape(key)
        if rows is not None:
            index: tuple[slice, ...] | None = (slice(*rows),)
        elif key.startswith("language.") or key.startswith("lm_head."):
            short = key[len("language."):] if key.startswith("language.") else key
            index = text_shard(short, shape, config.text_config, tp)
        else:
            index = None
        memo_key = (key, None if index is None else tuple((s.start, s.stop) for s in index))
        if key == _EMBED and memo_key in memo:
            return memo[memo_key]
        t = source.read(key, index)
        stats.tensors += 1
        stats.bytes += t.numel() * t.element_size()
        out = t.to(device=device, dtype=dtype, copy=index is not None).contiguous()
        if key == _EMBED:
            memo[memo_key] = out
        return out

    return weight


def iter_random(shapes: Mapping[str, tuple[int, ...]], *, seed: int, std: float,
                device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """(hub name, fp32 tensor) for every shape, as `RandomSource` draws them."""
    for key, shape in shapes.items():
        yield key, random_tensor(key, shape, seed=seed, std=std, device=device)
