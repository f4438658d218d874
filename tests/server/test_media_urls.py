"""Videos and remote media URLs through the live server and the official openai client.

A short synthetic clip (encoded here with PyAV) sent as a ``video_url`` to the tiny Qwen2-VL:
usage counts exactly its video tokens (3 temporal patches of 2x3 merged tokens), the tokens
equal `Engine.generate` on the same prompt with the clip's bytes, streaming usage agrees.
Remote URLs against a local HTTP server on 127.0.0.1 (the test-only loopback opt-in on): an
allowed domain answers like the same image inline; other hosts, oversize bodies, slow hosts and
redirects off the list get a 400 naming the content part; with the opt-in off a name
resolving to 127.0.0.1 gets a 400; a server without allowed domains refuses http(s) URLs."""

from __future__ import annotations

import base64
import json

import pytest

from spaceserve import SamplingParams
from spaceserve.runtime.inputs import ImageLimits, RemotePolicy
from tests.clips import encode_clip, flat_frames
from tests.media_server import MediaServer

from .conftest import MODEL, make_app, null_engine, png

pytest.importorskip("av")
pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from spaceserve.server.app import ServerLimits, ServerThread  # noqa: E402
from spaceserve.server.openai.protocol import chat_messages, parse_request  # noqa: E402

# 12 frames of 60x90 at 4 fps = 3 s: 6 frames sampled at 2 fps, resized to 56x84 (4x6 patches):
# 3 temporal patches x (2x3 merged) = 18 video tokens
CLIP = encode_clip(flat_frames(12, 60, 90), fps=4)
CLIP_URL = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()
VIDEO_TOKENS = 3 * 2 * 3
PARAMS = dict(max_tokens=4, temperature=0.7, seed=5)


def video_messages(url: str = CLIP_URL) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens here?"}]}]


@pytest.fixture(scope="module")
def openai_client(live_tiny):
    import openai

    return openai.OpenAI(base_url=live_tiny[1].url + "/v1", api_key="unused", max_retries=0)


def test_video_through_the_official_client(openai_client, tiny_engine) -> None:
    engine, pre = tiny_engine
    r = openai_client.chat.completions.create(
        model=MODEL, messages=video_messages(), **PARAMS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.prompt_token_ids
    assert ids.count(pre.video_token_id) == VIDEO_TOKENS
    assert pre.image_token_id not in ids
    text = pre.render(chat_messages(parse_request(json.dumps(
        {"model": MODEL, "messages": video_messages()}).encode())))[0]
    n_text = len(pre.tokenizer(text)["input_ids"])  # one placeholder for the video
    assert r.usage.prompt_tokens == len(ids) == n_text - 1 + VIDEO_TOKENS
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    # the engine's offline path on the clip's bytes gives the same prompt and tokens
    out = engine.generate({"prompt": text, "videos": [CLIP]},
                          SamplingParams(ignore_eos=True, **PARAMS))[0]
    assert out.prompt_token_ids == ids and out.token_ids == r.choices[0].token_ids
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=video_messages(), **PARAMS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == 4


def test_bad_videos_are_clear_400s(openai_client) -> None:
    import openai

    for url, match in [("data:video/mp4;base64,AAAA", "cannot open video"),
                       ("data:image/png;base64,AAAA", "is not a video"),
                       ("https://example.com/a.mp4", "not fetched")]:
        with pytest.raises(openai.BadRequestError) as info:
            openai_client.chat.completions.create(model=MODEL, messages=video_messages(url),
                                                  max_tokens=2)
        body = info.value.body
        assert match in body["message"], body
        assert body["param"] == "messages[0].content[0].video_url"


@pytest.fixture(scope="module")
def media():
    with MediaServer(png(40, 50, seed=2), CLIP) as s:
        yield s


def _live(preprocessor, remote: RemotePolicy | None):
    engine = null_engine(preprocessor)
    limits = ServerLimits(max_body_bytes=1 << 20, images=ImageLimits(max_image_bytes=200_000),
                          remote=remote)
    return make_app(engine, preprocessor, limits=limits)


@pytest.fixture(scope="module")
def remote_server(preprocessor):
    policy = RemotePolicy(("localhost",), allow_loopback=True, read_timeout=0.5,
                          total_timeout=2.0)
    client, app = _live(preprocessor, policy)
    with ServerThread(app) as server:
        yield server
    client.close()
    app.state.fetcher.close()


def _ask(server, url: str, kind: str = "image_url") -> tuple[int, dict]:
    import httpx

    body = {"model": MODEL, "max_tokens": 2, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": kind, kind: {"url": url}},
                                                       {"type": "text", "text": "hi"}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    return r.status_code, r.json()


def test_remote_urls_through_the_server(remote_server, media) -> None:
    status, body = _ask(remote_server, media.url("/img.png"))
    assert status == 200, body
    inline = "data:image/png;base64," + base64.b64encode(media.image).decode()
    assert body["prompt_token_ids"] == _ask(remote_server, inline)[1]["prompt_token_ids"]
    status, body = _ask(remote_server, media.url("/clip.mp4"), "video_url")
    assert status == 200 and body["usage"]["prompt_tokens"] > VIDEO_TOKENS
    for path, host, match in [
        ("/img.png", "127.0.0.1", "are not allowed"),
        ("/big.png", "localhost", "image larger than 200000 bytes"),
        ("/slow.png", "localhost", "timed out"),
        ("/redirect-out", "localhost", "'127.0.0.1'"),
    ]:
        status, body = _ask(remote_server, media.url(path, host=host))
        err = body["error"]
        assert status == 400 and match in err["message"], (path, body)
        assert err["param"] == "messages[0].content[0].image_url"
        assert err["type"] == "invalid_request_error"


def test_remote_media_types_are_checked_against_the_bytes(remote_server, media) -> None:
    """A remote answer's Content-Type is checked against the bytes as a data URL's type is,
    and the same format allow-lists apply: PostScript labelled image/png never reaches a
    PostScript decoder, an mp4 labelled video/webm or an image labelled video/mp4 is refused;
    each a 400 naming the content part, with no object reprs."""
    for path, kind, match in [
        ("/eps.png", "image_url", "looks like PostScript/EPS"),
        ("/clip.webm", "video_url", "the Content-Type says video/webm"),
        ("/img.mp4", "video_url", "cannot open video"),
    ]:
        status, body = _ask(remote_server, media.url(path), kind)
        err = body["error"]
        assert status == 400 and match in err["message"], (path, body)
        assert err["param"] == f"messages[0].content[0].{kind}" and " at 0x" not in \
            err["message"]


def test_media_are_read_however_the_fetches_race_the_check(preprocessor, monkeypatch) -> None:
    """Remote fetches still on their way when the server first looks and done when it looks
    again: the media are still read before decoding (this race once skipped the read and
    answered 500)."""
    from concurrent.futures import Future

    from spaceserve.server.openai import protocol as P

    done: Future = Future()
    done.set_result(None)

    class Racing:  # a request's fetches: pending at the first look, finished after
        looks = 0

        def pending(self) -> list:
            self.looks += 1
            return [done] if self.looks == 1 else []

        def __exit__(self, *exc) -> None:
            pass

    start = P.start_chat

    def racing_start(*a, **k):
        plan = start(*a, **k)
        plan.fetches = Racing()
        return plan

    monkeypatch.setattr(P, "start_chat", racing_start)
    client, app = _live(preprocessor, None)
    try:
        with ServerThread(app) as server:
            status, body = _ask(server, "data:image/png;base64," + base64.b64encode(
                png(40, 50)).decode())
            assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    finally:
        client.close()


def test_without_the_opt_in_loopback_names_are_refused(preprocessor, media) -> None:
    client, app = _live(preprocessor, RemotePolicy(("localhost",)))
    try:
        with ServerThread(app) as server:
            seen = len(media.hosts)
            status, body = _ask(server, media.url("/img.png"))
            assert status == 400 and "a loopback address" in body["error"]["message"]
            assert len(media.hosts) == seen  # nothing was sent
    finally:
        client.close()
        app.state.fetcher.close()


def test_remote_urls_are_off_by_default(preprocessor, media) -> None:
    client, app = _live(preprocessor, None)
    try:
        with ServerThread(app) as server:
            status, body = _ask(server, media.url("/img.png"))
            assert status == 400 and "not fetched" in body["error"]["message"]
    finally:
        client.close()


def test_serve_flags_build_the_policy() -> None:
    from spaceserve.server.app import build_parser
    from spaceserve.server.media_args import media_limits

    args = build_parser().parse_args(["--allowed-media-domains", "a.example", "b.example,c.test",
                                      "--media-fetch-timeout", "9", "--max-video-frames", "99"])
    videos, remote = media_limits(args)
    assert remote.allowed_domains == ("a.example", "b.example", "c.test")
    assert remote.total_timeout == 9.0 and not remote.allow_loopback
    assert videos.max_video_frames == 99
    assert media_limits(build_parser().parse_args([]))[1] is None
