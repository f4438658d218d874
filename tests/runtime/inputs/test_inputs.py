"""Input processing (spaceserve.runtime.inputs): media URLs and images under limits, chat
messages to prompts, every failure an InputError with its kind and param; the server maps
kinds to statuses. Importing the package pulls in no HTTP stack and no torch."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest

from spaceserve.runtime.inputs import (
    KINDS,
    ChatPreprocessor,
    ImageError,
    ImageLimits,
    InputError,
    load_image_url,
    load_url_bytes,
    to_data_url,
)


def png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
        buf, format="PNG")
    return buf.getvalue()


def fails(kind: str, fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        fn(*args, **kw)
    assert info.value.kind == kind, (info.value.kind, str(info.value))
    assert isinstance(info.value, ValueError)
    return info.value


def test_image_urls_under_limits(tmp_path) -> None:
    raw = png(20, 10)
    limits = ImageLimits(max_image_bytes=len(raw), max_image_pixels=200,
                         allowed_local_dir=str(tmp_path))
    img = load_image_url(to_data_url(raw), limits, "m[0]")
    assert img.size == (20, 10) and img.mode == "RGB"
    (tmp_path / "a.png").write_bytes(raw)
    assert load_image_url(f"file://{tmp_path}/a.png", limits).size == (20, 10)
    where = "messages[0].content[1].image_url"
    err = fails("too_large", load_image_url, to_data_url(raw), ImageLimits(
        max_image_bytes=len(raw) - 1), where)
    assert err.param == where and str(err).startswith(where + ": image larger than")
    err = fails("too_large", load_image_url, to_data_url(raw), ImageLimits(max_image_pixels=199))
    assert isinstance(err, ImageError) and "20x10 pixels" in str(err)
    fails("bad_image", load_image_url, to_data_url(b"not a png"), limits)
    fails("invalid", load_image_url, "data:image/png;base64,@@", limits)
    fails("unsupported", load_image_url, "data:text/plain;base64,aGk=", limits)
    fails("not_allowed", load_image_url, "https://example.com/a.png", limits)
    fails("not_allowed", load_image_url, "file:///etc/passwd", limits)
    fails("not_allowed", load_image_url, f"file://{tmp_path}/a.png", ImageLimits())
    missing = fails("not_allowed", load_image_url, f"file://{tmp_path}/missing.png", limits)
    outside = fails("not_allowed", load_image_url, "file:///etc/passwd", limits)
    assert str(missing) == str(outside) == "image_url: image file is not allowed or not found"
    fails("unsupported", load_image_url, "ftp://x/a.png", limits)
    fails("invalid", load_url_bytes, 7, where="x", max_bytes=10, allowed_local_dir=None)


def test_input_error_kinds_are_closed() -> None:
    assert {"too_large", "bad_image", "not_allowed"} <= set(KINDS)
    with pytest.raises(ValueError, match="kind"):
        InputError("x", kind="teapot")
    err = InputError("bad", kind="too_large", param="p").with_prefix("messages", "messages")
    assert (str(err), err.kind, err.param) == ("messages: bad", "too_large", "messages")


class WordTokenizer:
    """A tokenizer stand-in: one id per word; '<img>' is the image placeholder."""

    unk_token_id = 0
    chat_template = "words"

    def convert_tokens_to_ids(self, token: str) -> int:
        return 99 if token == "<img>" else 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": [99 if w == "<img>" else 1 + len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize) -> str:
        out = []
        for m in messages:
            if isinstance(m["content"], str):
                out.append(m["content"])
            else:
                out += [p["text"] if p["type"] == "text" else "<img>" for p in m["content"]]
        return " ".join(out)


def test_chat_messages_to_prompt_and_errors() -> None:
    pre = ChatPreprocessor(WordTokenizer(), image_token="<img>")
    msgs = [{"role": "user", "content": "hello there"}]
    assert pre.prepare(msgs, ImageLimits()) == {"prompt_token_ids": [6, 6]}
    url = to_data_url(png(28, 28))
    text, media = pre.render([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}])
    assert text == "<img> hi"
    assert [(m.modality, m.where) for m in media] == [("image", "messages[0].content[0].image_url")]
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 2}]
    err = fails("too_large", pre.prepare, two, ImageLimits(max_images_per_request=1))
    assert (str(err), err.param) == ("messages: 2 images; at most 1 per request", "messages")
    err = fails("unsupported", pre.prepare, two, ImageLimits())  # no image processor
    assert str(err).startswith("messages: this model's checkpoint has no image processor")
    assert err.param == "messages"
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x:y"}}]}]
    err = fails("unsupported", pre.prepare, bad, ImageLimits())
    assert err.param == "messages[0].content[0].image_url"
    fails("unsupported", pre.render, [{"role": "user", "content": [{"type": "audio"}]}])
    fails("invalid", pre.render, [{"content": "no role"}])
    text_only = ChatPreprocessor(WordTokenizer(), image_token="<none>")
    err = fails("unsupported", text_only.prepare, two, ImageLimits())
    assert str(err) == "this model does not take images"


def test_server_maps_input_errors_to_openai_errors() -> None:
    from spaceserve.server.openai.protocol import INPUT_ERROR_STATUS, input_error

    assert set(INPUT_ERROR_STATUS) == set(KINDS)
    api = input_error(InputError("m[0]: image larger than 5 bytes", kind="too_large",
                                 param="m[0]"))
    assert api.status == 400
    assert api.body() == {"error": {"message": "m[0]: image larger than 5 bytes",
                                    "type": "invalid_request_error", "param": "m[0]",
                                    "code": None}}


def test_inputs_import_no_http_and_no_torch() -> None:
    code = ("import sys, spaceserve.runtime.inputs; "
            "print(sorted(m for m in ('torch', 'fastapi', 'starlette', 'pydantic', 'uvicorn', "
            "'spaceserve.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_offline_images_and_process_prompt_share_the_module() -> None:
    from spaceserve.runtime.inputs import load_image, process_prompt

    raw = png(4, 3)
    assert load_image(raw, 0).size == (4, 3)
    assert load_image("data:image/png;base64," + base64.b64encode(raw).decode(), 1).size == (4, 3)
    err = fails("bad_image", load_image, b"junk", 2)
    assert str(err) == "images[2] cannot be decoded: not a PNG, JPEG, WebP, GIF or BMP image"
    assert process_prompt.__module__ == "spaceserve.runtime.inputs.prompt"
