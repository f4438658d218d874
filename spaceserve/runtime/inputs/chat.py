"""Chat messages to engine prompts: chat template, image loading, image-token expansion.

`ChatPreprocessor` holds a checkpoint's tokenizer and image processor. It renders OpenAI-style
chat messages (plain dicts: ``{"role", "content": str | [{"type": "text", "text"},
{"type": "image_url", "image_url": {"url"}}]}``) with the tokenizer's chat template (an image
part becomes the template's image placeholder), loads the images under `ImageLimits`, and
expands every ``<|image_pad|>`` into as many image tokens as the image's grid gives, yielding
the engine's pre-tokenised prompt form. It also answers the engine's processor call
(``processor(text=[...], images=[...], return_tensors="pt")``), so `Engine.generate` with
``{"prompt", "images"}`` and the server build the very same token ids. Errors are `InputError`s
naming the part of the messages at fault; a new content type (video) is one more branch of
`render` and a loader beside `load_image_url`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .errors import InputError
from .images import load_image_url
from .limits import ImageLimits


class MediaRef(NamedTuple):
    """A media item of rendered messages: its kind ("image"), URL and content part."""

    modality: str
    url: Any
    where: str


class ChatPreprocessor:
    """Tokenizer + image processor of one checkpoint (either may be absent: text only)."""

    def __init__(self, tokenizer: Any, image_processor: Any = None, *,
                 image_token: str = "<|image_pad|>", image_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        if image_token_id is None and tokenizer is not None:
            tid = tokenizer.convert_tokens_to_ids(image_token)
            image_token_id = tid if isinstance(tid, int) and tid != tokenizer.unk_token_id \
                else None
        self.image_token_id = image_token_id
        self.merge = int(getattr(image_processor, "merge_size", 2) or 2)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_token_id: int | None = None
                        ) -> ChatPreprocessor:
        """Load both from a local checkpoint directory (no hub access)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        path = os.fspath(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = None
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        return cls(tokenizer, image_processor, image_token_id=image_token_id)

    # The engine's processor interface.

    def __call__(self, text: Sequence[str], images: Sequence[Any] | None = None,
                 return_tensors: str = "pt") -> dict[str, Any]:
        import torch

        if len(text) != 1:
            raise ValueError("one prompt at a time")
        prompt = self.encode(text[0], list(images or []))
        ids = torch.tensor([prompt["prompt_token_ids"]], dtype=torch.long)
        return {"input_ids": ids, "pixel_values": prompt.get("pixel_values"),
                "image_grid_thw": prompt.get("image_grid_thw")}

    def encode(self, text: str, images: Sequence[Any]) -> dict[str, Any]:
        """Tokenise `text` (holding one image placeholder per image) and expand placeholders
        into the image tokens of the decoded `images`; the engine's pre-tokenised prompt."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer: send prompt_token_ids",
                             kind="unsupported")
        ids = list(self.tokenizer(text)["input_ids"])
        tok = self.image_token_id
        slots = [i for i, t in enumerate(ids) if t == tok] if tok is not None else []
        if len(slots) != len(images):
            raise InputError(f"the prompt holds {len(slots)} image placeholders for "
                             f"{len(images)} images")
        if not images:
            return {"prompt_token_ids": ids}
        if self.image_processor is None:
            raise InputError("this model's checkpoint has no image processor: images are "
                             "not accepted", kind="unsupported")
        try:
            enc = self.image_processor(images=list(images), return_tensors="pt")
        except Exception as exc:  # e.g. an image smaller than one patch
            raise InputError(f"images cannot be preprocessed ({type(exc).__name__}: {exc})",
                             kind="bad_image") from None
        grid = enc["image_grid_thw"]
        counts = (grid.prod(dim=1) // self.merge ** 2).tolist()
        out: list[int] = []
        prev = 0
        for slot, n in zip(slots, counts, strict=True):
            out += ids[prev:slot]
            out += [tok] * int(n)
            prev = slot + 1
        out += ids[prev:]
        return {"prompt_token_ids": out, "pixel_values": enc["pixel_values"],
                "image_grid_thw": grid}

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
                    elif kind == "image_url":
                        url = part.get("image_url")
                        url = url.get("url") if isinstance(url, Mapping) else url
                        content.append({"type": "image"})
                        media.append(MediaRef("image", url, f"{where}.image_url"))
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

    def prepare(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits
                ) -> dict[str, Any]:
        """The engine prompt of chat `messages` (blocking: image decoding; run it off an event
        loop). InputError on anything the caller got wrong."""
        text, media = self.render(messages)
        if media and self.image_token_id is None:
            raise InputError("this model does not take images", kind="unsupported",
                             param="messages")
        if len(media) > limits.max_images_per_request:
            raise InputError(f"messages: {len(media)} images; at most "
                             f"{limits.max_images_per_request} per request", kind="too_large",
                             param="messages")
        images = [load_image_url(ref.url, limits, ref.where) for ref in media]
        try:
            return self.encode(text, images)
        except InputError as exc:
            raise exc.with_prefix("messages", "messages") from None
        except ValueError as exc:
            raise InputError(f"messages: {exc}", param="messages") from None
