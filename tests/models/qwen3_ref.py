"""The tiny Qwen3-VL checkpoint and the reference prompts its parity tests share: text, one
image, two images of different sizes, and a video whose temporal patches are separated by
timestamp text (as Qwen3-VL's processor lays them out), with transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PATCH_DIM = 3 * 2 * 16 * 16
STEPS = 6
TEXT = [25, 27, 29, 31, 33, 44]  # above the special tokens' ids


def build(root: Path, *, tied: bool) -> tuple[Path, Any]:
    """(checkpoint dir, transformers' model loaded back from it, fp32, eval, no EOS stop)."""
    from transformers import Qwen3VLForConditionalGeneration

    from spaceserve.models.tiny import build_tiny_qwen3_checkpoint

    path = build_tiny_qwen3_checkpoint(root / ("tied" if tied else "untied"), tied=tied)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, hf


def pixels(grid: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, PATCH_DIM, generator=g), torch.tensor(grid)


def prompt_ids(config: Any, items: list[tuple[str, tuple[int, int, int]]]) -> list[int]:
    """Text, then each item: an image as ``<vs> pads <ve>``, a video as one
    ``<timestamp tokens> <vs> pads <ve>`` per temporal patch; a word after each item."""
    img, vid = config.image_token_id, config.video_token_id
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    ids = [25, 27, 29]
    for j, (kind, (t, h, w)) in enumerate(items):
        if kind == "image":
            ids += [vs] + [img] * (h * w // 4) + [ve]
        else:
            for f in range(t):
                ids += [40 + f, 41, vs] + [vid] * (h * w // 4) + [ve]
        ids.append(50 + j)
    return ids + [44]


def prompts(config: Any) -> list[dict]:
    """Engine prompts: text; one image; two images of different sizes; a 3-patch video."""
    one_pv, one_grid = pixels([[1, 4, 6]], 1)
    two_pv, two_grid = pixels([[1, 4, 6], [1, 8, 4]], 2)
    vid_pv, vid_grid = pixels([[3, 4, 4]], 3)
    return [
        {"prompt_token_ids": list(TEXT)},
        {"prompt_token_ids": prompt_ids(config, [("image", (1, 4, 6))]),
         "pixel_values": one_pv, "image_grid_thw": one_grid},
        {"prompt_token_ids": prompt_ids(config, [("image", (1, 4, 6)), ("image", (1, 8, 4))]),
         "pixel_values": two_pv, "image_grid_thw": two_grid},
        {"prompt_token_ids": prompt_ids(config, [("video", (3, 4, 4))]),
         "pixel_values_videos": vid_pv, "video_grid_thw": vid_grid},
    ]


def hf_kwargs(config: Any, prompt: dict) -> dict:
    ids = torch.tensor([prompt["prompt_token_ids"]])
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in prompt:
            kw[key] = prompt[key]
    return kw


def hf_greedy(hf: Any, prompt: dict, steps: int = STEPS) -> list[int]:
    """transformers' greedy tokens for one prompt alone."""
    kw = hf_kwargs(hf.config, prompt)
    with torch.no_grad():
        out = hf.generate(**kw, max_new_tokens=steps, do_sample=False)
    return out[0, kw["input_ids"].shape[1]:].tolist()


class HFVideos:
    """transformers' ``Qwen3VLVideoProcessor`` (sampling, size rule, patch order, normalisation
    in its fused form, metadata for the timestamps) with the one resize done by PIL: its own
    resize needs torchvision, which the test environment lacks. Takes decoded RGB frames and
    their frame rates (`source_fps`, one per video, set before each call)."""

    def __init__(self, settings: dict) -> None:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        self.settings = {k: v for k, v in settings.items() if k != "video_processor_type"}
        self.vp = Qwen3VLVideoProcessor(**self.settings)
        self.merge_size = self.settings["merge_size"]
        self.temporal_patch_size = self.settings["temporal_patch_size"]
        self.source_fps: list[float] = []

    def __call__(self, videos: Any, **kwargs: Any) -> Any:
        import numpy as np
        from PIL import Image
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        from transformers.video_utils import VideoMetadata

        s, pvs, grids, metas = self.settings, [], [], []
        p, m, tps = s["patch_size"], self.merge_size, self.temporal_patch_size
        for frames, fps in zip(videos, self.source_fps, strict=True):
            frames = np.asarray(frames)
            md = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2],
                               height=frames.shape[1], duration=len(frames) / fps)
            idx = self.vp.sample_frames(md)
            md.frames_indices = idx
            h, w = smart_resize(len(idx), frames.shape[1], frames.shape[2], temporal_factor=tps,
                                factor=p * m, min_pixels=s["size"]["shortest_edge"],
                                max_pixels=s["size"]["longest_edge"])
            kept = np.stack([np.asarray(Image.fromarray(frames[i]).resize(
                (w, h), Image.BICUBIC)) for i in idx])
            x = torch.from_numpy(kept).permute(0, 3, 1, 2).float()
            mean, std = (torch.tensor(s[k]).view(1, 3, 1, 1) for k in ("image_mean", "image_std"))
            x = (x - mean * 255) / (std * 255)  # rescale and normalise fused, as transformers
            patches, *grid = self.vp.patchify(x[None], patch_size=p, merge_size=m,
                                              temporal_patch_size=tps)
            pvs.append(patches[0])
            grids.append(torch.tensor([grid]))
            metas.append(md)
        return BatchFeature({"pixel_values_videos": torch.cat(pvs),
                             "video_grid_thw": torch.cat(grids), "video_metadata": metas})


def hf_processor(path: Path) -> Any:
    """transformers' ``Qwen3VLProcessor`` on a checkpoint directory: its tokenizer and image
    processor as transformers loads them, `HFVideos` for the video half."""
    import json

    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class Reference(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, *args: Any, **kwargs: Any) -> None:
            return None  # accept the stand-in video processor

    settings = json.loads((Path(path) / "video_preprocessor_config.json").read_text())
    return Reference(image_processor=AutoImageProcessor.from_pretrained(path),
                     tokenizer=AutoTokenizer.from_pretrained(path),
                     video_processor=HFVideos(settings))


VIDEO_WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"


def chat_text(proc: Any, messages: list[dict]) -> str:
    """The chat template's text for `messages` with each video's ``<|vision_start|>`` /
    ``<|vision_end|>`` pair dropped around its placeholder: the processor gives every timed
    temporal patch a pair of its own, and transformers >= 5.25 (and vLLM) drop the template's
    pair as SpaceServe does; older transformers kept it, so the reference drops it itself."""
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    return text.replace(VIDEO_WRAPPER, "<|video_pad|>")
