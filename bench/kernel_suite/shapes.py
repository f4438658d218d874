"""Problem sizes of the kernel suite, read from the model presets' configs, and the SM budgets.

Two profiles:
- ``gpu``: Qwen2-VL-7B and Qwen2-VL-72B (the same vision tower; LLM hidden 3584 / 8192, heads
  28/4 and 64/8 at D=128), a 1280x720 plus a 448x448 image per vision batch (4784 + 1024
  patches), 2048-token prefill chunks, decode batches of 32 at a mean context of 4096; bf16.
  Qwen3-VL-8B too (``q3-8b``: LLM hidden 4096, heads 32/8 at D=128 with the per-head q/k norm;
  its own vision tower: width 1152, 16 heads of 72, GELU-tanh MLP 4304, 16-px patches, so the
  same two images are 3520 + 784 patches, and 3 DeepStack mergers besides the final one).
- ``cpu``: a tiny Qwen2-VL config run through the Triton interpreter (fp16 and fp32): the same
  kernels and plumbing on problems small enough for a smoke test.

Budgets are 1/8, 1/4, 1/2 of the device and the whole device; inside green-context partitions
(SM groups of 8 on Hopper) the fractions are rounded down to a multiple of 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FRACTIONS = ((1, 8), (1, 4), (1, 2), (1, 1))
DTYPES = {"gpu": ("bf16",), "cpu": ("fp16", "fp32")}


@dataclass(frozen=True)
class Budget:
    """An SM budget of the sweep: `sms` requested, `fraction` of the device it stands for."""

    sms: int
    fraction: str

    @property
    def id(self) -> str:
        return f"budget{self.sms}"


def budgets(total_sms: int, granularity: int = 1) -> list[Budget]:
    """The sweep's budgets on a device of `total_sms` SMs (distinct, ascending)."""
    out: dict[int, Budget] = {}
    for num, den in FRACTIONS:
        if num == den:
            sms, label = total_sms, "full"
        else:
            sms = total_sms * num // den // granularity * granularity
            sms, label = max(sms, min(granularity, total_sms)), f"{num}/{den}"
        out.setdefault(sms, Budget(sms, label))
    return sorted(out.values(), key=lambda b: b.sms)


@dataclass(frozen=True)
class ModelDims:
    """What the kernels' sizes depend on, read from a Qwen2-VL config."""

    name: str
    vision_embed: int
    vision_heads: int
    vision_mlp: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    mrope_section: tuple[int, ...]
    vision_act: str = "quick_gelu"  # the ViT MLP's activation
    patch_size: int = 14
    deepstack: int = 0  # DeepStack mergers (Qwen3-VL)
    qk_norm: bool = False  # RMSNorm per q / k head (the Qwen3 decoder)

    @property
    def vision_head_dim(self) -> int:
        return self.vision_embed // self.vision_heads

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @classmethod
    def from_config(cls, config: Any, name: str) -> ModelDims:
        from spaceserve.runtime.policy.analytic.model import ModelShape

        s = ModelShape.from_config(config, name)
        rope = getattr(config.text_config, "rope_parameters", None) or {}
        section = tuple(rope.get("mrope_section") or (s.head_dim // 2, 0, 0))
        act = getattr(config.vision_config, "hidden_act", "quick_gelu")
        act = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}.get(act, act)
        return cls(name, s.vision_embed, s.vision_heads, s.vision_mlp, s.hidden, s.intermediate,
                   s.heads, s.kv_heads, s.head_dim, section, act,
                   config.vision_config.patch_size, s.vision_deepstack, s.qk_norm)


@dataclass(frozen=True)
class Workload:
    """Batch sizes of one profile: vision images (t, h, w patches), prefill and decode."""

    vit_grids: tuple[tuple[int, int, int], ...]
    prefill_tokens: int
    decode_lens: tuple[int, ...]
    chunk_new: tuple[int, ...]
    chunk_total: tuple[int, ...]
    block_size: int = 16
    # the same images on 16-px patches (Qwen3-VL); empty: the profile has no such model
    vit_grids_16: tuple[tuple[int, int, int], ...] = ()

    @property
    def vit_segments(self) -> tuple[int, ...]:
        return tuple(t * h * w for t, h, w in self.vit_grids)

    def grids(self, patch_size: int) -> tuple[tuple[int, int, int], ...]:
        """The vision batch's grids for a tower of `patch_size`-px patches."""
        return self.vit_grids_16 if patch_size == 16 else self.vit_grids


def _qwen2_vl_config(hidden: int, inter: int, layers: int, heads: int, kv: int,
                     vision: dict[str, Any] | None = None,
                     section: tuple[int, int, int] = (16, 24, 24)) -> Any:
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=152064, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": list(section)})
    vis = dict(depth=32, embed_dim=1280, hidden_size=hidden, num_heads=16, mlp_ratio=4,
               hidden_act="quick_gelu", patch_size=14, spatial_merge_size=2,
               temporal_patch_size=2, in_channels=3)
    vis.update(vision or {})
    return Qwen2VLConfig(text_config=text, vision_config=vis, image_token_id=151655,
                         video_token_id=151656, vision_start_token_id=151652,
                         vision_end_token_id=151653)


def tiny_config() -> Any:
    """A tiny Qwen2-VL (interpreter-sized): vision 64 wide (2 heads of 32), LLM 64 wide
    (4 heads / 2 KV heads of 16)."""
    return _qwen2_vl_config(64, 128, 2, 4, 2, vision=dict(depth=2, embed_dim=64, num_heads=2,
                                                          mlp_ratio=2), section=(2, 3, 3))


def models(profile: str) -> dict[str, ModelDims]:
    """Model dims of a profile by short name ("7b", "72b" on the GPU; "tiny" on CPU)."""
    if profile == "gpu":
        from spaceserve.models.presets import get_preset

        return {size: ModelDims.from_config(get_preset(key).hf_config(), key)
                for size, key in (("7b", "qwen2-vl-7b"), ("72b", "qwen2-vl-72b"),
                                  ("q3-8b", "qwen3-vl-8b"))}
    return {"tiny": ModelDims.from_config(tiny_config(), "qwen2-vl-tiny")}


def workload(profile: str) -> Workload:
    if profile == "gpu":
        # 1280x720 -> 52x92 patches, 448x448 -> 32x32 (16-px: 44x80, 28x28); decode contexts
        # 2048..6144 (mean 4096)
        decode = tuple(2048 + (i * 4096 + 15) // 31 for i in range(32))
        return Workload(((1, 52, 92), (1, 32, 32)), 2048, decode, (1536, 512), (3584, 512),
                        vit_grids_16=((1, 44, 80), (1, 28, 28)))
    return Workload(((1, 4, 6), (1, 4, 4)), 24, (1, 40, 77, 13), (5, 11), (20, 11))
