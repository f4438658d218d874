"""Prompt text and decoded media to the engine's pre-tokenised prompt.

`PromptEncoder` holds a checkpoint's tokenizer, image processor and video settings
(`VideoSampling`). `encode` tokenises a rendered prompt (control tokens the client wrote,
marked by `text.mark_plain`, count as text) and expands every ``<|image_pad|>`` /
``<|video_pad|>`` into as many tokens as the item's grid gives: ``prompt_token_ids``,
``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw`` /
``second_per_grid_ts`` (transformers' names) and ``mm_hashes`` (a content hash per image and
per video, the key of an encoder-output cache). Images are preprocessed one at a time, each
first resized with PIL to the size the processor would give it (so one full-size image's arrays
are never built), and hashed as the processor sees them. It also answers the engine's processor
call (``processor(text=[...], images=[...], videos=[...], return_tensors="pt")``), so
`Engine.generate` with ``{"prompt", "images", "videos"}`` and the server (chat.py, which adds
the chat template and media loading) build the very same token ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from spaceserve.runtime.inputs.errors import InputError, safe_detail
from spaceserve.runtime.inputs.family import (
    chat_template,
    check_geometry,
    image_processor_defaults,
    model_family,
    sampling_class,
)
from spaceserve.runtime.inputs.media.frames import VideoSampling, video_patches
from spaceserve.runtime.inputs.media.frames_qwen3 import timestamp_text
from spaceserve.runtime.inputs.media.images import image_hash
from spaceserve.runtime.inputs.pool import DeadlineExceeded
from spaceserve.runtime.inputs.text import encode_marked


def _token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None:
        return None
    tid = tokenizer.convert_tokens_to_ids(token)
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else None


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded("preprocessing did not finish before its deadline")


class PromptEncoder:
    """Tokenizer + image processor + video settings of one checkpoint (any may be absent: no
    image processor means no images, no video settings no videos)."""

    def __init__(self, tokenizer: Any, image_processor: Any = None, *,
                 image_token: str = "<|image_pad|>", image_token_id: int | None = None,
                 video_sampling: VideoSampling | None = None,
                 video_token: str = "<|video_pad|>", video_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id if image_token_id is not None \
            else _token_id(tokenizer, image_token)
        self.video_token_id = video_token_id if video_token_id is not None \
            else _token_id(tokenizer, video_token)
        self.video_sampling = video_sampling
        self.merge = int(getattr(image_processor, "merge_size", 2) or 2)
        # a timestamped video (Qwen3-VL) wraps each temporal patch in these
        self.vision_start_id = _token_id(tokenizer, "<|vision_start|>")
        self.vision_end_id = _token_id(tokenizer, "<|vision_end|>")
        self._image_settings: bytes | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_token_id: int | None = None,
                        video_token_id: int | None = None) -> Any:
        """Load them from a local checkpoint directory (no hub access); videos are taken
        when it has an image processor, sampled as the checkpoint's family does
        (``config.json``'s ``model_type``: `family.sampling_class`; see
        `VideoSampling.from_pretrained`). A tokenizer without a chat template gets the
        checkpoint's ``chat_template.jinja`` / ``.json`` or its family's
        (`family.chat_template`). Fields the processor files leave out take the family's
        settings (`family.image_processor_defaults`); a patch geometry other than the vision
        tower's is a `family.ProcessorMismatch` (`family.check_geometry`)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        path = os.fspath(path)
        kind = model_family(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = chat_template(path, kind)
        image_processor = sampling = None
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            image_processor = AutoImageProcessor.from_pretrained(
                path, local_files_only=True, **image_processor_defaults(path, kind))
            sampling = sampling_class(kind).from_pretrained(path, image_processor)
            check_geometry(path, image_processor, sampling)
        return cls(tokenizer, image_processor, image_token_id=image_token_id,
                   video_sampling=sampling, video_token_id=video_token_id)

    def image_settings(self) -> bytes:
        """A digest of the image processor's settings (part of every image's content hash)."""
        if self._image_settings is None:
            to_dict = getattr(self.image_processor, "to_dict", None)
            cfg = to_dict() if callable(to_dict) else {}
            self._image_settings = hashlib.blake2b(
                json.dumps(cfg, sort_keys=True, default=str).encode(), digest_size=16).digest()
        return self._image_settings

    # The engine's processor interface.

    def __call__(self, text: Sequence[str], images: Sequence[Any] | None = None,
                 videos: Sequence[Any] | None = None, return_tensors: str = "pt"
                 ) -> dict[str, Any]:
        """`videos` are `DecodedVideo`s or what `video.load_video` takes."""
        import torch

        from spaceserve.runtime.inputs.media.video import DecodedVideo, load_video

        if len(text) != 1:
            raise ValueError("one prompt at a time")
        vids = list(videos or [])
        if vids and self.video_sampling is None:
            raise InputError("this model's checkpoint has no video processor: videos are not "
                             "accepted", kind="unsupported")
        vids = [v if isinstance(v, DecodedVideo) else load_video(v, i, self.video_sampling)
                for i, v in enumerate(vids)]
        prompt = self.encode(text[0], list(images or []), vids)
        ids = prompt.pop("prompt_token_ids")
        return {"input_ids": torch.tensor([ids], dtype=torch.long), **prompt}

    def encode(self, text: str, images: Sequence[Any], videos: Sequence[Any] = (), *,
               deadline: float | None = None) -> dict[str, Any]:
        """Tokenise `text` (holding one placeholder per image and per video; control tokens
        that `mark_plain` marked count as text) and expand the placeholders into the tokens of
        the decoded `images` (PIL) and `videos` (`DecodedVideo`); the engine's pre-tokenised
        prompt. Items are preprocessed one at a time; past `deadline` (monotonic clock)
        DeadlineExceeded."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer: send prompt_token_ids",
                             kind="unsupported")
        ids = encode_marked(self.tokenizer, text)
        kinds = {t: k for t, k in ((self.image_token_id, "image"), (self.video_token_id,
                                                                     "video")) if t is not None}
        slots = [(i, kinds[t]) for i, t in enumerate(ids) if t in kinds]
        for kind, items in (("image", images), ("video", videos)):
            n = sum(1 for _, k in slots if k == kind)
            if n != len(items):
                raise InputError(f"the prompt holds {n} {kind} placeholders for {len(items)} "
                                 f"{kind}s")
        if not slots:
            return {"prompt_token_ids": ids}
        prompt: dict[str, Any] = {}
        counts: dict[str, list[int]] = {"image": []}
        hashes: dict[str, list[str]] = {}
        if images:
            hashes["image"] = []
            pv, grid = self._pixels(images, deadline, hashes["image"])
            prompt.update(pixel_values=pv, image_grid_thw=grid)
            counts["image"] = (grid.prod(dim=1) // self.merge ** 2).tolist()
        if videos:
            prompt.update(self._videos(videos, deadline))
            hashes["video"] = [v.content_hash for v in videos]
        out: list[int] = []
        prev = 0
        nth_video = 0
        for slot, kind in slots:
            out += ids[prev:slot]
            prev = slot + 1
            if kind == "video":
                grid = prompt["video_grid_thw"][nth_video].tolist()
                video, timed = self._video_ids(ids[slot], videos[nth_video], grid)
                if timed and out[-1:] == [self.vision_start_id] \
                        and ids[prev:prev + 1] == [self.vision_end_id]:
                    out.pop()  # each timed patch has its own pair: the template's goes
                    prev += 1
                out += video
                nth_video += 1
            else:
                out += [ids[slot]] * int(counts[kind].pop(0))
        out += ids[prev:]
        return {"prompt_token_ids": out, **prompt, "mm_hashes": hashes}

    def _video_ids(self, pad: int, video: Any, grid: list[int]) -> tuple[list[int], bool]:
        """The tokens a video's placeholder becomes: its ``t * h * w / merge^2`` pad tokens in
        one run, or, when its sampling times them (Qwen3-VL), per temporal patch the time as
        text (``<1.5 seconds>``) then ``<|vision_start|>``, that patch's pad tokens and
        ``<|vision_end|>`` (and True: timed). `encode` then drops the chat template's own
        ``<|vision_start|>`` / ``<|vision_end|>`` around the placeholder, as transformers >=
        5.25 and vLLM do: no extra pair encloses the timed patches."""
        m = self.video_sampling.merge_size
        per_patch = grid[1] * grid[2] // m ** 2
        stamps = self.video_sampling.timestamps(video.indices, video.source_fps)
        if stamps is None:
            return [pad] * (grid[0] * per_patch), False
        if self.vision_start_id is None or self.vision_end_id is None:
            raise InputError("this tokenizer lacks <|vision_start|> / <|vision_end|>, which "
                             "a timestamped video needs", kind="unsupported")
        if len(stamps) != grid[0]:
            raise InputError(f"a video of {grid[0]} temporal patches has {len(stamps)} "
                             "timestamps")
        out: list[int] = []
        for seconds in stamps:
            out += encode_marked(self.tokenizer, timestamp_text(seconds))
            out += [self.vision_start_id, *([pad] * per_patch), self.vision_end_id]
        return out, True

    def _pixels(self, images: Sequence[Any], deadline: float | None,
                hashes: list[str] | None = None) -> tuple[Any, Any]:
        """(pixel_values, image_grid_thw) of decoded images, one image processor call per
        image (the same rows as one call for all), so one full-size image is alive at once;
        each image's content hash, as the processor sees it, goes to `hashes`."""
        import torch

        if self.image_processor is None:
            raise InputError("this model's checkpoint has no image processor: images are "
                             "not accepted", kind="unsupported")
        pvs, grids = [], []
        for img in images:
            _check_deadline(deadline)
            small = self._shrink(img)
            try:
                enc = self.image_processor(images=[small], return_tensors="pt")
            except Exception as exc:  # e.g. an image smaller than one patch
                raise InputError(f"images cannot be preprocessed ({safe_detail(exc)})",
                                 kind="bad_image") from None
            if hashes is not None:
                hashes.append(image_hash(small, self.image_settings()))
            pvs.append(enc["pixel_values"])
            grids.append(enc["image_grid_thw"])
        return torch.cat(pvs), torch.cat(grids)

    def _videos(self, videos: Sequence[Any], deadline: float | None) -> dict[str, Any]:
        import torch

        if self.video_sampling is None:
            raise InputError("this model's checkpoint has no video processor: videos are "
                             "not accepted", kind="unsupported")
        patches = []
        for v in videos:
            _check_deadline(deadline)
            patches.append(video_patches(v, self.video_sampling))
        return {"pixel_values_videos": torch.cat([p for p, _ in patches]),
                "video_grid_thw": torch.tensor([g for _, g in patches], dtype=torch.long),
                "second_per_grid_ts": torch.tensor([v.second_per_grid_ts for v in videos])}

    def _shrink(self, img: Any) -> Any:
        """`img` resized with PIL to the size a Qwen2-VL image processor would resize it to,
        when that is smaller: the processor's own resize is then the identity (the same
        pixels), but it no longer converts the full-size image to arrays first (a 4096x4096
        image: ~100 MB less at its peak). Any other processor gets `img` as it is."""
        proc = self.image_processor
        size = getattr(proc, "size", None)
        lo = getattr(size, "shortest_edge", None) or getattr(proc, "min_pixels", None)
        hi = getattr(size, "longest_edge", None) or getattr(proc, "max_pixels", None)
        patch, merge = getattr(proc, "patch_size", None), getattr(proc, "merge_size", None)
        if not (hasattr(img, "resize") and getattr(proc, "do_resize", False) and lo and hi
                and patch and merge and getattr(proc, "resample", None) is not None):
            return img
        try:
            from PIL import Image
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            w, h = img.size
            rh, rw = smart_resize(h, w, factor=patch * merge, min_pixels=lo, max_pixels=hi)
            if rh * rw >= h * w:
                return img
            return img.resize((rw, rh), resample=Image.Resampling(int(proc.resample)))
        except (ImportError, ValueError, TypeError):  # not a Qwen2-VL processor after all
            return img


__all__ = ["PromptEncoder"]
