"""Tiny Qwen2-VL checkpoints, prompts with several images, and a greedy paged-cache driver."""

from __future__ import annotations

import numpy as np
import pytest
import torch

IMAGE, VIDEO, VSTART, VEND, EOS, BOS = 120, 121, 122, 123, 2, 1

# Two sizes: vision head dims 24 (not a power of two) and 80 (Qwen2-VL's), GQA 2:1 and 3:1.
CONFIGS = {
    "small": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=2, embed_dim=48, num_heads=2, mlp_ratio=2),
    ),
    "wide": dict(
        text=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=3, num_key_value_heads=1, mrope_section=[4, 6, 6]),
        vision=dict(depth=3, embed_dim=80, num_heads=1, mlp_ratio=2),
    ),
}
IMAGE_SIZES = [(56, 56), (60, 90), (100, 70)]  # -> grids 4x4, 4x6, 8x4 (4, 6, 8 LLM tokens)


def tiny_config(name: str):
    from transformers import Qwen2VLConfig

    spec = CONFIGS[name]
    text = dict(spec["text"])
    section = text.pop("mrope_section")
    return Qwen2VLConfig(
        text_config=dict(vocab_size=128, rope_parameters={"rope_type": "default",
                                                          "rope_theta": 1e6,
                                                          "mrope_section": section},
                         eos_token_id=EOS, bos_token_id=BOS, initializer_range=0.15, **text),
        vision_config=dict(hidden_size=spec["text"]["hidden_size"], **spec["vision"]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{name: (path, transformers model)} saved with save_pretrained, fp32, eval mode."""
    from transformers import Qwen2VLForConditionalGeneration

    out = {}
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(1234 + i)
        hf = Qwen2VLForConditionalGeneration(tiny_config(name)).eval()
        with torch.no_grad():  # non-trivial norms and biases, so they are really exercised
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        path = tmp_path_factory.mktemp(f"qwen2vl_{name}")
        hf.save_pretrained(path)
        hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
        out[name] = (path, hf)
    return out


@pytest.fixture(scope="session")
def load(checkpoints):
    """load(name, backend) -> our model from the saved checkpoint (cached per session)."""
    from spaceserve.models import from_pretrained

    cache = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            cache[name, backend] = from_pretrained(checkpoints[name][0],
                                                   attention_backend=backend)
        return cache[name, backend]

    return get


@pytest.fixture(scope="session")
def encoded(load, images):
    """encoded(name, backend) -> that model's embeddings of `images` (whole device), computed
    once per session: the language tests' image input (the vision tests encode their own)."""
    cache = {}

    def get(name: str, backend: str) -> torch.Tensor:
        if (name, backend) not in cache:
            pixel_values, grid, _ = images
            cache[name, backend] = load(name, backend).encode_images(pixel_values, grid)
        return cache[name, backend]

    return get


@pytest.fixture(scope="session")
def images():
    """pixel_values / image_grid_thw of three images of different sizes (transformers'
    processor) and a prompt interleaving them with text."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(0)
    pics = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    proc = Qwen2VLImageProcessorPil()
    batch = proc(images=pics, return_tensors="pt")
    grid = batch["image_grid_thw"]
    ids = [BOS, 7, 9]
    for j, (t, h, w) in enumerate(grid.tolist()):
        ids += [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND] + [10 + j, 30 + j]
    ids += [44, 45, 46]
    return batch["pixel_values"], grid, torch.tensor(ids)


def hf_inputs(input_ids: torch.Tensor, pixel_values, grid) -> dict:
    ids = input_ids[None]
    return dict(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                mm_token_type_ids=(ids == IMAGE).int(), attention_mask=torch.ones_like(ids))


class PagedRun:
    """One sequence on a model's paged cache, blocks scattered over the pool."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 48, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.cache = model.allocate_kv_cache(num_blocks, block_size)
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randperm(num_blocks, generator=g).tolist()
        self.cached = 0

    def step(self, ids: torch.Tensor, *, positions=None, delta: int = 0, image_embeds=None,
             num_sms=None, need_logits: bool = True) -> torch.Tensor:
        ctx = self.model.plan_step([self.cached], [len(ids)], [self.table],
                                   block_size=self.block_size, mrope_positions=[positions],
                                   rope_deltas=[delta], need_logits=[need_logits])
        out = self.model.forward(ids, ctx, self.cache, image_embeds=image_embeds,
                                 num_sms=num_sms)
        self.cached += len(ids)
        return out


def greedy(model, input_ids, pixel_values, grid, steps: int, *, chunk: int | None = None,
           num_sms=None, embeds=None) -> list[int]:
    """Prefill (optionally in chunks) then `steps` greedy decode tokens over the paged cache.
    `embeds`: the images' embeddings when the caller already has them (else encoded here)."""
    if embeds is None:
        embeds = model.encode_images(pixel_values, grid, num_sms=num_sms)
    positions, delta = model.mrope_positions(input_ids, grid)
    run = PagedRun(model)
    chunk = chunk or len(input_ids)
    used = 0
    logits = None
    for s in range(0, len(input_ids), chunk):
        piece = input_ids[s:s + chunk]
        n_img = int((piece == IMAGE).sum())
        logits = run.step(piece, positions=positions, delta=delta,
                          image_embeds=embeds[used:used + n_img] if n_img else None,
                          num_sms=num_sms)
        used += n_img
    out = []
    for i in range(steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        if i + 1 < steps:  # the last token's own step would give logits nobody reads
            logits = run.step(torch.tensor([tok]), positions=positions, delta=delta,
                              num_sms=num_sms)
    return out
