"""Chat messages to engine prompts: chat template, image decoding, image-token expansion.

`ChatPreprocessor` holds a checkpoint's tokenizer and image processor. It renders messages with
the tokenizer's chat template (an image part becomes the template's image placeholder), decodes
the images, and expands every ``<|image_pad|>`` into as many image tokens as the image's grid
gives, yielding the engine's pre-tokenised prompt form. It also answers the engine's processor
call (``processor(text=[...], images=[...], return_tensors="pt")``), so `Engine.generate` with
``{"prompt", "images"}`` and the server build the very same token ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .images import ImageError, ImageLimits, load_image_url
from .protocol import APIError, ChatCompletionRequest


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
            raise ValueError("this checkpoint has no tokenizer: send prompt_token_ids")
        ids = list(self.tokenizer(text)["input_ids"])
        tok = self.image_token_id
        slots = [i for i, t in enumerate(ids) if t == tok] if tok is not None else []
        if len(slots) != len(images):
            raise ValueError(f"the prompt holds {len(slots)} image placeholders for "
                             f"{len(images)} images")
        if not images:
            return {"prompt_token_ids": ids}
        if self.image_processor is None:
            raise ValueError("this model's checkpoint has no image processor: images are "
                             "not accepted")
        try:
            enc = self.image_processor(images=list(images), return_tensors="pt")
        except Exception as exc:  # e.g. an image smaller than one patch
            raise ValueError(f"images cannot be preprocessed ({type(exc).__name__}: {exc})"
                             ) from None
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

    # Chat requests.

    def render(self, req: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
        """(templated prompt text, [(where, image url)]) of a validated request."""
        messages: list[dict[str, Any]] = []
        urls: list[tuple[str, str]] = []
        for i, m in enumerate(req.messages):
            if m.content is None or isinstance(m.content, str):
                content: Any = m.content or ""
            else:
                content = []
                for j, part in enumerate(m.content):
                    if part.type == "text":
                        content.append({"type": "text", "text": part.text})
                    else:
                        content.append({"type": "image"})
                        urls.append((f"messages[{i}].content[{j}].image_url",
                                     part.image_url.url))
            messages.append({"role": m.role, "content": content})
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # a template may raise on odd conversations
            raise APIError(400, f"messages: the chat template rejected them ({exc})",
                           param="messages") from None
        return text, urls

    def prepare(self, req: ChatCompletionRequest, limits: ImageLimits) -> dict[str, Any]:
        """A request's engine prompt (blocking: run it off the event loop). APIError 400 on
        anything the client got wrong."""
        text, urls = self.render(req)
        if urls and self.image_token_id is None:
            raise APIError(400, "this model does not take images", param="messages")
        if len(urls) > limits.max_images_per_request:
            raise APIError(400, f"messages: {len(urls)} images; at most "
                           f"{limits.max_images_per_request} per request", param="messages")
        try:
            images = [load_image_url(url, limits, where) for where, url in urls]
            return self.encode(text, images)
        except ImageError as exc:
            raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from None
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
