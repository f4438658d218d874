"""Building Qwen2-VL, Qwen2.5-VL and Qwen3-VL: from a local checkpoint directory, from a state
dict, or with random weights from a config (benchmarks). Configs are transformers' own
`Qwen2VLConfig` / `Qwen2_5_VLConfig` / `Qwen3VLConfig`; the architecture follows the config's
``model_type``.

Every builder takes ``tp=TensorParallel(rank, size)`` and a `comm` (`parallel.Communicator`) to
build one rank's shard of a tensor-parallel model: a checkpoint is then read slice by slice
with safetensors' ``get_slice`` (`weights.py`), so a rank materialises only what it holds. The
model's ``load_stats`` say how many bytes were read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from spaceserve.models.attention.backends import AttentionBackend
from spaceserve.models.loading.weights import (
    LoadStats,
    MemorySource,
    RandomSource,
    SafetensorsSource,
    canonical_name,
    iter_random,
    shard_getter,
)
from spaceserve.models.parallel import Communicator, TensorParallel, check_text_config
from spaceserve.models.qwen2_5_vl import Qwen25VL
from spaceserve.models.qwen2_5_vl_vision import vision_weight_shapes
from spaceserve.models.qwen2_vl import Qwen2VL
from spaceserve.models.qwen3_vl.model import Qwen3VL
from spaceserve.models.qwen3_vl.text import text_weight_shapes
from spaceserve.models.qwen3_vl.vision import vision_weight_shapes as qwen3_vision_shapes

Tensor = torch.Tensor
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MODEL_CLASSES: dict[str, type[Qwen2VL]] = {"qwen2_vl": Qwen2VL, "qwen2_5_vl": Qwen25VL,
                                           "qwen3_vl": Qwen3VL}
__all__ = ["SUPPORTED_MODEL_TYPES", "canonical_name", "config_class", "from_config",
           "from_pretrained", "from_state_dict", "random_state_dict", "weight_shapes"]


def _resolve_dtype(dtype: Any, fallback: torch.dtype) -> torch.dtype:
    if dtype is None:
        return fallback
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype={dtype!r} is not a torch dtype")


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def config_class(model_type: str) -> Any:
    """transformers' config class of a supported `model_type`."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    return {"qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_vl": Qwen3VLConfig}.get(model_type,
                                                                           Qwen2VLConfig)


def _as_config(config: Any) -> Any:
    if isinstance(config, Mapping):
        model_type = config.get("model_type", "qwen2_vl")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; SpaceServe runs "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        return config_class(model_type)(**{k: v for k, v in config.items()
                                           if k != "model_type"})
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; SpaceServe runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def _build(config: Any, source: Any, *, attention_backend: str | AttentionBackend,
           dtype: torch.dtype | str | None, device: Any, dense_ops: str | None,
           tp: TensorParallel | None, comm: Communicator | None) -> Qwen2VL:
    tp = tp or TensorParallel()
    if tp.size > 1:
        check_text_config(config.text_config, tp)
    dt = _resolve_dtype(dtype, source.dtype() or torch.float32)
    dev = _resolve_device(device)
    stats = LoadStats()
    weight = shard_getter(source, config, tp, dt, dev, stats)
    model = MODEL_CLASSES[config.model_type](config, weight, attention_backend=attention_backend,
                                             dtype=dt, device=dev, dense_ops=dense_ops, tp=tp,
                                             comm=comm)
    model.load_stats = stats
    return model


def from_state_dict(config: Any, state_dict: Mapping[str, Tensor], *,
                    attention_backend: str | AttentionBackend = "triton",
                    dtype: torch.dtype | str | None = None, device: Any = None,
                    dense_ops: str | None = None, tp: TensorParallel | None = None,
                    comm: Communicator | None = None) -> Qwen2VL:
    """Build from tensors named as transformers names them (either checkpoint layout); a
    Qwen2.5-VL config gives a `Qwen25VL`. With `tp`, this rank's shard (module docstring)."""
    return _build(_as_config(config), MemorySource(state_dict),
                  attention_backend=attention_backend, dtype=dtype, device=device,
                  dense_ops=dense_ops, tp=tp, comm=comm)


def from_pretrained(path: str | os.PathLike, *,
                    attention_backend: str | AttentionBackend = "triton",
                    dtype: torch.dtype | str | None = None, device: Any = None,
                    dense_ops: str | None = None, tp: TensorParallel | None = None,
                    comm: Communicator | None = None) -> Qwen2VL:
    """Load a local checkpoint directory (config.json + safetensors, as save_pretrained writes
    it; no hub access), tensor by tensor, and with `tp` only this rank's slices. `dtype`
    defaults to the checkpoint's, `device` to CUDA when present. Raises ValueError for an
    unsupported architecture, an unknown backend, or head counts that do not split over `tp`."""
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json (expected a local checkpoint directory)")
    with open(cfg_file) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(raw.get("architectures") or []) or "unknown architecture"
        raise ValueError(f"{path}: model_type {model_type!r} ({arch}) is not supported; "
                         f"SpaceServe runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    config = config_class(model_type).from_pretrained(path)
    if dtype is None:
        stored = raw.get("dtype") or raw.get("torch_dtype")
        dtype = stored if isinstance(stored, str) else None
    with SafetensorsSource(path) as source:
        return _build(config, source, attention_backend=attention_backend, dtype=dtype,
                      device=device, dense_ops=dense_ops, tp=tp, comm=comm)


def _qwen2_vl_vision_shapes(v: Any) -> dict[str, tuple[int, ...]]:
    e, m = int(v.embed_dim), int(v.embed_dim * v.mlp_ratio)
    merged = e * int(v.spatial_merge_size) ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (e, v.in_channels, v.temporal_patch_size,
                                           v.patch_size, v.patch_size),
        "visual.merger.ln_q.weight": (e,), "visual.merger.ln_q.bias": (e,),
        "visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (v.hidden_size, merged),
        "visual.merger.mlp.2.bias": (v.hidden_size,),
    }
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        shapes.update({p + "norm1.weight": (e,), p + "norm1.bias": (e,),
                       p + "norm2.weight": (e,), p + "norm2.bias": (e,),
                       p + "attn.qkv.weight": (3 * e, e), p + "attn.qkv.bias": (3 * e,),
                       p + "attn.proj.weight": (e, e), p + "attn.proj.bias": (e,),
                       p + "mlp.fc1.weight": (m, e), p + "mlp.fc1.bias": (m,),
                       p + "mlp.fc2.weight": (e, m), p + "mlp.fc2.bias": (e,)})
    return shapes


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Names (transformers' hub layout) and shapes of every Qwen2-VL / Qwen2.5-VL / Qwen3-VL
    weight."""
    config = _as_config(config)
    v, t = config.vision_config, config.text_config
    if config.model_type == "qwen3_vl":
        return {**qwen3_vision_shapes(v), **text_weight_shapes(config)}
    if config.model_type == "qwen2_5_vl":
        shapes = vision_weight_shapes(v)
    else:
        shapes = _qwen2_vl_vision_shapes(v)
    h, n_q = int(t.hidden_size), int(t.num_attention_heads)
    n_kv, d = int(t.num_key_value_heads or n_q), int(t.hidden_size) // n_q
    inter, vocab = int(t.intermediate_size), int(t.vocab_size)
    shapes["model.embed_tokens.weight"] = (vocab, h)
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (n_q * d, h),
                       p + "self_attn.q_proj.bias": (n_q * d,),
                       p + "self_attn.k_proj.weight": (n_kv * d, h),
                       p + "self_attn.k_proj.bias": (n_kv * d,),
                       p + "self_attn.v_proj.weight": (n_kv * d, h),
                       p + "self_attn.v_proj.bias": (n_kv * d,),
                       p + "self_attn.o_proj.weight": (h, n_q * d),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def random_state_dict(config: Any, *, dtype: torch.dtype | str | None = None,
                      device: Any = None, seed: int = 0, std: float = 0.02
                      ) -> dict[str, Tensor]:
    """Random weights in the hub layout, generated on `device`: matrices and biases
    ~ N(0, std), norm weights ~ 1 + N(0, std); each tensor from a generator seeded by
    (`seed`, its name), so `from_config` gives the same weights, whole or sharded."""
    config = _as_config(config)
    dt = _resolve_dtype(dtype, torch.float32)
    dev = _resolve_device(device)
    return {name: w.to(dt) for name, w in iter_random(weight_shapes(config), seed=seed,
                                                      std=std, device=dev)}


def from_config(config: Any, *, attention_backend: str | AttentionBackend = "triton",
                dtype: torch.dtype | str | None = None, device: Any = None,
                dense_ops: str | None = None, seed: int = 0, std: float = 0.02,
                tp: TensorParallel | None = None, comm: Communicator | None = None) -> Qwen2VL:
    """Random weights for `config` (a Qwen2VLConfig / Qwen2_5_VLConfig or its dict), for
    benchmarks; those of `random_state_dict`, drawn one tensor at a time (with `tp`, each rank
    keeps only its slices)."""
    config = _as_config(config)
    dt = _resolve_dtype(dtype, torch.float32)
    dev = _resolve_device(device)
    source = RandomSource(weight_shapes(config), seed=seed, std=std, device=dev)
    return _build(config, source, attention_backend=attention_backend, dtype=dt, device=dev,
                  dense_ops=dense_ops, tp=tp, comm=comm)
