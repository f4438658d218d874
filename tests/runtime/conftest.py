"""Runtime test fixtures: one intra-op thread for tiny tensors, and tiny random Qwen2-VL
checkpoints with their prompts and transformers' greedy tokens as the reference.

Special token ids travel as a tuple `(image, video, vision_start, vision_end, eos, bos)`, which
each test module declares once and passes in, so its assertions name the same ids.
"""

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

Ids = tuple[int, int, int, int, int, int]  # image, video, vision start, vision end, eos, bos


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add overhead on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """Builder of (checkpoint path, transformers model) for a random Qwen2-VL saved with
    save_pretrained and loaded back in fp32; generate always runs to max_new_tokens."""

    def build(name: str, ids: Ids, *, seed: int, intermediate_size: int, depth: int,
              num_heads: int) -> tuple[Path, Any]:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        image, video, vstart, vend, eos, bos = ids
        config = Qwen2VLConfig(
            text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=intermediate_size,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             eos_token_id=eos, bos_token_id=bos,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                              "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=depth, embed_dim=32, hidden_size=64, num_heads=num_heads,
                               mlp_ratio=2),
            image_token_id=image, video_token_id=video, vision_start_token_id=vstart,
            vision_end_token_id=vend)
        torch.manual_seed(seed)
        hf = Qwen2VLForConditionalGeneration(config).eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # always max_new_tokens, as ignore_eos does
        return path, hf

    return build


@pytest.fixture(scope="session")
def qwen2_vl_image_prompt() -> Callable[..., dict]:
    """Builder of an image prompt: the `head` token ids, then for image j of `sizes` ((h, w)
    pixels, random from `rng`) vision-start, its image tokens, vision-end and token `tail + j`;
    pixel values and grids from Qwen2-VL's image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil()

    def build(rng: np.random.Generator, sizes: Sequence[tuple[int, int]], head: list[int],
              tail: int, ids: Ids) -> dict:
        image, _, vstart, vend, _, _ = ids
        pics = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        batch = proc(images=pics, return_tensors="pt")
        tokens = list(head)
        for j, (t, h, w) in enumerate(batch["image_grid_thw"].tolist()):
            tokens += [vstart] + [image] * (t * h * w // 4) + [vend, tail + j]
        return {"prompt_token_ids": tokens, "pixel_values": batch["pixel_values"],
                "image_grid_thw": batch["image_grid_thw"]}

    return build


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Any, dict, int], list[int]]:
    """transformers' greedy tokens for one prompt alone: the reference the engine must equal."""

    def generate(hf, prompt: dict, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt["prompt_token_ids"]])
        types = (ids == hf.config.image_token_id).int() + \
            2 * (ids == hf.config.video_token_id).int()
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types)
        if "pixel_values" in prompt:
            kw.update(pixel_values=prompt["pixel_values"],
                      image_grid_thw=prompt["image_grid_thw"])
        if "pixel_values_videos" in prompt:
            kw.update(pixel_values_videos=prompt["pixel_values_videos"],
                      video_grid_thw=prompt["video_grid_thw"])
        with torch.no_grad():
            out = hf.generate(**kw, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    return generate
