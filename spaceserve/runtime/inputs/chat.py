"""Chat messages to engine prompts: chat template, media loading, media-token expansion.

`ChatPreprocessor` is a `PromptEncoder` (a checkpoint's tokenizer, image processor and video
settings; the engine's processor call) that also takes OpenAI-style chat messages (plain dicts:
``{"role", "content": str | [{"type": "text", "text"}, {"type": "image_url", "image_url":
{"url"}}, {"type": "video_url", "video_url": {"url"}}]}``): it renders them with the tokenizer's
chat template (a media part becomes the template's image or video placeholder), loads the media
under `ImageLimits` and `VideoLimits` (remote URLs through a fetcher when one is given, a
request's fetches started together) and encodes the result. Errors are `InputError`s naming
the part of the messages at fault.

Cheap checks come before expensive work, in stages a server can run apart (`prepare` runs them
all). `start_plan` bounds the messages' text by bytes (what the context can hold) before the
template or the tokenizer sees it, checks the media counts and starts fetching the request's
remote media; `read_media` reads every medium's bytes and header (an image's size, a video's
container: frame size, frame count, the frames sampling keeps) and checks the per-item limits
and the request's pixel budget, before anything is decoded (`plan` is both); `finish` then
decodes (one item at a time, checking a deadline between them and between a video's frames)
and tokenises. Text from the client is tokenised with its special tokens as plain text
(`text`): only the template writes control tokens, so a placeholder typed into a message
never changes the image or video count.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from spaceserve.runtime.inputs.errors import InputError, safe_detail
from spaceserve.runtime.inputs.media.images import load_rgb, open_image
from spaceserve.runtime.inputs.media.limits import ImageLimits, VideoLimits
from spaceserve.runtime.inputs.media.urls import load_url_media, mime_source
from spaceserve.runtime.inputs.media.video import open_video_url
from spaceserve.runtime.inputs.pool import DeadlineExceeded, cancel_point
from spaceserve.runtime.inputs.prompt_encoder import PromptEncoder
from spaceserve.runtime.inputs.text import check_text_size, mark_plain

REMOTE = ("http://", "https://")


class MediaRef(NamedTuple):
    """A media item of rendered messages: its kind ("image" or "video"), URL and content
    part."""

    modality: str
    url: Any
    where: str


@dataclass
class ChatPlan:
    """Chat messages checked and ready to decode: the rendered prompt (client control tokens
    marked as text), the media and, once read, their opened items (an image with its header
    read, an `OpenedVideo`), the pixels they count against pixel budgets and the work decoding
    them takes (a video decodes more frames than it keeps); `prompt` is already the engine
    prompt when there is nothing to decode. `fetches` holds the request's remote fetches
    until its media are read."""

    text: str
    media: list[MediaRef] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    pixels: int = 0
    work: int = 0
    text_bytes: int = 0
    prompt: dict[str, Any] | None = None
    fetches: Any = None
    limits: ImageLimits = field(default_factory=ImageLimits, repr=False)
    video_limits: VideoLimits = field(default_factory=VideoLimits, repr=False)

    @property
    def fetching(self) -> list[Future]:
        """Remote fetches still on their way (wait for them before `read_media`)."""
        return self.fetches.pending() if self.fetches is not None else []

    def close(self) -> None:
        """Stop what is still being fetched (idempotent)."""
        if self.fetches is not None:
            self.fetches.__exit__(None, None, None)
            self.fetches = None

    def describe(self) -> str:
        """What the media are, in words ("images", "video frames", or both)."""
        kinds = {r.modality for r in self.media}
        return " and ".join(w for k, w in (("image", "images"), ("video", "video frames"))
                            if k in kinds) or "media"


class ChatPreprocessor(PromptEncoder):
    """Tokenizer + image processor + video settings of one checkpoint (any may be absent: text
    only), and the chat messages' way to the engine prompt."""

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

    def start_plan(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits,
                   video_limits: VideoLimits | None = None, *, fetcher: Any = None,
                   max_text_bytes: int | None = None, context_len: int | None = None
                   ) -> ChatPlan:
        """The first, cheapest part of `plan`: text bounds, template, media counts; the
        request's http(s) media start downloading together through `fetcher` (a
        `remote.RemoteFetcher`; refused without one). Nothing is read yet."""
        text, media, size = self._render(messages, max_text_bytes, context_len)
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
        plan = ChatPlan(text, media, text_bytes=size, limits=limits, video_limits=vlimits)
        size_of = {"image": limits.max_image_bytes, "video": vlimits.max_video_bytes}
        remote = [(r.url, r.where, r.modality, size_of[r.modality]) for r in media
                  if isinstance(r.url, str) and r.url.startswith(REMOTE)]
        if fetcher is not None and remote:
            plan.fetches = fetcher.batch(remote)
        return plan

    def read_media(self, plan: ChatPlan, *, light_text_bytes: int = 64 * 1024) -> ChatPlan:
        """The rest of `plan`: every medium's bytes (a remote one once fetched) and header,
        the per-item limits and the request's pixel budget; nothing decoded. A text-only
        request of at most `light_text_bytes` comes back tokenised (`ChatPlan.prompt`)."""
        limits, vlimits = plan.limits, plan.video_limits
        try:
            for ref in plan.media:
                if ref.modality == "video":
                    video = open_video_url(ref.url, limits, vlimits, self.video_sampling,
                                           ref.where, fetcher=plan.fetches)
                    plan.items.append(video)
                    plan.pixels += video.pixels
                    plan.work += video.work
                    continue
                raw, mime = load_url_media(ref.url, where=ref.where,
                                           max_bytes=limits.max_image_bytes,
                                           allowed_local_dir=limits.allowed_local_dir,
                                           media="image", fetcher=plan.fetches)
                img = open_image(raw, limits.max_image_pixels, ref.where, mime=mime,
                                 declared_by=mime_source(ref.url))
                plan.items.append(img)
                plan.pixels += img.size[0] * img.size[1]
                plan.work += img.size[0] * img.size[1]
        finally:
            plan.close()
        if plan.pixels > limits.max_request_pixels:
            raise InputError(f"messages: the {plan.describe()} decode to {plan.pixels} pixels; "
                             f"at most {limits.max_request_pixels} per request",
                             kind="over_budget", param="messages")
        if not plan.media and plan.text_bytes <= light_text_bytes:
            plan.prompt = self._encode_chat(plan.text, [])
        return plan

    def plan(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits,
             video_limits: VideoLimits | None = None, *, fetcher: Any = None,
             max_text_bytes: int | None = None, context_len: int | None = None,
             light_text_bytes: int = 64 * 1024) -> ChatPlan:
        """The cheap half of `prepare` (blocking while remote media download): `start_plan`
        then `read_media`. InputError on anything the caller got wrong."""
        plan = self.start_plan(messages, limits, video_limits, fetcher=fetcher,
                               max_text_bytes=max_text_bytes, context_len=context_len)
        return self.read_media(plan, light_text_bytes=light_text_bytes)

    def finish(self, plan: ChatPlan, *, deadline: float | None = None) -> dict[str, Any]:
        """The engine prompt of a read `plan`: images and videos decoded one at a time
        (DeadlineExceeded past `deadline`, monotonic clock), preprocessed, the prompt
        tokenised."""
        if plan.prompt is not None:
            return plan.prompt
        if not plan.media:  # long text only
            return self._encode_chat(plan.text, [], (), deadline)
        images, videos = [], []
        for i, ref in enumerate(plan.media):  # one full-size item alive at a time
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("preprocessing did not finish before its deadline")
            cancel_point()  # its request went away: stop here
            item, plan.items[i] = plan.items[i], None
            if ref.modality == "video":
                videos.append(item.decode(deadline))
                continue
            rgb = load_rgb(item, ref.where)
            images.append(self._shrink(rgb))
            if images[-1] is not item:
                item.close()  # the full-size pixels go now, not when the request ends
            del rgb, item
        return self._encode_chat(plan.text, images, videos, deadline)

    def _encode_chat(self, text: str, images: list[Any], videos: Sequence[Any] = (),
                     deadline: float | None = None) -> dict[str, Any]:
        try:
            return self.encode(text, images, videos, deadline=deadline)
        except InputError as exc:
            raise exc.with_prefix("messages", "messages") from None
        except ValueError as exc:
            raise InputError(f"messages: {safe_detail(exc)}", param="messages") from None

    def prepare(self, messages: Sequence[Mapping[str, Any]], limits: ImageLimits,
                video_limits: VideoLimits | None = None, *, fetcher: Any = None,
                max_text_bytes: int | None = None, context_len: int | None = None
                ) -> dict[str, Any]:
        """The engine prompt of chat `messages` (blocking: fetching and decoding; run it off
        an event loop): `plan` then `finish`. http(s) media URLs go to `fetcher` (a
        `remote.RemoteFetcher`; refused without one). InputError on anything the caller got
        wrong."""
        return self.finish(self.plan(messages, limits, video_limits, fetcher=fetcher,
                                     max_text_bytes=max_text_bytes, context_len=context_len))


__all__ = ["ChatPlan", "ChatPreprocessor", "MediaRef", "REMOTE"]
