"""Engine prompts as token ids, for random-weight models that have no tokenizer or processor.

A prompt is what `Engine.add_request` takes pre-tokenised: random text token ids, and for an
image the image tokens already expanded (``grid t*h*w / merge**2`` of them) with random
``pixel_values`` of the grid's patch count. Random weights make the values irrelevant; the
shapes, and so the work, are those of the real model: an image's grid is the one transformers'
Qwen2-VL preprocessor gives it with the hub checkpoint's pixel limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spaceserve.bench.workload import BenchRequest, parse_resolution

MIN_PIXELS, MAX_PIXELS = 56 * 56, 12845056  # the hub Qwen2-VL preprocessor's limits
# What a Qwen2-VL chat template adds around one user turn: the default system prompt, role
# markers and the vision start / end tokens.
TEMPLATE_TOKENS = 20

if TYPE_CHECKING:
    import torch


def image_grid(resolution: str, vision_config: Any, *, min_pixels: int = MIN_PIXELS,
               max_pixels: int = MAX_PIXELS) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a ``"WxH"`` image as the preprocessor resizes it
    (``"1920x1080"`` -> (1, 78, 138), 2691 LLM tokens)."""
    try:  # the PIL processor's module needs no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    width, height = parse_resolution(resolution)
    patch, merge = int(vision_config.patch_size), int(vision_config.spatial_merge_size)
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels,
                        max_pixels=max_pixels)
    return 1, h // patch, w // patch


class Prompts:
    """Prompt dicts for the engine's model (`info`: its runner's ModelInfo): an image of a grid
    named in `grids`, or plain text. Text ids are drawn below 30000 and below `max_id` when
    given (keep them off special tokens). `share_pixels` draws one ``pixel_values`` tensor per
    grid and hands it to every image of that grid (read only; saves host memory and time)."""

    def __init__(self, info: Any, grids: dict[str, tuple[int, int, int]], seed: int = 0,
                 *, share_pixels: bool = False, max_id: int | None = None) -> None:
        import torch

        self.info, self.grids = info, grids
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = min(int(info.vocab_size), 30000, *(() if max_id is None else (max_id,)))
        self.share_pixels = share_pixels
        self._pixels: dict[tuple[int, int, int], torch.Tensor] = {}

    def text(self, n: int) -> dict:
        import torch

        lo = 10 if self.vocab > 20 else 4
        return {"prompt_token_ids": torch.randint(lo, self.vocab, (n,), generator=self.gen)
                .tolist()}

    def image(self, resolution: str, n_text: int) -> dict:
        import torch

        t, h, w = self.grids[resolution]
        merge = self.info.spatial_merge_size
        ids = self.text(n_text)["prompt_token_ids"]
        ids += [self.info.image_token_id] * (t * h * w // merge ** 2)
        pv = self._pixels.get((t, h, w)) if self.share_pixels else None
        if pv is None:
            pv = torch.randn(t * h * w, self.info.patch_dim, generator=self.gen)
            if self.share_pixels:
                self._pixels[(t, h, w)] = pv
        return {"prompt_token_ids": ids, "pixel_values": pv,
                "image_grid_thw": torch.tensor([[t, h, w]])}


SPECIAL_IDS = ("image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id")


class TokenPrompts:
    """The engine prompt of each benchmark request on a model (`config`: its transformers
    config) without a tokenizer: one text token per prompt word plus `TEMPLATE_TOKENS`, drawn
    below every special token id, and images at their preprocessed grid."""

    def __init__(self, info: Any, config: Any, *, seed: int = 0) -> None:
        self.vision_config = config.vision_config
        special = [int(i) for i in (getattr(config, k, None) for k in SPECIAL_IDS)
                   if i is not None and i >= 10]
        self.prompts = Prompts(info, {}, seed, share_pixels=True, max_id=min(special,
                                                                            default=None))

    def text_tokens(self, req: BenchRequest) -> int:
        return TEMPLATE_TOKENS + len(req.prompt.split())

    def __call__(self, req: BenchRequest) -> dict:
        n = self.text_tokens(req)
        if req.kind != "image":
            return self.prompts.text(n)
        if req.resolution not in self.prompts.grids:
            self.prompts.grids[req.resolution] = image_grid(req.resolution, self.vision_config)
        return self.prompts.image(req.resolution, n)


def prompt_shape(prompt: Any, merge: int) -> tuple[int, int]:
    """(prompt tokens, image tokens) of an engine prompt dict (0, 0 for anything else)."""
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        return 0, 0
    grid = prompt.get("image_grid_thw")
    image = 0
    if grid is not None:
        import torch

        g = torch.as_tensor(grid).reshape(-1, 3)
        image = int(g.prod(dim=1).sum()) // merge ** 2
    return len(prompt["prompt_token_ids"]), image
