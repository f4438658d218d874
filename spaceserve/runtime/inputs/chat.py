"""Chat messages to engine prompts: chat template, media loading, media-token expansion.

`ChatPreprocessor` holds a checkpoint's tokenizer, image processor and video settings
(`VideoSampling`). It renders OpenAI-style chat messages (plain dicts: ``{"role", "content":
str | [{"type": "text", "text"}, {"type": "image_url", "image_url": {"url"}}, {"type":
"video_url", "video_url": {"url"}}]}``) with the tokenizer's chat template (a media part becomes
the template's image or video placeholder), loads the media under `ImageLimits` and
`VideoLimits` (remote URLs through a fetcher when one is given, a request's fetches started
together), and expands every ``<|image_pad|>`` / ``<|video_pad|>`` into as many tokens as the
item's grid gives, yielding the engine's pre-tokenised prompt form: ``prompt_token_ids``,
``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw`` /
``second_per_grid_ts`` (transformers' names) and ``mm_hashes`` (a content hash per image and
per video, the key of an encoder-output cache). It also answers the engine's processor call
(``processor(text=[...], images=[...], videos=[...], return_tensors="pt")``), so
`Engine.generate` with ``{"prompt", "images", "videos"}`` and the server build the very same
token ids. Errors are `InputError`s naming the part of the messages at fault.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .errors import InputError
from .images import image_hash, load_image_url
from .limits import ImageLimits, VideoLimits
from .video import VideoSampling, load_video_url, video_patches

REMOTE = ("http://", "https://")


class MediaRef(NamedTuple):
    """A media item of rendered messages: its kind ("image" or "video"), URL and content
    part."""

    modality: str
    url: Any
    where: str


def _token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None:
        return None
    tid = tokenizer.convert_tokens_to_ids(token)
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else None


class ChatPreprocessor:
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
        self._image_settings: bytes | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_token_id: int | None = None,
                        video_token_id: int | None = None) -> ChatPreprocessor:
        """Load them from a local checkpoint directory (no hub access); videos are taken
        when it has an image processor (see `VideoSampling.from_pretrained`)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        path = os.fspath(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = sampling = None
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
            sampling = VideoSampling.from_pretrained(path, image_processor)
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

        from .video import DecodedVideo, load_video

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

    def encode(self, text: str, images: Sequence[Any], videos: Sequence[Any] = ()
               ) -> dict[str, Any]:
        """Tokenise `text` (holding one placeholder per image and per video) and expand the
        placeholders into the tokens of the decoded `images` (PIL) and `videos`
        (`DecodedVideo`); the engine's pre-tokenised prompt."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer: send prompt_token_ids",
                             kind="unsupported")
        ids = list(self.tokenizer(text)["input_ids"])
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
        counts: dict[str, list[int]] = {"image": [], "video": []}
        hashes: dict[str, list[str]] = {}
        if images:
            prompt.update(self._images(images))
            counts["image"] = (prompt["image_grid_thw"].prod(dim=1) // self.merge ** 2).tolist()
            hashes["image"] = [image_hash(img, self.image_settings()) for img in images]
        if videos:
            prompt.update(self._videos(videos))
            m = self.video_sampling.merge_size
            counts["video"] = (prompt["video_grid_thw"].prod(dim=1) // m ** 2).tolist()
            hashes["video"] = [v.content_hash for v in videos]
        out: list[int] = []
        prev = 0
        for slot, kind in slots:
            out += ids[prev:slot]
            out += [ids[slot]] * int(counts[kind].pop(0))
            prev = slot + 1
        out += ids[prev:]
        return {"prompt_token_ids": out, **prompt, "mm_hashes": hashes}

    def _images(self, images: Sequence[Any]) -> dict[str, Any]:
        if self.image_processor is None:
            raise InputError("this model's checkpoint has no image processor: images are "
                             "not accepted", kind="unsupported")
        try:
            enc = self.image_processor(images=list(images), return_tensors="pt")
        except Exception as exc:  # e.g. an image smaller than one patch
            raise InputError(f"images cannot be preprocessed ({type(exc).__name__}: {exc})",
                             kind="bad_image") from None
        return {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}

    def _videos(self, videos: Sequence[Any]) -> dict[str, Any]:
        import torch

        if self.video_sampling is None:
            raise InputError("this model's checkpoint has no video processor: videos are "
                             "not accepted", kind="unsupported")
        patches = [video_patches(v, self.video_sampling) for v in videos]
        return {"pixel_values_videos": torch.cat([p for p, _ in patches]),
                "video_grid_thw": torch.tensor([g for _, g in patches], dtype=torch.long),
                "second_per_grid_ts": torch.tensor([v.second_per_grid_ts for v in videos])}

    # Chat messages.

    def render(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[MediaRef]]:
        """(templated prompt text, the media the messages refer to, in order)."""
        rendered: list[dict[str, Any]] = []
        media: list[MediaRef] = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InputError(f"messages[{i}]: a message needs a 'role' string",
                                 param=f"messages[{i}]")
            raw = m.get("content")
            if raw is None or isinstance(raw, str):
                content: Any = raw or ""
            else:
                content = []
                for j, part in enumerate(raw):
                    where = f"messages[{i}].content[{j}]"
                    kind = part.get("type") if isinstance(part, Mapping) else None
                    if kind == "text":
                        content.append({"type": "text", "text": part.get("text", "")})
                    elif kind in ("image_url", "video_url"):
                        url = part.get(kind)
                        url = url.get("url") if isinstance(url, Mapping) else url
                        modality = kind[:-4]
                        content.append({"type": modality})
                        media.append(MediaRef(modality, url, f"{where}.{kind}"))
                    else:
                        raise InputError(f"{where}: content part of type {kind!r} is not "
                                         "supported", kind="unsupported", param=where)
            rendered.append({"role": m["role"], "content": content})
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InputError("this model has no chat template", kind="unsupported")
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # a template may raise on odd conversations
            raise InputError(f"messages: the chat template rejected them ({exc})",
                             param="messages") from None
        return text, media

    def prepare(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits,
                video_limits: VideoLimits | None = None, *, fetcher: Any = None
                ) -> dict[str, Any]:
        """The engine prompt of chat `messages` (blocking: fetching and decoding; run it off an
        event loop). http(s) media URLs go to `fetcher` (a `remote.RemoteFetcher`; refused
        without one). InputError on anything the caller got wrong."""
        text, media = self.render(messages)
        vlimits = video_limits or VideoLimits()
        count = {"image": 0, "video": 0}
        for ref in media:
            count[ref.modality] += 1
        if count["image"] and self.image_token_id is None:
            raise InputError("this model does not take images", kind="unsupported",
                             param="messages")
        if count["video"] and (self.video_token_id is None or self.video_sampling is None):
            raise InputError("this model does not take videos", kind="unsupported",
                             param="messages")
        for kind, most in (("image", limits.max_images_per_request),
                           ("video", vlimits.max_videos_per_request)):
            if count[kind] > most:
                raise InputError(f"messages: {count[kind]} {kind}s; at most {most} per request",
                                 kind="too_large", param="messages")
        size = {"image": limits.max_image_bytes, "video": vlimits.max_video_bytes}
        remote = [(r.url, r.where, r.modality, size[r.modality]) for r in media
                  if isinstance(r.url, str) and r.url.startswith(REMOTE)]
        batch = fetcher.batch(remote) if fetcher is not None and remote else None
        images, videos = [], []
        with batch if batch is not None else contextlib.nullcontext():
            for ref in media:
                if ref.modality == "image":
                    images.append(load_image_url(ref.url, limits, ref.where,
                                                 fetcher=batch or fetcher))
                else:
                    videos.append(load_video_url(ref.url, limits, vlimits, self.video_sampling,
                                                 ref.where, fetcher=batch or fetcher))
        try:
            return self.encode(text, images, videos)
        except InputError as exc:
            raise exc.with_prefix("messages", "messages") from None
        except ValueError as exc:
            raise InputError(f"messages: {exc}", param="messages") from None
