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

Cheap checks come before expensive work. `plan` bounds the messages' text by bytes (what the
context can hold) before the template or the tokenizer sees it, reads every image's header
and checks its pixels, and the request's pixels against its budget, before any image is
decoded; `finish` then decodes (one image at a time, checking a deadline between them) and
tokenises. Text from the client is tokenised with its special tokens as plain text (`text`):
only the template writes control tokens, so a placeholder typed into a message never changes
the image count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .errors import InputError, safe_detail
from .images import load_rgb, open_image
from .limits import ImageLimits
from .media import data_url_mime, load_url_bytes
from .pool import DeadlineExceeded
from .text import check_text_size, encode_marked, mark_plain


class MediaRef(NamedTuple):
    """A media item of rendered messages: its kind ("image"), URL and content part."""

    modality: str
    url: Any
    where: str


@dataclass
class ChatPlan:
    """Chat messages checked and ready to decode: the rendered prompt (client control tokens
    marked as text), the media, their header-read images and decoded pixel count; `prompt` is
    already the engine prompt when there is nothing to decode."""

    text: str
    media: list[MediaRef] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    pixels: int = 0
    text_bytes: int = 0
    prompt: dict[str, Any] | None = None


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

    def encode(self, text: str, images: Sequence[Any], *,
               deadline: float | None = None) -> dict[str, Any]:
        """Tokenise `text` (holding one image placeholder per image; control tokens that
        `mark_plain` marked count as text) and expand placeholders into the image tokens of
        the decoded `images`; the engine's pre-tokenised prompt. Images are preprocessed one
        at a time; past `deadline` (monotonic clock) DeadlineExceeded."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer: send prompt_token_ids",
                             kind="unsupported")
        ids = encode_marked(self.tokenizer, text)
        tok = self.image_token_id
        slots = [i for i, t in enumerate(ids) if t == tok] if tok is not None else []
        if len(slots) != len(images):
            raise InputError(f"the prompt holds {len(slots)} image placeholders for "
                             f"{len(images)} images")
        if not images:
            return {"prompt_token_ids": ids}
        pv, grid = self._pixels(images, deadline)
        counts = (grid.prod(dim=1) // self.merge ** 2).tolist()
        out: list[int] = []
        prev = 0
        for slot, n in zip(slots, counts, strict=True):
            out += ids[prev:slot]
            out += [tok] * int(n)
            prev = slot + 1
        out += ids[prev:]
        return {"prompt_token_ids": out, "pixel_values": pv, "image_grid_thw": grid}

    def _pixels(self, images: Sequence[Any], deadline: float | None) -> tuple[Any, Any]:
        """(pixel_values, image_grid_thw) of decoded images, one image processor call per
        image (the same rows as one call for all), so one full-size image is alive at once."""
        import torch

        if self.image_processor is None:
            raise InputError("this model's checkpoint has no image processor: images are "
                             "not accepted", kind="unsupported")
        pvs, grids = [], []
        for img in images:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("preprocessing did not finish before its deadline")
            try:
                enc = self.image_processor(images=[self._shrink(img)], return_tensors="pt")
            except Exception as exc:  # e.g. an image smaller than one patch
                raise InputError(f"images cannot be preprocessed ({safe_detail(exc)})",
                                 kind="bad_image") from None
            pvs.append(enc["pixel_values"])
            grids.append(enc["image_grid_thw"])
        return torch.cat(pvs), torch.cat(grids)

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

    # Chat messages.

    def render(self, messages: Sequence[Mapping[str, Any]], *, max_text_bytes: int | None = None,
               context_len: int | None = None) -> tuple[str, list[MediaRef]]:
        """(templated prompt text, the media the messages refer to, in order). The client's
        text is checked against `max_text_bytes` first and its control tokens marked as text
        (`text.mark_plain`)."""
        text, media, _ = self._render(messages, max_text_bytes, context_len)
        return text, media

    def _render(self, messages: Sequence[Mapping[str, Any]], max_text_bytes: int | None,
                context_len: int | None) -> tuple[str, list[MediaRef], int]:
        rendered: list[dict[str, Any]] = []
        media: list[MediaRef] = []
        texts: list[str] = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InputError(f"messages[{i}]: a message needs a 'role' string",
                                 param=f"messages[{i}]")
            raw = m.get("content")
            if raw is None or isinstance(raw, str):
                content: Any = raw or ""
                texts.append(content)
            else:
                content = []
                for j, part in enumerate(raw):
                    where = f"messages[{i}].content[{j}]"
                    kind = part.get("type") if isinstance(part, Mapping) else None
                    if kind == "text":
                        text = part.get("text", "")
                        if not isinstance(text, str):
                            raise InputError(f"{where}.text must be a string",
                                             param=f"{where}.text")
                        content.append({"type": "text", "text": text})
                        texts.append(text)
                    elif kind == "image_url":
                        url = part.get("image_url")
                        url = url.get("url") if isinstance(url, Mapping) else url
                        content.append({"type": "image"})
                        media.append(MediaRef("image", url, f"{where}.image_url"))
                    else:
                        raise InputError(f"{where}: content part of type {kind!r} is not "
                                         "supported", kind="unsupported", param=where)
            rendered.append({"role": m["role"], "content": content})
        size = check_text_size(texts, max_text_bytes if max_text_bytes is not None else
                               1 << 62, context_len=context_len)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InputError("this model has no chat template", kind="unsupported")
        for m in rendered:
            if isinstance(m["content"], str):
                m["content"] = mark_plain(self.tokenizer, m["content"])
            else:
                for part in m["content"]:
                    if part["type"] == "text":
                        part["text"] = mark_plain(self.tokenizer, part["text"])
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # a template may raise on odd conversations
            raise InputError(f"messages: the chat template rejected them "
                             f"({safe_detail(exc)})", param="messages") from None
        return text, media, size

    def plan(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits, *,
             max_text_bytes: int | None = None, context_len: int | None = None,
             light_text_bytes: int = 64 * 1024) -> ChatPlan:
        """The cheap half of `prepare`: text bounds, template, image bytes and headers, the
        per-image and per-request pixel limits; nothing decoded. A text-only request of at
        most `light_text_bytes` comes back tokenised (`ChatPlan.prompt`); longer text is
        tokenised by `finish`. InputError on anything the caller got wrong."""
        text, media, size = self._render(messages, max_text_bytes, context_len)
        if media and self.image_token_id is None:
            raise InputError("this model does not take images", kind="unsupported",
                             param="messages")
        if len(media) > limits.max_images_per_request:
            raise InputError(f"messages: {len(media)} images; at most "
                             f"{limits.max_images_per_request} per request", kind="too_large",
                             param="messages")
        plan = ChatPlan(text, media, text_bytes=size)
        for ref in media:
            raw = load_url_bytes(ref.url, where=ref.where, max_bytes=limits.max_image_bytes,
                                 allowed_local_dir=limits.allowed_local_dir, media="image")
            img = open_image(raw, limits.max_image_pixels, ref.where,
                             mime=data_url_mime(ref.url))
            plan.images.append(img)
            plan.pixels += img.size[0] * img.size[1]
        if plan.pixels > limits.max_request_pixels:
            raise InputError(f"messages: the images decode to {plan.pixels} pixels; at most "
                             f"{limits.max_request_pixels} per request", kind="over_budget",
                             param="messages")
        if not media and size <= light_text_bytes:
            plan.prompt = self._encode_chat(text, [])
        return plan

    def finish(self, plan: ChatPlan, *, deadline: float | None = None) -> dict[str, Any]:
        """The engine prompt of a `plan`: images decoded one at a time (DeadlineExceeded past
        `deadline`, monotonic clock), preprocessed, the prompt tokenised."""
        if plan.prompt is not None:
            return plan.prompt
        if not plan.media:  # long text only
            return self._encode_chat(plan.text, [], deadline)
        images = []
        for i, ref in enumerate(plan.media):  # one full-size image alive at a time
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("preprocessing did not finish before its deadline")
            img, plan.images[i] = plan.images[i], None
            rgb = load_rgb(img, ref.where)
            images.append(self._shrink(rgb))
            if images[-1] is not img:
                img.close()  # the full-size pixels go now, not when the request ends
            del rgb, img
        return self._encode_chat(plan.text, images, deadline)

    def _encode_chat(self, text: str, images: list[Any], deadline: float | None = None
                     ) -> dict[str, Any]:
        try:
            return self.encode(text, images, deadline=deadline)
        except InputError as exc:
            raise exc.with_prefix("messages", "messages") from None
        except ValueError as exc:
            raise InputError(f"messages: {safe_detail(exc)}", param="messages") from None

    def prepare(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits, *,
                max_text_bytes: int | None = None, context_len: int | None = None
                ) -> dict[str, Any]:
        """The engine prompt of chat `messages` (blocking: image decoding; run it off an event
        loop): `plan` then `finish`. InputError on anything the caller got wrong."""
        return self.finish(self.plan(messages, limits, max_text_bytes=max_text_bytes,
                                     context_len=context_len))
