"""Model presets: the published shapes of Qwen2-VL 2B/7B/72B, Qwen2.5-VL 3B/7B/72B and Qwen3-VL
2B/4B/8B/32B (dense), in one place.

Everything that needs a real model's dimensions without its checkpoint reads them here: the
analytic resource-utility curves and the simulator (`spaceserve sim --model`), autotune's
shapes, the kernel demo's and the kernel suite's big shapes, and the GPU benchmarks (random
weights of a preset's shape). Pure Python: nothing heavy is imported until `hf_config` builds a
transformers config, offline (no hub access).

Vision towers: Qwen2-VL's is a LayerNorm + quick-GELU MLP (``mlp_ratio`` 4) ViT whose merger
projects to the LLM's width; Qwen2.5-VL's is an RMSNorm + SwiGLU ViT (intermediate 3420) that
attends within 112-px windows except in blocks 7, 15, 23 and 31, merged to the LLM's width
(``out_hidden``). Both: depth 32, width 1280, 16 heads, 14-px patches, 2-frame temporal patches,
2x2 spatial merge. Qwen3-VL's is a LayerNorm + tanh-GELU MLP ViT on 16-px patches (learned
position embeddings, no window attention) whose final merger and the DeepStack mergers (one per
``deepstack`` block, each a LayerNorm + 2-layer MLP over 2x2-merged patches to the LLM width) feed
the decoder; its decoder has 128-wide heads whatever the width (q/k RMSNorm per head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653


@dataclass(frozen=True)
class TextShape:
    """The language model's dimensions."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    max_positions: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    head_size: int = 0  # width of one attention head; 0: hidden // heads (Qwen2 decoders)
    mrope_interleaved: bool = False  # Qwen3-VL: t/h/w frequencies interleaved, not in blocks

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's dimensions. ``intermediate`` is the MLP width (``embed * mlp_ratio``
    for Qwen2-VL's GELU MLP, the SwiGLU width for Qwen2.5-VL's); ``out_hidden`` the merger's
    output width, the LLM's hidden size."""

    depth: int
    embed: int
    heads: int
    intermediate: int
    out_hidden: int
    gated: bool  # SwiGLU MLP + RMSNorm (Qwen2.5-VL), else GELU MLP + LayerNorm (Qwen2-VL, 3-VL)
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    merge: int = 2
    window_size: int = 0  # pixels per attention window side (0: every block attends fully)
    fullatt_blocks: tuple[int, ...] = ()
    tokens_per_second: int = 2  # Qwen2.5-VL video: temporal positions per second
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output a DeepStack merger takes
    position_embeddings: int = 0  # Qwen3-VL: learned position table (interpolated per grid)
    # the hub image processor's pixel range (an image is resized into it)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384

    @property
    def mlp_ratio(self) -> float:
        return self.intermediate / self.embed

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True)
class ModelPreset:
    """One published model: its display name, family and shapes."""

    name: str
    family: str
    text: TextShape
    vision: VisionShape
    token_ids: dict[str, int] = field(default_factory=lambda: {
        "image_token_id": IMAGE_TOKEN_ID, "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID,
        "vision_end_token_id": VISION_END_TOKEN_ID})

    def hf_config(self) -> Any:
        """The transformers config of this preset (Qwen2VLConfig / Qwen2_5_VLConfig /
        Qwen3VLConfig)."""
        t, v = self.text, self.vision
        text = dict(vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.intermediate,
                    num_hidden_layers=t.layers, num_attention_heads=t.heads,
                    num_key_value_heads=t.kv_heads, rms_norm_eps=t.rms_norm_eps,
                    max_position_embeddings=t.max_positions,
                    rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                     "mrope_section": list(t.mrope_section)})
        common = dict(depth=v.depth, num_heads=v.heads, patch_size=v.patch_size,
                      spatial_merge_size=v.merge, temporal_patch_size=v.temporal_patch_size,
                      in_channels=v.in_channels)
        if self.family == "qwen3_vl":
            from transformers import Qwen3VLConfig as Config

            text |= dict(head_dim=t.head_dim, tie_word_embeddings=t.tied_embeddings)
            text["rope_parameters"]["mrope_interleaved"] = t.mrope_interleaved
            vision = common | dict(hidden_size=v.embed, intermediate_size=v.intermediate,
                                   out_hidden_size=v.out_hidden, hidden_act="gelu_pytorch_tanh",
                                   num_position_embeddings=v.position_embeddings,
                                   deepstack_visual_indexes=list(v.deepstack))
        elif self.family == "qwen2_vl":
            from transformers import Qwen2VLConfig as Config

            vision = common | dict(embed_dim=v.embed, hidden_size=v.out_hidden,
                                   mlp_ratio=v.intermediate // v.embed, hidden_act="quick_gelu")
        else:
            from transformers import Qwen2_5_VLConfig as Config

            vision = common | dict(hidden_size=v.embed, intermediate_size=v.intermediate,
                                   out_hidden_size=v.out_hidden, hidden_act="silu",
                                   window_size=v.window_size,
                                   fullatt_block_indexes=list(v.fullatt_blocks),
                                   tokens_per_second=v.tokens_per_second)
        return Config(text_config=text, vision_config=vision,
                      tie_word_embeddings=t.tied_embeddings, **self.token_ids)


def _qwen2_vl_vision(out_hidden: int) -> VisionShape:
    return VisionShape(depth=32, embed=1280, heads=16, intermediate=4 * 1280,
                       out_hidden=out_hidden, gated=False)


def _qwen2_5_vl_vision(out_hidden: int) -> VisionShape:
    return VisionShape(depth=32, embed=1280, heads=16, intermediate=3420, out_hidden=out_hidden,
                       gated=True, window_size=112, fullatt_blocks=(7, 15, 23, 31))


def _qwen3_vl_vision(out_hidden: int, large: bool) -> VisionShape:
    """Qwen3-VL's vision tower: the 2B and 4B models carry a 24-block, 1024-wide one (DeepStack
    taps after blocks 5, 11, 17), the 8B and 32B a 27-block, 1152-wide one (taps 8, 16, 24)."""
    if large:
        return VisionShape(depth=27, embed=1152, heads=16, intermediate=4304,
                           out_hidden=out_hidden, gated=False, patch_size=16,
                           deepstack=(8, 16, 24), position_embeddings=2304,
                           min_pixels=65536, max_pixels=16777216)
    return VisionShape(depth=24, embed=1024, heads=16, intermediate=4096, out_hidden=out_hidden,
                       gated=False, patch_size=16, deepstack=(5, 11, 17),
                       position_embeddings=2304, min_pixels=65536, max_pixels=16777216)


def _qwen3_text(hidden: int, layers: int, heads: int, intermediate: int, tied: bool
                ) -> TextShape:
    return TextShape(hidden, layers, heads, 8, intermediate, 151936, tied_embeddings=tied,
                     max_positions=262144, rope_theta=5e6, mrope_section=(24, 20, 20),
                     head_size=128, mrope_interleaved=True)


# Qwen3-VL shapes as published in the Qwen/Qwen3-VL-*-Instruct config.json files, written here
# from memory (no hub access): the 8B's are the most certain (they are also transformers'
# Qwen3VLConfig defaults for the vision tower). Less certain: the 2B's intermediate size (6144)
# and the small vision tower of the 2B/4B (depth 24, width 1024, MLP 4096, taps 5/11/17); the
# image processor's pixel range (65536 to 16777216, its preprocessor_config.json ``size``).
PRESETS: dict[str, ModelPreset] = {
    "qwen2-vl-2b": ModelPreset(
        "Qwen2-VL-2B", "qwen2_vl",
        TextShape(1536, 28, 12, 2, 8960, 151936, tied_embeddings=True), _qwen2_vl_vision(1536)),
    "qwen2-vl-7b": ModelPreset(
        "Qwen2-VL-7B", "qwen2_vl", TextShape(3584, 28, 28, 4, 18944, 152064),
        _qwen2_vl_vision(3584)),
    "qwen2-vl-72b": ModelPreset(
        "Qwen2-VL-72B", "qwen2_vl", TextShape(8192, 80, 64, 8, 29568, 152064),
        _qwen2_vl_vision(8192)),
    "qwen2.5-vl-3b": ModelPreset(
        "Qwen2.5-VL-3B", "qwen2_5_vl",
        TextShape(2048, 36, 16, 2, 11008, 151936, tied_embeddings=True, max_positions=128000),
        _qwen2_5_vl_vision(2048)),
    "qwen2.5-vl-7b": ModelPreset(
        "Qwen2.5-VL-7B", "qwen2_5_vl",
        TextShape(3584, 28, 28, 4, 18944, 152064, max_positions=128000),
        _qwen2_5_vl_vision(3584)),
    "qwen2.5-vl-72b": ModelPreset(
        "Qwen2.5-VL-72B", "qwen2_5_vl",
        TextShape(8192, 80, 64, 8, 29568, 152064, max_positions=128000),
        _qwen2_5_vl_vision(8192)),
    "qwen3-vl-2b": ModelPreset(
        "Qwen3-VL-2B", "qwen3_vl", _qwen3_text(2048, 28, 16, 6144, True),
        _qwen3_vl_vision(2048, large=False)),
    "qwen3-vl-4b": ModelPreset(
        "Qwen3-VL-4B", "qwen3_vl", _qwen3_text(2560, 36, 32, 9728, True),
        _qwen3_vl_vision(2560, large=False)),
    "qwen3-vl-8b": ModelPreset(
        "Qwen3-VL-8B", "qwen3_vl", _qwen3_text(4096, 36, 32, 12288, False),
        _qwen3_vl_vision(4096, large=True)),
    "qwen3-vl-32b": ModelPreset(
        "Qwen3-VL-32B", "qwen3_vl", _qwen3_text(5120, 64, 64, 25600, False),
        _qwen3_vl_vision(5120, large=True)),
}


def get_preset(name: str) -> ModelPreset:
    """The preset named `name` (a key of `PRESETS`, e.g. ``qwen2-vl-7b``; case-insensitive)."""
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise ValueError(f"model preset: unknown {name!r}; choose from {sorted(PRESETS)}")
    return preset
