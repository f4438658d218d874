"""Client mistakes get a clear 4xx and leave the server serving (null model, in-process ASGI
transport). The fuzz of generated bodies is test_fuzz_hypothesis.py."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from spaceserve.runtime.inputs import ImageLimits  # noqa: E402
from spaceserve.server.app import ServerLimits

from .conftest import MODEL, make_app, null_engine, png

GOOD_PNG = png(56, 56)
GOOD_URL = "data:image/png;base64," + base64.b64encode(GOOD_PNG).decode()
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def image_msg(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def null_app(preprocessor, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "ok.png").write_bytes(GOOD_PNG)
    engine = null_engine(preprocessor, max_model_len=64)
    limits = ServerLimits(max_body_bytes=300_000, images=ImageLimits(
        max_image_bytes=100_000, max_image_pixels=300 * 300, max_images_per_request=2,
        allowed_local_dir=str(media)))
    client, app = make_app(engine, preprocessor, max_pending=1000, limits=limits)
    yield engine, client, app, media
    client.close()


def post(app, body, raw: bytes | None = None, headers: dict | None = None):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            if raw is not None:
                return await c.post("/v1/chat/completions", content=raw, headers=headers)
            return await c.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


BIG = "x" * 400_000


def flat_png_url(h: int, w: int) -> str:
    """A one-colour PNG: many pixels in few bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
CASES = [
    ("malformed json", None, b'{"model": "tiny-test", "messages": [', 400, "not valid JSON"),
    ("not an object", None, b"[1, 2]", 400, "JSON object"),
    ("missing messages", {"model": MODEL}, None, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, None, 400, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("unknown model", OK | {"model": "gpt-9"}, None, 404, "does not exist"),
    ("temperature", OK | {"temperature": 2.5}, None, 400, "temperature"),
    ("top_p", OK | {"top_p": 0}, None, 400, "top_p"),
    ("max_tokens", OK | {"max_tokens": 0}, None, 400, "max_tokens"),
    ("max_tokens type", OK | {"max_tokens": "5"}, None, 400, "max_tokens"),
    ("seed", OK | {"seed": -1}, None, 400, "seed"),
    ("n", OK | {"n": 0}, None, 400, "n: "),
    ("n too large", OK | {"n": 129}, None, 400, "n: "),
    ("stream_options", OK | {"stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("context", OK | {"max_tokens": 60}, None, 400, "maximum context length"),
    ("bad base64", OK | {"messages": image_msg("data:image/png;base64,@@@")}, None, 400,
     "base64"),
    ("not an image", OK | {"messages": image_msg("data:image/png;base64," +
                                                 base64.b64encode(b"hello").decode())},
     None, 400, "not a PNG, JPEG, WebP, GIF or BMP image"),
    ("remote url", OK | {"messages": image_msg("https://example.com/a.png")}, None, 400,
     "remote"),
    ("file outside", OK | {"messages": image_msg("file:///etc/passwd")}, None, 400,
     "not allowed or not found"),
    ("too many pixels", OK | {"messages": image_msg(flat_png_url(400, 400))}, None, 400,
     "pixels"),
    ("too many images", OK | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": GOOD_URL}}] * 3}]}, None, 400, "at most 2"),
    ("oversized body", OK | {"messages": [{"role": "user", "content": BIG}]}, None, 413,
     "limit"),
]


@pytest.mark.parametrize("name,body,raw,status,needle", CASES, ids=[c[0] for c in CASES])
def test_client_errors_are_4xx(null_app, name, body, raw, status, needle) -> None:
    engine, client, app, _ = null_app
    r = post(app, body, raw, {"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = post(app, OK)  # still serving
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_file_url_inside_allowed_folder(null_app) -> None:
    _, _, app, media = null_app
    r = post(app, OK | {"messages": image_msg(f"file://{media}/ok.png")})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] > 4  # the 2x2 merged grid's 4 tokens included


def test_a_long_stop_string_is_a_400_naming_stop(null_app) -> None:
    """Stop strings are matched on every token, so each is bounded: the engine's SamplingParams
    refuses a longer one naming `stop`, and the server answers 400 with param `stop`; one at
    the bound is served."""
    from spaceserve.runtime.core.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams

    assert MAX_STOP_STRING_CHARS == 1000
    with pytest.raises(ValueError, match=r"^stop: string 1 has 10000 characters, at most 1000"):
        SamplingParams(stop=["ok", "x" * 10_000])
    assert SamplingParams(stop="x" * 1000).stop == ("x" * 1000,)
    _, _, app, _ = null_app
    for stop in ("x" * 10_000, ["a", "x" * 10_000]):
        r = post(app, OK | {"stop": stop})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop" and "10000 characters, at most 1000" in err["message"]
        assert err["message"].startswith("stop: ") and "Value error" not in err["message"]
    assert post(app, OK | {"stop": "x" * 1000}).status_code == 200


def test_a_5000_digit_integer_is_a_400_in_our_words(null_app) -> None:
    """JSON's integers are unbounded, Python's int(str) stops at 4300 digits: the 400 says so
    without Python's own advice to the server's operator."""
    _, _, app, _ = null_app
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": %s}' % (
        MODEL.encode(), b"9" * 5000)
    r = post(app, None, raw, {"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message == "a number in the body has more than 4300 digits", message
    assert "sys." not in message
