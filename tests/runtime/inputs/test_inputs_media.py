"""Media hardening (spaceserve.runtime.inputs): images decoded only from the format allow-list
with the declared type checked, no object reprs in messages, file URLs percent-decoded with one
answer for "not allowed or not found", pixel budgets checked from headers before decoding, and
the preprocessing pool's lanes, order, bounds and deadlines."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import numpy as np
import pytest

from spaceserve.runtime.inputs import (
    ChatPreprocessor,
    DeadlineExceeded,
    ImageLimits,
    InputError,
    PixelBudget,
    PreprocessPool,
    QueueFull,
    decode_image,
    load_image_url,
    safe_detail,
)
from spaceserve.runtime.inputs import chat as chat_module


def encoded(fmt: str, w: int = 20, h: int = 10, **save) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def fails(kind: str, fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        fn(*args, **kw)
    assert info.value.kind == kind, (info.value.kind, str(info.value))
    msg = str(info.value)
    assert "0x" not in msg and " object at " not in msg, msg
    return info.value


EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
       b"newpath 0 0 moveto 10 10 lineto stroke showpage\n%%EOF\n")


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp"), ("GIF", "image/gif"),
                                      ("BMP", "image/bmp")])
def test_allowed_formats_decode_with_their_type(fmt, mime) -> None:
    raw = encoded(fmt)
    img = load_image_url(url(raw, mime), ImageLimits())
    assert img.size == (20, 10) and img.mode == "RGB"
    assert decode_image(raw, 200).size == (20, 10)  # no type declared: any allowed format
    other = "image/png" if fmt != "PNG" else "image/jpeg"
    err = fails("bad_image", load_image_url, url(raw, other), ImageLimits(), "p")
    assert str(err) == f"p: the data URL says {other} but the data is {fmt}"


def test_gif_first_frame_only() -> None:
    from PIL import Image

    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    img = decode_image(buf.getvalue(), 100)
    assert img.getpixel((0, 0))[0] > 200  # red: the first frame


def test_refused_formats_never_reach_their_plugins(monkeypatch) -> None:
    from PIL import EpsImagePlugin, TiffImagePlugin

    opened = []
    for plugin in (EpsImagePlugin.EpsImageFile, TiffImagePlugin.TiffImageFile):
        monkeypatch.setattr(plugin, "_open", lambda self: opened.append(type(self).__name__))
    err = fails("bad_image", decode_image, EPS, 10**6, "m")
    assert str(err) == "m: not a PNG, JPEG, WebP, GIF or BMP image (the data looks like " \
        "PostScript/EPS)"
    err = fails("bad_image", decode_image, encoded("TIFF"), 10**6, "m")
    assert "TIFF" in str(err)
    fails("unsupported", load_image_url, url(EPS, "image/x-eps"), ImageLimits())
    fails("unsupported", load_image_url, url(encoded("PNG"), "image/svg+xml"), ImageLimits())
    assert opened == []


def test_damaged_images_name_the_problem_without_reprs() -> None:
    raw = encoded("PNG", 64, 64)
    err = fails("bad_image", decode_image, raw[: len(raw) // 2], 10**6, "m")
    assert str(err).startswith("m: cannot decode the image (")
    fails("bad_image", decode_image, b"\x89PNG\r\n\x1a\n" + b"\0" * 40, 10**6, "m")
    assert safe_detail(ValueError("cannot identify <_io.BytesIO object at 0x7f3a2b1c0d90>")) \
        == "cannot identify <object>"
    assert safe_detail(ValueError("bad\n  pointer 0xdeadbeef12")) == "bad pointer 0x…"


def test_file_urls_are_percent_decoded_and_refusals_alike(tmp_path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    raw = encoded("PNG")
    (inside / "a b.png").write_bytes(raw)
    (inside / "sub").mkdir()
    (tmp_path / "secret.png").write_bytes(raw)
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    limits = ImageLimits(allowed_local_dir=str(inside))
    assert load_image_url(f"file://{inside}/a%20b.png", limits).size == (20, 10)
    assert load_image_url(f"file://localhost{inside}/a%20b.png", limits).size == (20, 10)
    msgs = {str(fails("not_allowed", load_image_url, u, limits, "p")) for u in (
        f"file://{tmp_path}/secret.png", f"file://{inside}/missing.png",
        f"file://{inside}/link.png", f"file://{inside}/sub", f"file://{inside}/a%00b.png",
        f"file://{inside}/..%2fsecret.png", "file:///etc/shadow", "file:///no/such/file")}
    assert msgs == {"p: image file is not allowed or not found"}
    fails("invalid", load_image_url, f"file://evil.example{inside}/a%20b.png", limits)


def gray_png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (40, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


class _Tok:
    """Text tokenizer stand-in for the planner: one id per word, '<img>' the placeholder."""

    unk_token_id = 0
    chat_template = "words"

    def convert_tokens_to_ids(self, token):
        return 9 if token == "<img>" else 0

    def __call__(self, text, **kw):
        return {"input_ids": [9 if w == "<img>" else 1 for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(p["text"] if p["type"] == "text" else "<img>"
                        for m in messages for p in m["content"])


def test_request_pixel_budget_is_checked_from_headers(monkeypatch) -> None:
    pre = ChatPreprocessor(_Tok(), image_token="<img>")
    decoded = []
    monkeypatch.setattr(chat_module, "load_rgb", lambda img, where: decoded.append(where))
    big = url(gray_png(300, 200))
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}] * 3
             + [{"type": "text", "text": "compare"}]}]
    err = fails("over_budget", pre.plan, msgs, ImageLimits(max_request_pixels=150_000))
    assert str(err) == "messages: the images decode to 180000 pixels; at most 150000 per " \
        "request"
    plan = pre.plan(msgs, ImageLimits(max_request_pixels=180_000))
    assert plan.pixels == 180_000 and plan.prompt is None and decoded == []
    text_only = pre.plan([{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
                         ImageLimits())
    assert text_only.prompt == {"prompt_token_ids": [1, 1]} and text_only.pixels == 0


def test_pixel_budget_refuses_when_busy_and_frees_on_release() -> None:
    budget = PixelBudget(100, retry_after=2.0)
    a = budget.acquire(60)
    err = fails("busy", budget.acquire, 50)
    assert err.retry_after == 2.0 and "retry later" in str(err)
    fails("over_budget", budget.acquire, 101)
    with budget.acquire(40):
        assert budget.in_use == 100
    a.release()
    a.release()  # idempotent
    assert budget.in_use == 0


def test_per_image_processing_equals_one_call() -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(min_pixels=4 * 784, max_pixels=256 * 784)
    pre = ChatPreprocessor(_Tok(), proc, image_token="<img>")
    rng = np.random.default_rng(1)
    imgs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            for h, w in ((60, 90), (700, 1000), (33, 57))]  # 700x1000: resized first
    pv, grid = pre._pixels(imgs, None)
    ref = proc(images=imgs, return_tensors="pt")
    assert (grid == ref["image_grid_thw"]).all()
    assert pv.shape == ref["pixel_values"].shape and (pv == ref["pixel_values"]).all()
    with pytest.raises(DeadlineExceeded):
        pre._pixels(imgs, time.monotonic() - 1)


def test_pool_light_lane_runs_while_heavy_is_blocked() -> None:
    pool = PreprocessPool(light_workers=1, heavy_workers=1, max_queue=2)
    gate = threading.Event()
    try:
        pool.submit(gate.wait, lane="heavy", cost=10)
        while pool.depth()["heavy_running"] == 0:
            time.sleep(0.001)
        queued = [pool.submit(lambda: "big", lane="heavy", cost=10) for _ in range(2)]
        with pytest.raises(QueueFull):
            pool.submit(lambda: None, lane="heavy")
        assert pool.submit(lambda: "small", lane="light").result(timeout=5) == "small"
        assert not any(f.done() for f in queued)
    finally:
        gate.set()
        pool.shutdown()


def test_pool_runs_cheapest_first_and_ages_the_rest() -> None:
    pool = PreprocessPool(light_workers=1, heavy_workers=1, aging_s=1000.0)
    gate, order = threading.Event(), []
    try:
        pool.submit(gate.wait, lane="heavy")
        while pool.depth()["heavy_running"] == 0:
            time.sleep(0.001)
        futs = [pool.submit(lambda c=c: order.append(c), lane="heavy", cost=c)
                for c in (50, 5, 500, 1)]
        gate.set()
        for f in futs:
            f.result(timeout=5)
        assert order == [1, 5, 50, 500]
    finally:
        pool.shutdown()
    aged = PreprocessPool(light_workers=1, heavy_workers=1, aging_s=0.1)
    gate, order = threading.Event(), []
    try:
        aged.submit(gate.wait, lane="heavy")
        while aged.depth()["heavy_running"] == 0:
            time.sleep(0.001)
        old = aged.submit(lambda: order.append("old"), lane="heavy", cost=100)
        # old waits 5 aging periods more than new: 100/6 counts less than 60 (and stays
        # less as long as the worker wakes within 0.65 s of new's arrival)
        time.sleep(0.5)
        new = aged.submit(lambda: order.append("new"), lane="heavy", cost=60)
        gate.set()
        old.result(timeout=5), new.result(timeout=5)
        assert order == ["old", "new"]
    finally:
        aged.shutdown()


def test_pool_deadline_drops_queued_jobs() -> None:
    pool = PreprocessPool(light_workers=1, heavy_workers=1)
    gate, ran = threading.Event(), []

    async def go():
        blocker = asyncio.wrap_future(pool.submit(gate.wait, lane="heavy"))
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await pool.run(lambda: ran.append(1), lane="heavy", deadline=t0 + 0.2)
        waited = time.monotonic() - t0
        gate.set()
        await blocker
        await asyncio.sleep(0.1)
        return waited

    try:
        assert asyncio.run(go()) < 2.0
        assert ran == []  # dropped, never run
        assert pool.depth() == {"light_queued": 0, "light_running": 0, "heavy_queued": 0,
                                "heavy_running": 0}
    finally:
        pool.shutdown()
